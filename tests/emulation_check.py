"""Is a dense copy exactly the quantized model? Runs under the quantize environment.

    <quantize-env>/bin/python tests/emulation_check.py CHECKPOINT DENSE_DIR OUT.json

For every 4-bit Linear of a compressed-tensors checkpoint: compressed-tensors' own decompression
of the packed weight (the library that wrote it), cast to the dense copy's dtype, must equal the
dense copy's weight bit for bit; and each quantization group of the dense weight must hold at
most 2^bits distinct values. OUT gets the counts (tests/test_schemes.py, test_integration.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def main(ckpt: Path, dense_dir: Path, out: Path) -> None:
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    groups = [g for g in qc["config_groups"].values() if g.get("weights")]
    scheme = QuantizationScheme.model_validate({**groups[0], "targets": groups[0].get("targets", ["Linear"])})
    bits, group = scheme.weights.num_bits, scheme.weights.group_size
    packed, dense = tensors(ckpt), tensors(dense_dir)
    modules = sorted(k[: -len(".weight_packed")] for k in packed if k.endswith(".weight_packed"))
    result = {"modules": len(modules), "exact": 0, "max_distinct_per_group": 0, "bits": bits, "group": group,
              "mismatch": []}
    for m in modules:
        local = {k[len(m) + 1:]: v for k, v in packed.items() if k.startswith(m + ".")}
        ref = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        d = dense[m + ".weight"]
        if torch.equal(ref.to(d.dtype), d):
            result["exact"] += 1
        else:
            result["mismatch"].append(m)
        g = group or d.shape[1]  # per channel: the whole row is one group
        per_group = d.float().reshape(d.shape[0], d.shape[1] // g, g)
        distinct = max(len(torch.unique(row)) for row in per_group.reshape(-1, g)[:4096])
        result["max_distinct_per_group"] = max(result["max_distinct_per_group"], distinct)
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
