"""How much each part of a model moves its next-token predictions when only that part is quantized. Runs under
the *quantize* environment (torch, compressed-tensors, llm-compressor), no engine:

    <quantize-env>/bin/python -m pipeline.engines.workers.sensitivity_worker SPEC.json RESULT.json

Parts: one decoder block; one group of Linear kinds that read the same input (q/k/v, gate/up: vLLM fuses
them and AWQ smooths them together, so they keep one scheme) across every block; or one such group in one
block (pipeline/engines/workers/sensitivity_parts.py).

method "calibrated" (what the search uses): the base scheme's own llm-compressor recipe (the uniform
candidate's) is run in memory on the calibration set, so every Linear has its float weights as the
algorithm left them (AWQ's smoothed channels; GPTQ, which writes rounded values, keeps the originals) and
its quantized values. Then, per part, on drift-corpus windows and over the full vocabulary against the
unquantized model: `kl_mean` / `top1_agreement` with only that part quantized. Why calibrated: AWQ
protects some parts (q/k/v) far more than others (o_proj, whose v_proj->o_proj mapping is skipped under
GQA), so a round-to-nearest ranking spends bytes where the algorithm needs none. With `curve`, the worker
also scores the all-quantized model with the first k ranked parts kept at the fallback precision, for
the k that keep each fraction of the weights in `curve`: the search's first guess. (Ranking instead by
what keeping each part alone recovers from the all-quantized model, measured in context, was tried and
dropped: on a few windows that difference of two noisy figures ranks worse than each part's own damage;
docs/search.md has the figures.)
method "rtn": each part alone rounded to nearest on the grid (compressed-tensors' own calculate_qparams /
fake_quantize), no calibration.

Parts inside one block are scored from the hidden state entering that block, cached, when the model's
forward can start there (checked against a whole forward; otherwise every score is a whole forward).
Imports nothing from this package but the quantize worker and the part helpers (same environment).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pipeline.engines.workers import sensitivity_parts as sp


def _args(bits: int, group_size: int | None, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs

    if group_size is None:
        return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="channel")
    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=group_size)


def fake_quant(w, args):
    """Round-to-nearest of one weight matrix on the scheme's grid (min-max per group or channel)."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    out_f, in_f = w.shape
    g = args.group_size or in_f
    if in_f % g:
        raise SystemExit(f"sensitivity: input width {in_f} is not a multiple of group_size {g}")
    x = w.float().reshape(out_f, in_f // g, g)
    scale, zp = calculate_qparams(torch.amin(x, dim=-1), torch.amax(x, dim=-1), args)
    return fake_quantize(w.float(), scale, zp, args).to(w.dtype)


def calibrated(spec: dict, model, lin: dict) -> tuple[dict, dict, float]:
    """The base scheme's recipe run in memory: (float weights, quantized weights) per decoder Linear,
    and the seconds it took. Weights the algorithm already rounded (GPTQ) keep their originals as floats."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    from pipeline.engines.workers.quantize_worker import calibration_dataset, patch_cpu_only

    patch_cpu_only()
    torch.manual_seed(spec.get("seed", 0))
    t0 = time.perf_counter()
    before = {n: m.weight.data.clone() for n, m in lin.items()}
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    ds = calibration_dataset(spec["calibration"], tok)
    oneshot(model=model, tokenizer=tok, recipe=spec["recipe"], dataset=ds, num_calibration_samples=len(ds),
            max_seq_length=spec["calibration"]["max_seq_len"], shuffle_calibration_samples=False)
    floats, quant = {}, {}
    for n, m in lin.items():
        w = m.weight.data
        scheme = getattr(m, "quantization_scheme", None)
        q = forward_quantize(m, w, "weight", scheme.weights) if scheme is not None and scheme.weights else w
        m.quantization_enabled = False  # from here on the worker sets every weight itself
        floats[n] = (before[n] if torch.equal(q, w) else w).clone()
        quant[n] = q.clone()
    return floats, quant, time.perf_counter() - t0


def rounded(spec: dict, lin: dict) -> tuple[dict, dict]:
    args = _args(spec["bits"], spec["group_size"], spec["symmetric"])
    floats = {n: m.weight.data.clone() for n, m in lin.items()}
    return floats, {n: fake_quant(w, args) for n, w in floats.items()}


def fallback_weights(spec: dict, floats: dict) -> dict:
    """What a kept part holds: 8-bit symmetric per-channel weights of the floats (w8a16), or the floats."""
    bits = spec.get("fallback_bits")
    if not bits or bits >= 16:
        return floats
    args = _args(bits, None, True)
    return {n: fake_quant(w, args) for n, w in floats.items()}


def main(spec_path: str, result_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec.get("threads") or os.cpu_count() or 1))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    scorer = sp.Scorer(model, torch.tensor(spec["windows"], dtype=torch.long), spec.get("tail", True))
    lin = sp.linears(model)
    groups = sp.shared_inputs(model, lin, scorer.windows[0])
    parts = sp.parts_of(list(lin), groups if spec.get("kinds", True) else None,
                        groups if spec.get("block_kinds") else None)
    result = {"method": spec.get("method", "rtn"), "tail": scorer.tail_ok}
    if result["method"] == "calibrated":
        floats, quant, result["calibration_s"] = calibrated(spec, model, lin)
    else:
        floats, quant = rounded(spec, lin)
    rows = measure_parts(spec, scorer, lin, parts, floats, quant, result)
    if spec.get("curve"):
        result["curve"] = sp.curve(scorer, lin, rows, quant, fallback_weights(spec, floats), spec["curve"],
                                   spec.get("units", "block_kinds"))
    result.update(rows=rows, tokens=scorer.tokens, wall_s=time.perf_counter() - t0,
                  grid=f"int{spec['bits']} {'sym' if spec['symmetric'] else 'asym'} "
                       f"{'g' + str(spec['group_size']) if spec['group_size'] else 'per channel'}, "
                       + ("the base scheme's own calibration" if result["method"] == "calibrated"
                          else "round to nearest"),
                  versions={"torch": torch.__version__})
    tmp = result_path + ".tmp"
    Path(tmp).write_text(json.dumps(result, indent=2))
    os.replace(tmp, result_path)


def scored(pair: tuple[float, float]) -> dict:
    return {"kl_mean": pair[0], "top1_agreement": pair[1]}


def measure_parts(spec: dict, scorer, lin: dict, parts: list, floats: dict, quant: dict, result: dict) -> list[dict]:
    """One row per part: that part alone quantized, the rest at their floats. `result` gets the all-float
    score (the unquantized model's, up to rounding: AWQ's smoothing leaves the outputs as they were) and
    the all-quantized one (the uniform scheme, emulated: the curve's first point)."""
    sp.set_weights(lin, quant)
    result["uniform"] = scored(scorer.score(scorer.logprobs()))
    sp.set_weights(lin, floats)
    state = scorer.states()
    result["floats"] = scored(scorer.score(scorer.logprobs()))
    rows = []
    for i, (kind, name, members) in enumerate(parts):
        start = sp.first_block(members) if kind in ("block", "block_kind") else 0
        sp.set_weights(lin, {n: quant[n] for n in members})
        kl, top1 = scorer.score(scorer.logprobs(state, start))
        sp.set_weights(lin, {n: floats[n] for n in members})
        rows.append({"kind": kind, "part": name, "modules": members, "kl_mean": kl, "top1_agreement": top1,
                     "params": int(sum(floats[n].numel() for n in members))})
        print(f"sensitivity {i + 1}/{len(parts)} {name}: KL {kl:.5f}, top-1 {top1:.3f}", flush=True)
    return rows


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pipeline.engines.workers.sensitivity_worker SPEC.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
