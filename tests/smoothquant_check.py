"""Run in the quantize environment: SmoothQuant alone, no quantization, on a tiny Gemma 3 built from a config.

Smoothing is meant to be an exact rewrite (activations divided by s, the next weights multiplied by s);
quantization error comes later. Prints, as JSON, the largest change of the logits relative to their range
after smoothing with the mappings pipeline/schemes.py gives this model, and after llm-compressor's own
default mappings (which smooth gate/up against post_attention_layernorm, a norm on the attention's output)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def changed(mappings, tokenizer_dir: str, work: Path) -> float:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                           sliding_window=16)
    model = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # trained Gemma norms are far from zero (a fresh one is all zeros)
                p.normal_(0.0, 0.5)
    model.save_pretrained(work)  # oneshot wants a model that names where it came from
    model = Gemma3ForCausalLM.from_pretrained(work, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    sq = SmoothQuantModifier(smoothing_strength=0.8, mappings=mappings)
    oneshot(model=model, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir), dataset=ds, recipe=[sq],
            num_calibration_samples=4, max_seq_length=16)
    with torch.no_grad():
        after = model(ids).logits
    return float((after - before).abs().max() / (before.max() - before.min()))


def main() -> None:
    from pipeline import schemes

    recipe = schemes.llmc_recipe("w8a8_int8", ["lm_head"], model_type="gemma3_text")
    ours = recipe["quant_stage"]["quant_modifiers"]["SmoothQuantModifier"].get("mappings")
    out, tokenizer_dir = sys.argv[1:3]  # any tokenizer: the ids are given, oneshot only asks for one
    work = Path(out).parent  # the caller's folder: the tiny models are written beside the answer
    got = {"ours": changed(ours, tokenizer_dir, work / "tiny-ours"),
           "default": changed(None, tokenizer_dir, work / "tiny-default")}
    with open(out, "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    main()
