"""Quantize one model with llm-compressor `oneshot`. Runs under the *quantize* environment.

llm-compressor pins a compressed-tensors release that vllm cannot share, so this file is
the only one that imports llmcompressor, and it runs as its own process:

    <quantize-env>/bin/python -m pipeline.engines.workers.quantize_worker SPEC.json RESULT.json

SPEC names the model directory, output directory, scheme, calibration JSONL and sizes;
RESULT gets wall time, peak RSS, the llm-compressor recipe used and library versions.
The checkpoint keeps the recipe (llm-compressor writes recipe.yaml beside the weights).
It imports nothing from this package but the scheme table (pipeline/schemes.py, standard
library only) and the dequantize worker (for engines that need a dense copy, written while
this process is up), on purpose.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

from pipeline import schemes


def build_recipe(spec: dict) -> dict:
    """The llm-compressor recipe of a worker spec (the scheme table builds it: pipeline/schemes.py)."""
    config = Path(spec.get("model_dir", "")) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    try:
        return schemes.llmc_recipe(spec["scheme"], spec["ignore"], spec.get("group_size"), spec.get("kv_cache", "auto"),
                                   spec.get("smoothing_strength", 0.8), model_type)
    except ValueError as exc:
        raise SystemExit(f"quantize_worker: {exc}") from None


def calibration_dataset(spec: dict, tokenizer):
    from datasets import Dataset

    texts = []
    with open(spec["calibration_file"]) as f:
        for line in f:
            if line.strip():
                texts.append(json.loads(line)["text"])
            if len(texts) >= spec["num_samples"]:
                break
    enc = tokenizer(texts, max_length=spec["max_seq_len"], truncation=True, padding=False)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def patch_cpu_only() -> None:
    """llm-compressor 0.13/0.14 AWQ pins intermediates unconditionally; pinning needs an
    accelerator ("Cannot access accelerator device when none is available"). Pinning only
    speeds host->device copies, so without an accelerator it is correctly a no-op."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, *a, **k: None


def restore_dtype(out: Path, dtype: str) -> None:
    """Calibrating in float32 (fast on CPUs without native bf16) saves float tensors as
    float32; cast them back to the model's own dtype so checkpoint sizes compare fairly.
    Packed integer and FP8 weights are untouched; scales round to the dtype they would have had."""
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        # only what calibration widened: FP8 weights and integer packs stay as written
        cast = {k: (v.to(target) if v.dtype == torch.float32 else v) for k, v in tensors.items()}
        save_file(cast, f, metadata={"format": "pt"})
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = dtype
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def bnb_int8(spec: dict, out: Path) -> str:
    """bitsandbytes LLM.int8 weights written by transformers (vLLM loads such checkpoints;
    4-bit NF4 is instead quantized by vLLM itself at load, so it never comes here)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    cfg = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=list(spec["ignore"]))
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], quantization_config=cfg,
                                                 trust_remote_code=spec["trust_remote_code"])
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(spec["model_dir"]).save_pretrained(out)
    return f"transformers BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules={list(spec['ignore'])})"


def main(spec_path: str, result_path: str) -> None:
    import yaml

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    scheme = schemes.SCHEMES.get(spec["scheme"])
    if scheme is not None and scheme.producer == "transformers":  # bnb_int8: written by transformers
        import bitsandbytes
        import torch
        import transformers

        recipe_text = bnb_int8(spec, Path(spec["out_dir"]))
        finish(result_path, t0, recipe_text, 0, 0,
               {"bitsandbytes": bitsandbytes.__version__, "transformers": transformers.__version__,
                "torch": torch.__version__})
        return
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    patch_cpu_only()
    torch.manual_seed(spec.get("seed", 0))
    out = Path(spec["out_dir"])
    if spec.get("recipe_file"):  # a user's own llm-compressor recipe, used unchanged
        recipe_text = Path(spec["recipe_file"]).read_text()
    else:
        recipe_text = yaml.safe_dump(build_recipe(spec), sort_keys=False)
    tok = AutoTokenizer.from_pretrained(spec["model_dir"], trust_remote_code=spec["trust_remote_code"])
    cfg = json.loads((Path(spec["model_dir"]) / "config.json").read_text())
    model_dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=spec.get("calibration_dtype", "auto"), trust_remote_code=spec["trust_remote_code"])
    ds = calibration_dataset(spec, tok)
    oneshot(model=model, tokenizer=tok, recipe=recipe_text, dataset=ds,
            num_calibration_samples=len(ds), max_seq_length=spec["max_seq_len"],
            shuffle_calibration_samples=False, output_dir=str(out))
    tok.save_pretrained(out)
    if spec.get("calibration_dtype", "auto") not in ("auto", model_dtype):
        restore_dtype(out, model_dtype)
    if not (out / "recipe.yaml").exists():  # the checkpoint must say how it was made
        (out / "recipe.yaml").write_text(recipe_text)
    if spec.get("dense_out"):  # the engine lacks this scheme's kernel: dense copy, same process
        from pipeline.engines.workers.dequantize_worker import dequantize

        dequantize(out, Path(spec["dense_out"]))
    finish(result_path, t0, recipe_text, len(ds), int(sum(len(x) for x in ds["input_ids"])),
           {"llmcompressor": llmcompressor.__version__, "compressed-tensors": compressed_tensors.__version__,
            "transformers": transformers.__version__, "torch": torch.__version__})


def finish(result_path: str, t0: float, recipe_text: str, sequences: int, tokens: int,
           versions: dict) -> None:
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    result = {"wall_s": wall, "peak_rss_bytes": peak, "recipe": recipe_text,
              "calibration_sequences": sequences, "calibration_tokens": tokens, "versions": versions}
    tmp = result_path + ".tmp"
    Path(tmp).write_text(json.dumps(result, indent=2))
    os.replace(tmp, result_path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pipeline.engines.workers.quantize_worker SPEC.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
