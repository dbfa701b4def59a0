"""Facts about a checkpoint read from its safetensors headers (no tensor is loaded).

Bits per weight *in effect* = every weight byte on disk (packed values, scales, zero
points, and whatever was left unquantized) x 8 / the base model's parameter count: what a
deployment actually pays per parameter, not the nominal 4 or 8.
"""

from __future__ import annotations

import json
import struct
from math import prod
from pathlib import Path

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def tensor_table(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    table = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                table[name] = (meta["dtype"], tuple(meta["shape"]))
    return table


def parameter_count(model_dir: Path) -> int:
    return sum(prod(shape) for _, shape in tensor_table(model_dir).values())


def facts(ckpt: Path, base: Path, on_disk_bytes: int) -> dict:
    """bits per weight in effect, and the 2-D weights left in floating point."""
    table = tensor_table(ckpt)
    unquantized = sorted(name.rsplit(".", 1)[0] for name, (dtype, shape) in table.items()
                         if name.endswith(".weight") and len(shape) == 2 and dtype in FLOAT_DTYPES)
    params = parameter_count(base)
    return {"bits_per_weight": round(on_disk_bytes * 8 / params, 3) if params else None,
            "base_parameters": params, "unquantized_modules": unquantized,
            "tensor_dtypes": sorted({dtype for dtype, _ in table.values()})}
