"""Dequantize a compressed-tensors checkpoint to dense weights. Runs under the quantize env.

For an engine that lacks a scheme's kernel (see pipeline/support.py): the dense weights
equal the quantized values exactly (each group still holds at most 2^bits distinct
values), so quality measured on them is the quantized model's quality.

    <quantize-env>/bin/python -m pipeline.engines.dequantize_worker CHECKPOINT OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def dequantize(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    cfg_json = json.loads((src / "config.json").read_text())
    dtype = getattr(torch, cfg_json.get("dtype") or cfg_json.get("torch_dtype") or "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(
        src, dtype=dtype, quantization_config=CompressedTensorsConfig(run_compressed=False))
    state = {k: v for k, v in model.state_dict().items()
             if not k.rsplit(".", 1)[-1].startswith(("weight_scale", "weight_zero_point", "weight_shape",
                                                     "weight_g_idx", "weight_global_scale"))}
    config = AutoConfig.from_pretrained(src)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    dense = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = dense.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"dequantize: missing {missing[:5]} unexpected {unexpected[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    dense.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pipeline.engines.dequantize_worker CHECKPOINT OUT_DIR")
    dequantize(Path(sys.argv[1]), Path(sys.argv[2]))
