"""An anchor tool's choice of which decoder Linear layers get 8-bit weights, at the same average bits as a given
choice (the search data's pick), counted the tool's own way. Runs under the *quantize* environment:

    <quantize-env>/bin/python -m pipeline.engines.workers.anchor_worker SPEC.json RESULT.json

Each tool is given the search's own question and calibration texts; only its choice is taken.

tool auto_round: Intel auto-round's AutoScheme, only its scoring and selection (GenScheme.get_layer_config),
not its tuning or export: the search builds the choice itself, so only the choice is compared. Its options are
the search's own two widths (the base scheme's bits, symmetry and group size; 8-bit symmetric per output
channel, auto-round's group_size -1), activations at 16 bits. q/k/v and gate/up are chosen together
(shared_layers): vLLM fuses each into one Linear, which cannot mix widths. lm_head and the embeddings are not
among the layers it is given, so they are neither chosen nor counted, as in the search's own weights.

auto-round counts bits per weight over the layers it is given, scales and zero points included
(auto_scheme/utils.py compute_avg_bits_for_scheme), and chooses the lowest-loss assignment at or under the
target. The target here is the pick's own bits by that count, so both sides spend the same budget.

tool modelopt: NVIDIA ModelOpt's auto_quantize (modelopt_choice; installed into this environment on first use,
requirements/extra-modelopt.txt), counted its own way: the formats' bits per weight, without scales.

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


def long_texts(spec: dict, tok) -> list[str]:
    """The first `num_samples` calibration texts at least `max_seq_len` tokens long (auto-round drops shorter
    ones; both tools are given the same texts)."""
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
    return kept


def calibration(spec: dict, tok, out: str) -> int:
    """The calibration texts written as auto-round's local jsonl; how many."""
    kept = long_texts(spec, tok)
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


def _calibration_batches(spec: dict, tok, batch: int = 4) -> list:
    """The same texts auto-round is given (long_texts), as token batches of max_seq_len."""
    import torch

    n = spec["calibration"]["max_seq_len"]
    rows = [tok(t, return_tensors="pt")["input_ids"][:, :n] for t in long_texts(spec, tok)]
    return [torch.cat(rows[i:i + batch]) for i in range(0, len(rows), batch)]


def _plain_bits(numel: dict[str, int], eight: set[str], bits: int) -> float:
    """Average bits per weight with `eight` at 8 bits and the rest at `bits`, scales not counted (ModelOpt's way)."""
    return sum((8 if n in eight else bits) * k for n, k in numel.items()) / sum(numel.values())


def modelopt_choice(spec: dict, threads: int) -> dict:
    """ModelOpt's auto_quantize (gradient scores) between its INT4 AWQ recipe at the search's group size and its
    INT8 weight-only per channel, decoder Linears only (no unquantized option), lm_head neither chosen nor
    counted. ModelOpt counts bits as the formats' num_bits per weight, without scales, so the target is the
    pick's plain 4/8-bit average. Its INT4 is symmetric (it has no zero point; its per-group bias cannot be
    combined with AWQ in this version): only the layer choice is taken, the search's own scheme builds it."""
    import copy

    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.quantization.algorithms import QuantRecipe
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec.get("seed", 0))
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    wanted = set(spec["modules"])
    numel = {n: m.weight.numel() for n, m in model.named_modules() if n in wanted}
    if len(numel) != len(wanted):
        raise SystemExit(f"anchor: the model has no Linear {sorted(wanted - set(numel))[0]!r}")
    target = _plain_bits(numel, set(spec["eight_bit"]), spec["bits"])
    w4 = copy.deepcopy(mtq.INT4_AWQ_CFG)
    for e in w4["quant_cfg"]:
        if e.get("quantizer_name") == "*weight_quantizer" and e.get("cfg"):
            e["cfg"]["block_sizes"] = {-1: spec["group_size"] or None, "type": "static"}
    w8 = copy.deepcopy(mtq.INT8_WEIGHT_ONLY_CFG)
    batches = _calibration_batches(spec, tok)
    prefixes = sorted({n.split(".layers.")[0] + ".layers.*" for n in numel})
    model, state = mtq.auto_quantize(
        model, constraints={"effective_bits": target, "cost": {"excluded_module_name_patterns": ["*lm_head*"]}},
        quantization_formats=[w4, w8],
        module_search_spaces=[{"module_name_patterns": prefixes, "quantization_formats": [w4, w8],
                               "allow_no_quant": False}],
        disabled_layers=["*lm_head*"], data_loader=batches,
        forward_step=lambda m, b: m(input_ids=b, labels=b), loss_func=lambda out, b: out.loss,
        # AWQ formats calibrate on num_calib_steps // 4 batches (its algorithms.py): 4x, so AWQ sees them all
        num_calib_steps=4 * len(batches), num_score_steps=len(batches), method="gradient", verbose=False)
    r8 = QuantRecipe(w8, name="W8")
    eight = sorted(n for hp, recipe in state["best"]["recipe"].items() if recipe == r8
                   for n in state["candidate_stats"][hp]["module_names"])
    if not set(eight) <= wanted:
        raise SystemExit("anchor: ModelOpt chose 8 bits outside the decoder Linears")
    return {"tool": "modelopt", "version": modelopt.__version__, "avg_bits_target": target,
            "avg_bits_achieved": _plain_bits(numel, set(eight), spec["bits"]), "range": [float(spec["bits"]), 8.0],
            "eight_bit": eight, "calibration_texts": sum(len(b) for b in batches)}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    threads = int(spec.get("threads") or os.cpu_count() or 1)
    _quiet_knobs(threads)
    t0 = time.time()
    choose = {"auto_round": auto_round_choice, "modelopt": modelopt_choice}.get(spec["tool"])
    if choose is None:
        raise SystemExit(f"anchor: unknown tool {spec['tool']!r}")
    import torch

    torch.set_num_threads(threads)
    result = choose(spec, threads)
    result["wall_s"] = round(time.time() - t0, 1)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    print(f"anchor: {result['tool']} {len(result['eight_bit'])} of {len(spec['modules'])} layers at 8 bits, "
          f"{result['avg_bits_achieved']:.4f} bits for a target of {result['avg_bits_target']:.4f}", flush=True)


if __name__ == "__main__":
    main()
