"""An anchor tool's choice of which decoder Linear layers get 8-bit weights, at the same average bits as a given
choice (the search data's pick), counted the tool's own way. Runs under the *quantize* environment:

    <quantize-env>/bin/python -m pipeline.engines.workers.anchor_worker SPEC.json RESULT.json

tool auto_round: Intel auto-round's AutoScheme, only its scoring and selection (GenScheme.get_layer_config),
not its tuning or export: the search builds the choice itself, so only the choice is compared. Its options are
the search's own two widths (the base scheme's bits, symmetry and group size; 8-bit symmetric per output
channel, auto-round's group_size -1), activations at 16 bits. q/k/v and gate/up are chosen together
(shared_layers): vLLM fuses each into one Linear, which cannot mix widths. lm_head and the embeddings are not
among the layers it is given, so they are neither chosen nor counted, as in the search's own weights.

auto-round counts bits per weight over the layers it is given, scales and zero points included
(auto_scheme/utils.py compute_avg_bits_for_scheme), and chooses the lowest-loss assignment at or under the
target. The target here is the pick's own bits by that count, so both sides spend the same budget.

Calibration: auto-round drops texts shorter than its sequence length, so the first `num_samples` calibration
texts at least `max_seq_len` tokens long are given to it. Its on-disk score cache is keyed by folder and file
names, not contents, so it runs in a temporary folder; the result is cached by the caller.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict


def _quiet_knobs(threads: int) -> None:
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[k] = "1"
    os.environ["AR_ENABLE_AUTO_SCHEME_PARALLEL"] = "0"  # its spawned scorers are for GPUs
    os.environ["AR_DISABLE_DATASET_SUBPROCESS"] = "1"  # else the dataset is built twice
    for k in ("AR_AUTO_SCHEME_NSAMPLES", "AR_AUTO_SCHEME_SEQLEN", "AR_AUTO_SCHEME_BATCH_SIZE"):
        os.environ.pop(k, None)  # these override the arguments given to AutoScheme
    os.environ["OMP_NUM_THREADS"] = str(threads)


def options(spec: dict):
    """The two widths AutoScheme chooses between: the search's base scheme, and 8-bit per channel."""
    from auto_round.schemes import QuantizationScheme

    w4 = QuantizationScheme(bits=spec["bits"], group_size=spec["group_size"] or -1, sym=spec["symmetric"],
                            data_type="int", act_bits=16)
    w8 = QuantizationScheme(bits=8, group_size=-1, sym=True, data_type="int", act_bits=16)
    return w4, w8


def avg_bits(model, linears: list[str], eight_bit, w4, w8) -> float:
    """auto-round's average bits of `eight_bit` at 8 bits and every other layer of `linears` at the base width."""
    from auto_round.auto_scheme.utils import compute_avg_bits_for_scheme

    bits, _ = compute_avg_bits_for_scheme(model, linears, {n: asdict(w8) for n in eight_bit}, asdict(w4), False)
    return bits


def calibration(spec: dict, tok, out: str) -> int:
    """The calibration texts long enough for auto-round, written as its local jsonl; how many."""
    c = spec["calibration"]
    kept = []
    with open(c["calibration_file"]) as f:
        for line in f:
            text = json.loads(line)["text"].rstrip() if line.strip() else ""
            if text and len(tok(text)["input_ids"]) >= c["max_seq_len"]:
                kept.append(text)
            if len(kept) >= c["num_samples"]:
                break
    if not kept:
        raise SystemExit(f"anchor: no calibration text has {c['max_seq_len']} tokens (calibration.max_seq_len)")
    with open(out, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in kept)
    return len(kept)


def auto_round_choice(spec: dict, threads: int) -> dict:
    import auto_round
    import torch
    from auto_round.auto_scheme.gen_auto_scheme import AutoScheme, GenScheme
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec.get("seed", 0))
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n in set(spec["modules"])]
    missing = sorted(set(spec["modules"]) - set(linears))
    if missing:
        raise SystemExit(f"anchor: the model has no Linear {missing[0]!r}")
    w4, w8 = options(spec)
    target = avg_bits(model, linears, spec["eight_bit"], w4, w8)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["AR_AUTO_SCHEME_CACHE"] = tmp
        data = os.path.join(tmp, "calibration.jsonl")
        n = calibration(spec, tok, data)
        scheme = AutoScheme(avg_bits=target, options=[w4, w8], shared_layers=spec["shared"], nsamples=n,
                            seqlen=spec["calibration"]["max_seq_len"], batch_size=min(8, n), device_map="cpu",
                            enable_torch_compile=False, low_gpu_mem_usage=True, low_cpu_mem_usage=False)
        gen = GenScheme(scheme, model, linears, {}, dataset=data, device_map="cpu", tokenizer=tok,
                        enable_torch_compile=False)
        lo, hi = gen.min_avg_bit, gen.max_avg_bit
        layer_config = gen.get_layer_config()
    eight = sorted(n for n in linears if layer_config[n]["bits"] == 8)
    if len(eight) + sum(layer_config[n]["bits"] == spec["bits"] for n in linears) != len(linears):
        raise SystemExit("anchor: auto-round gave a layer neither width")
    return {"tool": "auto_round", "version": auto_round.__version__, "avg_bits_target": target,
            "avg_bits_achieved": avg_bits(model, linears, eight, w4, w8), "range": [lo, hi], "eight_bit": eight,
            "calibration_texts": n}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    threads = int(spec.get("threads") or os.cpu_count() or 1)
    _quiet_knobs(threads)
    t0 = time.time()
    if spec["tool"] != "auto_round":
        raise SystemExit(f"anchor: unknown tool {spec['tool']!r}")
    import torch

    torch.set_num_threads(threads)
    result = auto_round_choice(spec, threads)
    result["wall_s"] = round(time.time() - t0, 1)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    print(f"anchor: {result['tool']} {len(result['eight_bit'])} of {len(spec['modules'])} layers at 8 bits, "
          f"{result['avg_bits_achieved']:.4f} bits for a target of {result['avg_bits_target']:.4f}", flush=True)


if __name__ == "__main__":
    main()
