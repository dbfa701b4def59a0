"""Closed-loop streaming load at a fixed concurrency against an OpenAI-compatible server.

`concurrency` workers each send one request at a time until `num_requests` are done, so
exactly that many are in flight (the same definition `vllm bench serve
--max-concurrency` uses). Each request streams; timers run on the client:

    TTFT  request sent -> first streamed token chunk received
    ITL   gaps between consecutive token chunks
    TPOT  (e2e - TTFT) / (output tokens - 1)
    e2e   request sent -> end of stream

Prompts are exact-length token-id lists cut from real text, each distinct, so the prefix
cache is cold for measured requests (said in the result).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field

from pipeline.measure import stats


@dataclass
class RequestRecord:
    ok: bool
    timed_out: bool = False
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    sent: float | None = None  # time.perf_counter() when it was sent: ttft and e2e count from here

    def streaming(self) -> tuple[float, float] | None:
        """(first token, last token) on the perf_counter clock: while the client saw it stream."""
        if self.ok and self.sent is not None and self.ttft is not None and self.e2e is not None:
            return self.sent + self.ttft, self.sent + self.e2e
        return None

    @property
    def tpot(self) -> float | None:
        if self.ok and self.output_tokens > 1 and self.ttft is not None:
            return (self.e2e - self.ttft) / (self.output_tokens - 1)
        return None


def one_request(port: int, model: str, prompt: list[int], max_tokens: int, timeout: float,
                on_first=None) -> RequestRecord:
    """One streamed completion, timed; on_first() is called when its first token arrives."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    rec = RequestRecord(ok=False)
    t0 = rec.sent = time.perf_counter()
    last = None
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return rec
        for raw in resp:
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"request exceeded {timeout:.0f} s")
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter()
            if chunk.get("usage"):
                rec.output_tokens = chunk["usage"]["completion_tokens"]
            # a token event: a chunk with a choice, even one whose text is empty (a special or an
            # incomplete multi-byte token decodes to ""); the final usage-only chunk has no choices
            if any("text" in c for c in chunk.get("choices", [])):
                if last is None:
                    rec.ttft = now - t0
                    if on_first is not None:
                        on_first()
                else:
                    rec.itls.append(now - last)
                last = now
        rec.e2e = time.perf_counter() - t0
        rec.ok = rec.ttft is not None and rec.output_tokens > 0
        if not rec.ok:
            rec.error = "stream ended without tokens"
    except Exception as exc:  # any failure is a counted failed request, never a lost one
        rec.timed_out = isinstance(exc, TimeoutError) or "timed out" in str(exc)
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return rec


def run_closed_loop(port: int, model: str, prompts: list[list[int]], max_tokens: int,
                    concurrency: int, timeout: float, on_done=None, on_first=None) -> tuple[list[RequestRecord], float]:
    """Send every prompt with `concurrency` in flight; return records and wall seconds. on_done() is
    called as each request finishes (progress), on_first() as each has its first token."""
    records: list[RequestRecord | None] = [None] * len(prompts)
    next_i = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            records[i] = one_request(port, model, prompts[i], max_tokens, timeout, on_first)
            if on_done is not None:
                on_done()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lost = RequestRecord(ok=False, error="worker thread died")
    return [r if r is not None else lost for r in records], time.perf_counter() - t0


def summarize(records: list[RequestRecord], wall_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, cost_per_hour: float | None = None) -> dict:
    ok = [r for r in records if r.ok]
    ms = lambda xs: [x * 1000 for x in xs if x is not None]  # noqa: E731
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "ttft_ms": stats.percentiles(ms(r.ttft for r in ok)),
        "tpot_ms": stats.percentiles(ms(r.tpot for r in ok)),
        "itl_ms": stats.percentiles(ms(x for r in ok for x in r.itls)),
        "e2e_ms": stats.percentiles(ms(r.e2e for r in ok)),
        "completed": len(ok),
        "failed": sum(1 for r in records if not r.ok and not r.timed_out),
        "timed_out": sum(1 for r in records if r.timed_out),
        "output_tokens": out_tokens,
        "duration_s": wall_s,
        "output_tok_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "request_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        **goodput(records, wall_s, slo_ttft_ms, slo_tpot_ms),
        "cost_per_1k_requests_usd": (cost_per_hour * wall_s / 3600 / len(ok) * 1000
                                     if cost_per_hour is not None and ok else None),
    }


def goodput(records: list[RequestRecord], wall_s: float, slo_ttft_ms: float | None,
            slo_tpot_ms: float | None) -> dict:
    """Requests that completed within the SLO (TTFT and TPOT bounds), per second and as a share."""
    if slo_ttft_ms is None and slo_tpot_ms is None:
        return {"goodput_req_per_s": None, "slo_attainment": None}
    good = sum(1 for r in records if r.ok
               and (slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms)
               and (slo_tpot_ms is None or (r.tpot is not None and r.tpot * 1000 <= slo_tpot_ms)))
    return {"goodput_req_per_s": good / wall_s if wall_s > 0 else 0.0,
            "slo_attainment": good / len(records) if records else None}


def max_streaming(records: list[RequestRecord]) -> int:
    """Most requests the client saw streaming at once (first token in, last not yet): a request
    streams only while the engine runs it, so this is a lower bound on the engine's running count."""
    events = sorted(e for r in records if (w := r.streaming())
                    for e in ((w[0], 1), (w[1], -1)))  # at a tie the end sorts first: not counted together
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most
