"""Dequantize a 4-bit checkpoint to dense weights. Runs under the quantize env.

Reads compressed-tensors (through transformers) and the GPTQ and AWQ-gemm packed formats
that AutoGPTQ and AutoAWQ wrote (unpacked here; those libraries no longer install).

For an engine that lacks a scheme's kernel (see pipeline/engines/vllm/support.py): the dense weights
equal the quantized values exactly (each group still holds at most 2^bits distinct
values), so quality measured on them is the quantized model's quality. They are written in float32
whatever the checkpoint's dtype: a 4-bit integer times a 16-bit scale needs up to 11 significant bits,
more than bfloat16 holds, so a bfloat16 copy would round the very values it stands for (an engine
computing in a 16-bit dtype rounds them as it loads, as its own kernel would).

    <quantize-env>/bin/python -m pipeline.engines.workers.dequantize_worker CHECKPOINT OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def unpack_int32(packed, bits: int, along_rows: bool, order=None):
    """int32 words holding 32/bits values each, lowest bits first -> one value per element."""
    import torch

    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if along_rows:  # [K/per, N] -> [K, N]
        vals = (packed.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
        return vals.reshape(packed.shape[0] * per, packed.shape[1])
    vals = (packed.unsqueeze(2) >> shifts.view(1, 1, per)) & ((1 << bits) - 1)  # [K, N/per, per]
    if order is not None:  # AWQ interleaves the 8 nibbles of a word: undo it
        inverse = torch.argsort(torch.tensor(order))
        vals = vals[:, :, inverse]
    return vals.reshape(packed.shape[0], packed.shape[1] * per)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def dense_from_packed(tensors: dict, qc: dict, dtype) -> dict:
    """GPTQ / AWQ-gemm Linear weights -> dense [out, in] weights; other tensors unchanged."""
    import torch

    bits, method = int(qc.get("bits") or qc.get("w_bit") or 4), qc["quant_method"]
    group = int(qc.get("group_size") or qc.get("q_group_size") or -1)
    out = {}
    prefixes = {k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")}
    for k, v in tensors.items():
        if not any(k.startswith(p + ".") for p in prefixes):
            out[k] = v.to(dtype) if v.is_floating_point() else v
    for p in sorted(prefixes):
        scales = tensors[p + ".scales"].float()  # [groups, N]
        if method == "awq":
            q = unpack_int32(tensors[p + ".qweight"], bits, False, AWQ_ORDER)  # [K, N]
            z = unpack_int32(tensors[p + ".qzeros"], bits, False, AWQ_ORDER)  # [groups, N]
            k_in = q.shape[0]
            gidx = torch.arange(k_in) // (group if group > 0 else k_in)
        else:  # gptq (AutoGPTQ v1 format: zeros stored minus one)
            q = unpack_int32(tensors[p + ".qweight"], bits, True)  # [K, N]
            z = unpack_int32(tensors[p + ".qzeros"], bits, False) + 1
            k_in = q.shape[0]
            gidx = (tensors[p + ".g_idx"].long() if p + ".g_idx" in tensors
                    else torch.arange(k_in) // (group if group > 0 else k_in))
        w = (q.float() - z[gidx].float()) * scales[gidx]
        out[p + ".weight"] = w.t().contiguous().to(dtype)
    return out


def dequantize_packed(src: Path, out: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    dtype = torch.float32  # exact products (module docstring)
    cfg["dtype"] = "float32"
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("*.safetensors")):
        save_file(dense_from_packed(load_file(f), qc, dtype), out / f.name, metadata={"format": "pt"})
    for f in src.iterdir():  # tokenizer, generation config, shard index
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    index = out / "model.safetensors.index.json"
    if index.exists():  # tensor names changed (qweight -> weight): map them again
        from safetensors import safe_open

        weight_map = {}
        for f in sorted(out.glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                weight_map.update({k: f.name for k in st.keys()})
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def dequantize(src: Path, out: Path) -> None:
    method = json.loads((src / "config.json").read_text()).get("quantization_config", {}).get("quant_method")
    if method in ("gptq", "awq"):
        return dequantize_packed(src, out)
    return dequantize_compressed(src, out)


def dequantize_compressed(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    dtype = torch.float32  # exact products (module docstring); scales are upcast before they multiply
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
        sys.exit("usage: python -m pipeline.engines.workers.dequantize_worker CHECKPOINT OUT_DIR")
    dequantize(Path(sys.argv[1]), Path(sys.argv[2]))
