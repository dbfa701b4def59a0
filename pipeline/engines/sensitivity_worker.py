"""How much each part of a model moves its next-token predictions when only that part is quantized.
Runs under the *quantize* environment (torch + compressed-tensors), no engine:

    <quantize-env>/bin/python -m pipeline.engines.sensitivity_worker SPEC.json RESULT.json

SPEC: model_dir, windows (token id lists cut from the drift corpus), bits, group_size, symmetric,
kinds (also measure each Linear kind across every block), block_kinds (and each such group within each
block), threads. For each part (one decoder block; one group of Linear kinds that read the same input,
e.g. every q/k/v, every down_proj, across all blocks: vLLM fuses such layers and AWQ smooths them
together, so they keep one scheme; or one such group in one block) that part's
Linear weights are rounded to nearest on the scheme's grid with compressed-tensors' own
`calculate_qparams` / `fake_quantize` (the grid llm-compressor writes), everything else kept; the
windows' next-token distributions are compared with the unquantized model's over the full vocabulary:
mean KL(base || part) per token and top-1 agreement. RESULT: one row per part, in model order.
Imports nothing from this package: it runs in the other environment.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path


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


def linears(model) -> dict[str, object]:
    """The decoder blocks' Linear layers (the lm_head and embeddings stay, as the schemes leave them)."""
    import torch

    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and re.search(r"\.layers\.\d+\.", n)}


def shared_inputs(model, lin: dict, window) -> list[list[str]]:
    """Linear kinds grouped by the input they read in the first block (q, k and v read one normed hidden
    state; gate and up another). vLLM fuses such layers and needs one scheme for all of them, and AWQ
    smooths them together, so a kind kept at the fallback is kept with its input-sharing siblings."""
    import torch

    first = re.match(r"(.*\.layers\.\d+)\.", next(iter(lin))).group(1) + "."
    seen: dict[str, object] = {}  # the input tensors themselves, held: a freed one's address is reused

    def note(name: str):
        def hook(mod, inp, out) -> None:  # returns nothing: a value would replace the layer's output
            seen.setdefault(name, inp[0])
        return hook

    hooks = [m.register_forward_hook(note(n)) for n, m in lin.items() if n.startswith(first)]
    with torch.inference_mode():
        model(window[None, :8])
    for h in hooks:
        h.remove()
    groups: dict[int, list[str]] = {}
    for n, x in seen.items():
        groups.setdefault(id(x), []).append(n.split(".")[-1])
    return list(groups.values())


def parts_of(names: list[str], kind_groups: list[list[str]] | None,
             per_block: list[list[str]] | None = None) -> list[tuple[str, str, list[str]]]:
    """(kind of part, part name, its Linear names): blocks in model order; then each group of Linear
    kinds that share an input ('q_proj+k_proj+v_proj'), across every block; then, with `per_block`,
    each such group within each block ('model.layers.3:q_proj+k_proj+v_proj')."""
    blocks: dict[str, list[str]] = {}
    for n in names:
        blocks.setdefault(re.match(r"(.*\.layers\.\d+)\.", n).group(1), []).append(n)
    in_order = sorted(blocks.items(), key=lambda kv: int(kv[0].rsplit(".", 1)[1]))
    out = [("block", b, ms) for b, ms in in_order]
    for group in kind_groups or []:
        out.append(("kind", "+".join(group), [n for n in names if n.split(".")[-1] in group]))
    for b, ms in in_order if per_block else []:
        for group in per_block:
            out.append(("block_kind", f"{b}:{'+'.join(group)}", [n for n in ms if n.split(".")[-1] in group]))
    return out


def main(spec_path: str, result_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec.get("threads") or os.cpu_count() or 1))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).eval()
    args = _args(spec["bits"], spec["group_size"], spec["symmetric"])
    windows = torch.tensor(spec["windows"], dtype=torch.long)

    @torch.inference_mode()
    def logprobs() -> torch.Tensor:
        return torch.cat([torch.log_softmax(model(w[None]).logits[0, :-1].float(), dim=-1) for w in windows])

    base = logprobs()
    base_top = base.argmax(-1)
    lin = linears(model)
    rows = []
    groups = shared_inputs(model, lin, windows[0]) if spec.get("kinds", True) or spec.get("block_kinds") else None
    parts = parts_of(list(lin), groups if spec.get("kinds", True) else None, groups if spec.get("block_kinds") else None)
    for i, (kind, name, members) in enumerate(parts):
        saved = {n: lin[n].weight.data.clone() for n in members}
        for n in members:
            lin[n].weight.data = fake_quant(saved[n], args)
        lp = logprobs()
        for n in members:
            lin[n].weight.data = saved[n]
        kl = (base.exp() * (base - lp)).sum(-1).clamp_min(0)
        rows.append({"kind": kind, "part": name, "modules": members,
                     "params": int(sum(saved[n].numel() for n in members)),
                     "kl_mean": float(kl.mean()), "top1_agreement": float((lp.argmax(-1) == base_top).float().mean())})
        print(f"sensitivity {i + 1}/{len(parts)} {name}: KL {rows[-1]['kl_mean']:.5f}, "
              f"top-1 {rows[-1]['top1_agreement']:.3f}", flush=True)
    result = {"rows": rows, "tokens": int(base.shape[0]), "wall_s": time.perf_counter() - t0,
              "grid": f"int{spec['bits']} {'sym' if spec['symmetric'] else 'asym'} "
                      f"{'g' + str(spec['group_size']) if spec['group_size'] else 'per channel'}, round to nearest",
              "versions": {"torch": torch.__version__}}
    tmp = result_path + ".tmp"
    Path(tmp).write_text(json.dumps(result, indent=2))
    os.replace(tmp, result_path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pipeline.engines.sensitivity_worker SPEC.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
