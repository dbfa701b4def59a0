"""Perplexity and next-token drift from the engine's own logprobs.

Each window of held-out prose is sent once as a prompt (`echo`, `max_tokens=1`,
`logprobs=k`, token ids returned as ids): the engine returns, per position, the logprob of
the actual next token and its top-k next-token logprobs. That gives perplexity per variant
and, joined position by position with the baseline's, the token-level KL divergence
KL(baseline || variant) and top-1 agreement (llama.cpp's `--kl-divergence` practice).

Neither side's full distribution over the vocabulary crosses the wire, so KL is computed over
a partition: each token that *both* engines list at that position (always including the
actual next token) is its own cell; everything else is one "rest" cell with the leftover
probability on each side. Merging outcomes never increases KL (the log-sum inequality), so
this is a lower bound of the full-vocabulary KL, exact when k covers the vocabulary and
tight when both top-k lists hold most of the mass (they do for near-lossless variants).
Pure Python + numpy; no engine import.
"""

from __future__ import annotations

import http.client
import json
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

TINY = 1e-12


def window_spans(n: int, count: int, length: int) -> list[tuple[int, int]]:
    """[start, end) of `count` consecutive windows of `length` tokens taken from the end of an n-token
    corpus backwards, in corpus order; ValueError when the corpus is too short."""
    if count * length > n:
        raise ValueError(f"the drift corpus has {n} tokens: too few for {count} windows of {length}")
    return [(n - (count - j) * length, n - (count - j - 1) * length) for j in range(count)]


PER_DOC = 2  # most windows cut from any one document (the intervals resample documents: more, smaller clusters)


def spread_spans(docs: list[str] | None, n: int, count: int, length: int,
                 per_doc: int = PER_DOC) -> list[tuple[int, int]]:
    """[start, end) of `count` windows of `length` tokens, in corpus order, taken from the documents at the
    corpus's end backwards, at most `per_doc` from any one (each cut from its document's end): the windows span
    several documents, so their bootstrap resamples less correlated text and a search can split them by document.
    docs: each of the n tokens' document; None (unknown) gives consecutive windows (window_spans)."""
    if docs is None:
        return window_spans(n, count, length)
    out: list[tuple[int, int]] = []
    e = len(docs)
    while e > 0 and len(out) < count:
        s = e
        while s > 0 and docs[s - 1] == docs[e - 1]:
            s -= 1
        take = min(per_doc, (e - s) // length, count - len(out))
        out += [(e - (j + 1) * length, e - j * length) for j in range(take)]
        e = s
    if len(out) < count:
        raise ValueError(f"the drift corpus has room for {len(out)} windows of {length} tokens ({per_doc} at most "
                         f"from each document), not {count}")
    return sorted(out)


def held_out_end(docs: list[str] | None, spans: list[tuple[int, int]], n: int) -> int:
    """The first token of the earliest document a window is cut from (of the earliest window where documents are
    unknown): text before it shares no document with the windows."""
    if not spans:
        return n
    a = min(s for s, _ in spans)
    while docs is not None and a > 0 and docs[a - 1] == docs[a]:
        a -= 1
    return a


def windows_from_ids(ids: list[int], count: int, length: int, bos: int | None = None) -> list[list[int]]:
    """`count` consecutive windows taken from the end of the corpus backwards (the needle suite
    cuts its haystacks from the start, so the two rarely share text). With `bos` (the token the model's
    tokenizer starts every text with) each window starts with it, at the same length: the model is scored
    as it is served."""
    return [ids[a:b] if bos is None else [bos] + ids[a + 1:b] for a, b in window_spans(len(ids), count, length)]


def score_window(port: int, model: str, ids: list[int], top_k: int, timeout: float = 600) -> dict:
    """One window through the engine: the actual next-token logprob and the top-k at every position."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": top_k,
                       "temperature": 0.0, "return_tokens_as_token_ids": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"drift scoring: HTTP {resp.status}: {data[:300]!r}")
    finally:
        conn.close()
    lp = json.loads(data)["choices"][0]["logprobs"]
    n = len(ids)
    actual, top = [], []
    for pos in range(1, n):  # position 0 has no prediction
        entries = lp["top_logprobs"][pos] or {}
        pairs = sorted(((int(t.split(":", 1)[1]), float(v)) for t, v in entries.items()), key=lambda x: -x[1])
        actual.append(float(lp["token_logprobs"][pos]))
        top.append([[i, v] for i, v in pairs])
    return {"ids": ids, "actual": actual, "top": top}


def score_windows(port: int, model: str, windows: list[list[int]], top_k: int, concurrency: int = 2,
                  on_done=None) -> list[dict]:
    def one(w: list[int]) -> dict:
        row = score_window(port, model, w, top_k)
        if on_done is not None:
            on_done()
        return row

    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, windows))
    for i, r in enumerate(rows):
        r["window"] = i
    return rows


def perplexity(rows: list[dict]) -> tuple[float, int]:
    lps = [x for r in rows for x in r["actual"]]
    return (math.exp(-sum(lps) / len(lps)) if lps else math.nan), len(lps)


def kl_position(p_top: list, q_top: list, p_actual: tuple[int, float], q_actual: tuple[int, float]) -> float:
    """KL(P || Q) over the partition {tokens both list} + {rest}: a lower bound of the full KL."""
    P = {int(i): lp for i, lp in p_top}
    Q = {int(i): lp for i, lp in q_top}
    P.setdefault(p_actual[0], p_actual[1])
    Q.setdefault(q_actual[0], q_actual[1])
    shared = P.keys() & Q.keys()
    kl, p_sum, q_sum = 0.0, 0.0, 0.0
    for t in shared:
        p, q = math.exp(P[t]), math.exp(Q[t])
        p_sum += p
        q_sum += q
        kl += p * (P[t] - Q[t])
    p_rest = 1.0 - p_sum
    q_rest = max(TINY, 1.0 - q_sum)
    if p_rest > 1e-9:  # below that: float noise of a full-vocabulary sum
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(0.0, kl)


def compare(base: list[dict], var: list[dict]) -> dict:
    """Per-position KL and top-1 agreement, joined window by window and position by position."""
    if len(base) != len(var):
        raise ValueError(f"drift: baseline has {len(base)} windows, the variant {len(var)}")
    kl_w, agree_w, n_w, nll_b, nll_v, all_kl = [], [], [], [], [], []
    for b, v in zip(base, var, strict=True):
        if b["ids"] != v["ids"]:
            raise ValueError(f"drift: window {b.get('window')} differs between baseline and variant")
        kls, agree = [], 0
        for pos, (pt, qt) in enumerate(zip(b["top"], v["top"], strict=True)):
            tok = b["ids"][pos + 1]
            kls.append(kl_position(pt, qt, (tok, b["actual"][pos]), (tok, v["actual"][pos])))
            agree += int(bool(pt) and bool(qt) and int(pt[0][0]) == int(qt[0][0]))
        all_kl += kls
        kl_w.append(sum(kls))
        agree_w.append(agree)
        n_w.append(len(kls))
        nll_b.append(-sum(b["actual"]))
        nll_v.append(-sum(v["actual"]))
    return {"kl_sum": np.array(kl_w), "agree": np.array(agree_w), "n": np.array(n_w, dtype=float),
            "nll_base": np.array(nll_b), "nll_var": np.array(nll_v), "kl_positions": np.array(all_kl),
            "doc": [b.get("doc") or f"window-{i}" for i, b in enumerate(base)]}


SUMMED = ("kl_sum", "agree", "n", "nll_base", "nll_var")
WHOLE_RANGE = 1e12  # the upper end of an interval that no data bounds (one document: nothing to resample)


def by_document(c: dict) -> dict:
    """The per-window sums added up per document (compare's "doc"): the units the intervals resample."""
    docs = c.get("doc") or [f"window-{i}" for i in range(len(c["n"]))]
    keys = list(dict.fromkeys(docs))
    g = np.array([keys.index(d) for d in docs], dtype=int)
    return {k: np.bincount(g, weights=np.asarray(c[k], dtype=float), minlength=len(keys)) for k in SUMMED}


def summarize(c: dict, samples: int = 2000, seed: int = 0) -> dict:
    """Means over all positions, 95% CIs by resampling whole documents: positions within a window are not
    independent, nor are windows cut from one essay. With one document there is nothing to resample: the
    intervals span the whole range, so no gate is certified on it."""
    u = by_document(c)
    n = u["n"]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(n), size=(samples, len(n)))

    def ratio_ci(num, den, whole=(0.0, WHOLE_RANGE)):
        point = float(num.sum() / den.sum())
        if len(n) < 2:
            return point, *whole
        boot = num[idx].sum(axis=1) / den[idx].sum(axis=1)
        lo, hi = np.percentile(boot, [2.5, 97.5])
        return point, float(lo), float(hi)

    kl, kl_lo, kl_hi = ratio_ci(u["kl_sum"], n)
    ag, ag_lo, ag_hi = ratio_ci(u["agree"], n, (0.0, 1.0))
    d = u["nll_var"] - u["nll_base"]  # log perplexity ratio = sum(d) / tokens
    lr, lr_lo, lr_hi = ratio_ci(d, n, (-math.log(WHOLE_RANGE), math.log(WHOLE_RANGE)))
    return {"tokens": int(n.sum()), "windows": len(c["n"]), "documents": len(n),
            "kl_mean": kl, "kl_ci_low": kl_lo, "kl_ci_high": kl_hi,
            "kl_p99": float(np.percentile(c["kl_positions"], 99)) if len(c["kl_positions"]) else math.nan,
            "top1_agreement": ag, "top1_ci_low": ag_lo, "top1_ci_high": ag_hi,
            "ppl_base": math.exp(c["nll_base"].sum() / n.sum()), "ppl_var": math.exp(c["nll_var"].sum() / n.sum()),
            "ppl_ratio": math.exp(lr), "ppl_ratio_ci_low": math.exp(lr_lo), "ppl_ratio_ci_high": math.exp(lr_hi)}
