"""Convert a GGUF file to a bf16 safetensors Hugging Face model directory.

transformers dequantizes GGUF on load but refuses to save that object ("quantized with
gguf and is not serializable"), so we build a fresh model from its config without the
quantization config, load the dequantized state dict, cast to bf16 and save.

    python -m pipeline.engines.workers.convert_gguf GGUF_FILE OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.engines.workers import gguf_tokenizer


def convert(gguf_file: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    if gguf_tokenizer.needs_rebuild(gguf_file):
        from transformers import PreTrainedTokenizerFast

        built, special = gguf_tokenizer.build(gguf_file)
        tok = PreTrainedTokenizerFast(tokenizer_object=built, bos_token=special.get("bos"),
                                      eos_token=special.get("eos"), unk_token=special.get("unknown"),
                                      pad_token=special.get("padding"), chat_template=tok.chat_template)
    check_tokenizer(tok)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # tied embeddings may be reported missing for lm_head; anything else is a real gap
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"GGUF conversion: missing {missing[:5]} unexpected {unexpected[:5]}")
    fresh = fresh.to(torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)


SENTENCE = "The capital of France is Paris, and the river that runs through it is the Seine."


def check_tokenizer(tok) -> None:
    """A tokenizer that splits plain English into single characters was built wrong (transformers reads
    some GGUF tokenizers so): the model it would serve answers garbage, so the conversion stops here."""
    ids = tok(SENTENCE).input_ids
    if len(ids) > len(SENTENCE) / 2:
        raise SystemExit(f"GGUF conversion: the tokenizer splits a plain sentence into {len(ids)} tokens "
                         f"({len(SENTENCE)} characters): it was not rebuilt correctly from the GGUF")
    if tok.decode(ids, skip_special_tokens=True).strip() != SENTENCE:
        raise SystemExit("GGUF conversion: the tokenizer does not decode a plain sentence back to itself")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pipeline.engines.workers.convert_gguf GGUF_FILE OUT_DIR")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
