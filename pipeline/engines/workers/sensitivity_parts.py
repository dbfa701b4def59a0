"""The parts a search may keep at higher precision, how they are ranked, and how a model is scored against
its unquantized self: shared by the sensitivity worker (quantize environment) and the sensitivity stage.
Standard library at import time; torch only inside the functions the worker calls.
"""

from __future__ import annotations

import re

# which rows of a sensitivity result each `search.units` ranks
RANKED = {"blocks": ("block",), "blocks_and_kinds": ("block", "kind"), "block_kinds": ("block_kind",)}


def rank(rows: list[dict], units: str = "blocks") -> list[dict]:
    """The parts a candidate may keep, most sensitive per weight kept first: the KL that part alone adds
    when quantized, over the weights the fallback would keep; top-1, then model order break ties."""
    rs = [r for r in rows if r["kind"] in RANKED[units]]
    return sorted(rs, key=lambda r: (-r["kl_mean"] / max(1, r["params"]), r["top1_agreement"], rs.index(r)))


def kept_modules(ranked: list[dict], k: int) -> list[str]:
    """The Linear modules the first k parts keep, each once (a block and a kind overlap), in part order."""
    return list(dict.fromkeys(m for r in ranked[:k] for m in r["modules"]))


def curve_ks(ranked: list[dict], fractions: list[float]) -> list[int]:
    """For each fraction of the ranked parts' weights, the smallest k whose kept modules hold that much."""
    total = sum(r["params"] for r in ranked) or 1
    ks, acc, k = [], 0, 0
    for f in fractions:
        while k < len(ranked) and acc < f * total:
            acc += ranked[k]["params"]
            k += 1
        if k and k not in ks:
            ks.append(k)
    return ks


def linears(model) -> dict[str, object]:
    """The decoder blocks' Linear layers (the lm_head and embeddings stay, as the schemes leave them)."""
    import torch

    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and re.search(r"\.layers\.\d+\.", n)}


def first_block(members: list[str]) -> int:
    return min(int(re.search(r"\.layers\.(\d+)\.", n).group(1)) for n in members)


def set_weights(lin: dict, table: dict) -> None:
    for n, w in table.items():
        lin[n].weight.data = w


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


class Scorer:
    """Next-token log-probabilities on fixed windows, compared with the unquantized model's (taken at
    construction). A model changed only from block b on is scored from the cached hidden states entering
    block b, when that reproduces a whole forward here (`tail_ok`)."""

    def __init__(self, model, windows, try_tail: bool = True):
        self.model, self.windows = model, windows
        name = next(n for n, _ in model.named_modules() if re.search(r"\.layers\.\d+$", n))
        self.inner = model.get_submodule(name.rsplit(".layers.", 1)[0])
        self.base = self.logprobs()
        self.base_top = self.base.argmax(-1)
        self.tokens = int(self.base.shape[0])
        self.tail_ok = try_tail and self._check_tail()

    def _forward(self, w=None, h=None, start: int = 0):
        import torch

        if h is None:
            return torch.log_softmax(self.model(w[None]).logits[0, :-1].float(), dim=-1)
        layers = self.inner.layers
        self.inner.layers = torch.nn.ModuleList(list(layers)[start:])
        try:
            return torch.log_softmax(self.model(inputs_embeds=h).logits[0, :-1].float(), dim=-1)
        finally:
            self.inner.layers = layers

    def logprobs(self, states=None, start: int = 0):
        import torch

        with torch.inference_mode():
            if states is None or start == 0 or not self.tail_ok:
                return torch.cat([self._forward(w) for w in self.windows])
            return torch.cat([self._forward(h=s[start], start=start) for s in states])

    def states(self):
        """Per window, the hidden state entering each decoder block, as the model now is."""
        import torch

        if not self.tail_ok:
            return None
        with torch.inference_mode():
            return [self.model(w[None], output_hidden_states=True).hidden_states for w in self.windows]

    def _check_tail(self) -> bool:
        import torch

        try:
            mid = len(self.inner.layers) // 2
            with torch.inference_mode():
                h = self.model(self.windows[0][None], output_hidden_states=True).hidden_states[mid]
                tail = self._forward(h=h, start=mid)
            return bool(torch.allclose(tail, self.base[:tail.shape[0]], atol=1e-4))
        except Exception:  # noqa: BLE001 - a model whose forward cannot start mid-way is scored whole
            return False

    def score(self, lp) -> tuple[float, float]:
        """Mean KL(unquantized || this) per token over the full vocabulary, and top-1 agreement."""
        kl = (self.base.exp() * (self.base - lp)).sum(-1).clamp_min(0)
        return float(kl.mean()), float((lp.argmax(-1) == self.base_top).float().mean())


def curve(scorer, lin: dict, rows: list[dict], quant: dict, kept: dict, fractions: list[float],
          units: str) -> list[dict]:
    """The all-quantized model with the first k ranked parts at the fallback, for the k that keep each
    fraction of the parts' weights: what the search's first guess reads (an emulation, never reported as
    a candidate's figure)."""
    ranked = rank(rows, units)
    out = []
    for k in curve_ks(ranked, fractions):
        keep = set(kept_modules(ranked, k))
        set_weights(lin, {n: kept[n] if n in keep else quant[n] for n in lin})
        kl, top1 = scorer.score(scorer.logprobs())
        out.append({"k": k, "kept_params": int(sum(lin[n].weight.numel() for n in keep)), "kl_mean": kl,
                    "top1_agreement": top1})
        print(f"sensitivity curve k={k}: KL {kl:.5f}, top-1 {top1:.3f}", flush=True)
    return out
