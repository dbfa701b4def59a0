"""Is a dense copy exactly the quantized model? Runs under the quantize environment.

    <quantize-env>/bin/python tests/emulation_check.py CHECKPOINT DENSE_DIR OUT.json

For every quantized Linear of a compressed-tensors checkpoint, under the config group that targets it (a
mixed checkpoint has several): compressed-tensors' own decompression (the library that wrote it), fed its
scales in float32 so the products are exact, must equal the dense copy's weight bit for bit, compared in
float64 so no cast can hide a rounding; every quantization group of the dense weight must hold at most
2^bits distinct values; and every other tensor (embeddings, norms, an unquantized head) must equal the
checkpoint's. A comparison that found no quantized module exits non-zero. OUT gets the counts
(tests/test_schemes.py, test_integration.py).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

QUANT_PARAMS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                "weight_global_scale", "input_scale", "input_zero_point")


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def group_of(module: str, groups: dict) -> str:
    """The config group whose targets name this module: a `re:` target that matches it before a class name
    (compressed-tensors' own precedence); every module checked here is a Linear."""
    for name, g in groups.items():
        if any(t.startswith("re:") and re.fullmatch(t[3:], module) for t in g.get("targets", [])):
            return name
    for name, g in groups.items():
        if "Linear" in g.get("targets", ["Linear"]):
            return name
    raise ValueError(f"{module}: no config group targets it")


def main(ckpt: Path, dense_dir: Path, out: Path) -> int:
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    groups = {k: g for k, g in qc["config_groups"].items() if g.get("weights")}
    packed, dense = tensors(ckpt), tensors(dense_dir)
    modules = sorted(k[: -len(".weight_packed")] for k in packed if k.endswith(".weight_packed"))
    result = {"modules": len(modules), "exact": 0, "max_distinct_per_group": 0, "groups_checked": 0,
              "config_groups": {}, "mismatch": [], "other_tensors": 0, "other_exact": 0, "other_mismatch": []}
    for m in modules:
        gname = group_of(m, groups)
        g = groups[gname]
        scheme = QuantizationScheme.model_validate({**g, "targets": g.get("targets", ["Linear"])})
        bits, group = scheme.weights.num_bits, scheme.weights.group_size
        result["config_groups"].setdefault(gname, {"bits": bits, "group": group, "modules": 0})["modules"] += 1
        result.update(bits=bits, group=group)  # the last group's, for single-scheme callers
        local = {k[len(m) + 1:]: (v.float() if v.is_floating_point() else v)
                 for k, v in packed.items() if k.startswith(m + ".")}
        ref = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        d = dense[m + ".weight"]
        if ref.shape == d.shape and torch.equal(ref.double(), d.double()):
            result["exact"] += 1
        else:
            result["mismatch"].append(m)
        width = group or d.shape[1]  # per channel: the whole row is one group
        rows = d.double().reshape(-1, width)
        srt = rows.sort(dim=1).values  # every group, not a sample: distinct values = 1 + steps in sorted order
        distinct = int((1 + (srt[:, 1:] != srt[:, :-1]).sum(dim=1)).max())
        result["groups_checked"] += rows.shape[0]
        result["max_distinct_per_group"] = max(result["max_distinct_per_group"], distinct)
    for k, v in packed.items():
        if k.rsplit(".", 1)[-1] in QUANT_PARAMS or not v.is_floating_point():
            continue
        result["other_tensors"] += 1
        if k in dense and dense[k].shape == v.shape and torch.equal(dense[k].double(), v.double()):
            result["other_exact"] += 1
        else:
            result["other_mismatch"].append(k)
    out.write_text(json.dumps(result))
    if not modules:
        print(f"{ckpt}: no quantized module to compare (a check of nothing is not a pass)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
