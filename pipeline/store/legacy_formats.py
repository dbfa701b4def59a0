"""Write GPTQ- and AWQ-format checkpoints the way AutoGPTQ / AutoAWQ laid them out.

    quantize-eval make-legacy MODEL_DIR OUT_DIR --format gptq|awq [--group 64]

Those libraries no longer install beside current torch, yet their checkpoints are still
what many teams hold. To try `scheme: import` (recipes/import.yaml) without one, this
writes a round-to-nearest 4-bit quantization of a model in either layout, packed with
vLLM's own helpers (`gptq_pack`, `awq_pack`, `pack_cols`: the engine that loads such
checkpoints). It is RTN, not GPTQ or AWQ: only the *format* is theirs. Runs in the engine
env. The exact dequantized values are returned too (tests check the dequantizer on them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn4(w, group: int):
    """[N, K] float weight -> q [K, N] ints 0..15, zero [G, N] ints, scale [G, N] (asymmetric)."""
    import torch

    wt = w.t().float()  # [K, N]
    k, n = wt.shape
    g = wt.reshape(k // group, group, n)
    lo, hi = g.amin(1), g.amax(1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale.unsqueeze(1) + zero.unsqueeze(1)).clamp(0, 15).reshape(k, n)
    return q.to(torch.int32), zero.to(torch.int32), scale


def write(base: Path, out: Path, fmt: str, group: int = 64) -> dict:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack, gptq_pack, pack_cols

    tensors = {}
    for f in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(f))
    out.mkdir(parents=True, exist_ok=True)
    written, reference = {}, {}
    for name, w in tensors.items():
        prefix = name[: -len(".weight")]
        if not (name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS):
            written[name] = w
            continue
        q, z, s = rtn4(w, group)
        k, n = q.shape
        reference[prefix] = ((q.float() - z.repeat_interleave(group, 0).float())
                             * s.repeat_interleave(group, 0)).t().contiguous()
        if fmt == "gptq":  # AutoGPTQ v1: rows packed, zeros stored minus one
            written[prefix + ".qweight"] = gptq_pack(q, 4, k, n)
            written[prefix + ".qzeros"] = pack_cols(z - 1, 4, k // group, n)
            written[prefix + ".g_idx"] = torch.arange(k, dtype=torch.int32) // group
        else:  # AutoAWQ gemm: columns packed in the interleaved order
            written[prefix + ".qweight"] = awq_pack(q, 4, k, n)
            written[prefix + ".qzeros"] = awq_pack(z, 4, k // group, n)
        written[prefix + ".scales"] = s.to(torch.float16)
        reference[prefix] = ((q.float() - z.repeat_interleave(group, 0).float())
                             * s.to(torch.float16).float().repeat_interleave(group, 0)).t().contiguous()
    save_file({k: v.contiguous() for k, v in written.items()}, out / "model.safetensors")
    cfg = json.loads((base / "config.json").read_text())
    cfg["dtype"] = "float16"
    cfg["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
         "checkpoint_format": "gptq"} if fmt == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    return reference
