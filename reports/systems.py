"""Systems sections: memory and KV capacity, the measured admission knee and its ramp, latency at
the fixed concurrency, the decode roofline, and the workload matrix.

All read each variant's systems.json (SystemsResult). A variant whose systems stage was skipped shows
only its checkpoint size, in the memory table.
"""

from __future__ import annotations

from html import escape

from pipeline.results import AdmissionProbe, KVCapacity, Latency, RampStep, SystemsResult
from reports.charts import line_chart
from reports.html import fmt, in_mib, mib, table
from reports.view import NO_KV, Run


def _memory_row(name: str, s: SystemsResult) -> list[str]:
    if s.status == "skipped":
        return [escape(name), mib(s.checkpoint_bytes), f"<i>not measured: {escape(s.error or '')}</i>"] + [""] * 9
    kv = s.kv or NO_KV
    dev, dev_src = s.device_memory_peak_bytes, s.device_memory_source or ""
    dev_txt = f" (device {mib(dev)}" + (", whole GPU − before start: approximate"
                                         if dev_src.startswith("whole") else "") + ")"
    return [escape(name), mib(s.checkpoint_bytes), mib(s.weight_memory_bytes),
            mib(s.peak_memory_bytes) + (dev_txt if dev else ""), fmt(kv.tokens), fmt(kv.tokens_config),
            fmt(kv.num_blocks), fmt(kv.block_size), fmt(kv.bytes_per_token_config), fmt(kv.max_concurrency, 2),
            f"{fmt(kv.admission_sequences)} (KV alone {fmt(kv.admission_kv_only)})", fmt(s.engine_start_s, 0) +
            (f" ({escape(s.engine_launch)})" if s.engine_launch else "")]


def memory_section(run: Run) -> str:
    rows = [_memory_row(name, v.systems) for name, v in run.variants.items() if v.systems]
    return ("<h2>Memory and capacity</h2><p class='small muted'>KV tokens: engine's own figure "
            "(blocks × block size) beside the config arithmetic (pool bytes ÷ 2·layers·kv_heads·head_dim·"
            "bytes, whole blocks). Admission: sequences of the workload's prompt+output length that fit "
            "at once, capped by engine.max_num_seqs. Weights loaded: parameters + buffers the engine holds "
            "once the model is loaded, reported from inside it (engine dtype; quantized tensors as stored). "
            "Peak memory: RSS summed over the engine's process tree (GPU: plus device memory), "
            "sampled every 0.25 s "
            "(approximate: a shorter spike can be missed). Engine start: launch to ready; a warm start is "
            "forked from a process that has vLLM imported, a cold one imports it anew.</p>"
            + table(["variant", "checkpoint", "weights loaded", "peak memory", "KV tokens (engine)",
                     "KV tokens (config)", "blocks", "block", "KV bytes/token", "max conc. @max_len",
                     "admission @workload (≤ max_num_seqs)",
                     "engine start s"], rows))


def _knee_row(name: str, kv: KVCapacity, pr: AdmissionProbe) -> list[str]:
    return [escape(name), f"{pr.prompt_tokens} + {pr.output_tokens} ({pr.blocks_per_sequence} blocks)",
            f"{pr.predicted} ({escape(pr.binding)} binds)",
            f"<b>{pr.knee}</b>" if pr.first_queued else f"≥ {pr.knee} (not reached)",
            fmt(pr.first_queued), str(pr.requests), str(pr.preemptions), fmt(pr.kv_usage_peak, pct=True),
            f"{fmt(kv.tokens)} / {fmt(kv.tokens_config)} / {fmt(pr.empirical_tokens)}", escape(pr.note)]


def _ramp_row(name: str, st: RampStep) -> list[str]:
    outcome = ("<b>queued</b>" if st.queued else
               "all ran at once" if st.overlapped else "never all running: no test")
    return [escape(name), str(st.concurrency), f"{st.max_running} / {fmt(st.max_streaming)}", str(st.max_waiting),
            str(st.preemptions),
            fmt(st.kv_usage_peak, pct=True), outcome, f"{fmt(st.ttft_p50_ms, 0)} / {fmt(st.ttft_max_ms, 0)}",
            fmt(st.tpot_p50_ms, 1), fmt(st.e2e_p50_ms, 0), f"{st.completed} / {st.failed}", fmt(st.duration_s, 1)]


def admission_section(run: Run) -> str:
    """The measured knee (one row a variant) and its ramp (one row a step); empty without a probe."""
    knee_rows, ramp_rows = [], []
    for name, v in run.variants.items():
        s = v.measured
        if s and s.kv and s.kv.probe:
            knee_rows.append(_knee_row(name, s.kv, s.kv.probe))
            ramp_rows += [_ramp_row(name, st) for st in s.kv.probe.steps]
    if not knee_rows:
        return ""
    return ("<h3>Admission knee, measured</h3><p class='small muted'>Requests of the workload's shape "
            "(the same for every variant, so knees compare; the note says whether the KV pool or max_num_seqs "
            "bound). Concurrency "
            "is ramped (1, 2, 4, … below the prediction, then the prediction and one past it; bisected if "
            "requests queue sooner), each step a fresh batch sent at once while the engine's gauges "
            "(running, waiting, preemptions, KV usage) are polled (every 0.01–0.05 s: about 20 times "
            "a request of the step before) and once more when the last request has its first token; the "
            "client also counts the requests streaming at once (first token in, last not yet), a lower "
            "bound on running that no poll can miss. A step <i>queued</i> when a "
            "request waited while the pool had no room for one more sequence (or max_num_seqs ran), or a "
            "sequence was preempted; waiting alone is not queueing, since the token budget admits long "
            "prompts a few per engine step. Knee: the most requests that all ran at once. KV tokens three "
            "ways: engine (blocks × block) / config arithmetic / empirical (the knee's sequences × their "
            "blocks ÷ the engine's usage gauge; KV-bound probes without preemption only). Admission is "
            "whole sequences, so the empirical figure sits up to one sequence below the pool; the note "
            "says what the rest is.</p>"
            + table(["variant", "shape (prompt + output)", "predicted", "knee (measured)", "first queued",
                     "requests sent", "preemptions", "peak KV usage", "KV tokens engine / config / empirical",
                     "note"], knee_rows, last_left=True)
            + "<p class='small muted'>The ramp, step by step: latency of the step's requests (TTFT "
              "includes the batch's prefill; past the knee, its max includes the queued requests' wait).</p>"
            + table(["variant", "concurrency", "max running (gauge / streaming at client)", "max waiting",
                     "preemptions", "peak KV usage",
                     "outcome", "TTFT p50 / max ms", "TPOT p50 ms", "e2e p50 ms", "ok / failed", "step wall s"],
                    ramp_rows))


def _percentiles_row(name: str, lat: Latency) -> list[str]:
    def p(pc) -> str:
        return " / ".join(fmt(x, 1) for x in (pc.p50, pc.p95, pc.p99))

    return [escape(name), p(lat.ttft_ms), p(lat.tpot_ms), p(lat.itl_ms), p(lat.e2e_ms),
            fmt(lat.output_tok_per_s, 1), f"{lat.completed} / {lat.failed} / {lat.timed_out}"]


def _slo_row(name: str, lat: Latency) -> list[str]:
    return [escape(name), fmt(lat.goodput_req_per_s, 3), fmt(lat.slo_attainment, pct=True),
            fmt(lat.cost_per_1k_requests_usd, 4), " / ".join(fmt(x, 1) for x in lat.repeats_tpot_p50_ms) or "–",
            fmt(lat.tpot_p50_spread, pct=True)]


def latency_section(run: Run) -> str:
    """Percentiles at the workload's concurrency, then goodput, cost and the spread over repeats."""
    lats = [(name, v.measured.latency) for name, v in run.variants.items() if v.measured and v.measured.latency]
    first = next((v.systems for v in run.variants.values() if v.systems), None)
    wl = first.workload if first else {}
    cell = (f"{wl.get('prompt_tokens')} prompt tokens, {wl.get('output_tokens')} output tokens, "
            f"concurrency {wl.get('concurrency')}, {wl.get('num_requests')} measured requests after "
            f"{wl.get('warmup_requests')} warm-up; prefix cache: {wl.get('prefix_cache')}") if wl else ""
    timers = first.timers if first else ""
    return (f"<h2>Latency at fixed concurrency</h2><p class='small muted'>{escape(cell)}. {escape(timers)} "
            "One run per variant: differences under ~10–15% are within run-to-run noise here.</p>"
            + table(["variant", "TTFT ms p50/p95/p99", "TPOT ms p50/p95/p99", "ITL ms p50/p95/p99",
                     "e2e ms p50/p95/p99", "output tok/s", "ok / failed / timeout"],
                    [_percentiles_row(name, lat) for name, lat in lats])
            + table(["variant", "goodput req/s (SLO)", "SLO attainment", "$ / 1k requests",
                     "p50 TPOT per repeat (ms)", "spread of p50 TPOT"], [_slo_row(name, lat) for name, lat in lats]))


def roofline_section(run: Run) -> str:
    rows = []
    for name, v in run.variants.items():
        s = v.measured
        if not (s and s.roofline):
            continue
        roof, lat = s.roofline, s.latency
        rows.append([escape(name), f"{in_mib(roof.bytes_per_step):,.1f} MiB",
                     escape(roof.weight_bytes_source or "checkpoint bytes"),
                     f"{roof.bandwidth_gbps:.1f} GB/s", escape(roof.bandwidth_source), fmt(roof.floor_tpot_ms, 1),
                     fmt(lat.tpot_ms.p50, 1) if lat else "–", f"{fmt(roof.measured_over_floor, 1)}×"])
    if not rows:
        return ""
    return ("<h2>Decode roofline</h2><p class='small muted'>Floor TPOT = bytes read per decode step "
            "(all weights once + the batch's KV cache at its mean context) ÷ memory bandwidth. An "
            "approximation that ignores activations and caches; the ratio says how far decode is from "
            "the memory wall.</p>" + table(["variant", "bytes / step", "weights from", "bandwidth", "source",
                                             "floor TPOT ms", "p50 TPOT ms", "measured / floor"], rows))


def _cells(s: SystemsResult | None) -> list[tuple[dict, Latency, int | None]]:
    """(cell, latency, KV admission) for the primary cell and every matrix cell of a systems result."""
    if not s or not s.latency:
        return []
    primary = {k: s.workload.get(k) for k in ("prompt_tokens", "output_tokens", "concurrency")}
    adm = s.kv.admission_sequences if s.kv else None
    return [({**primary, "prefix": "unique"}, s.latency, adm)] + [
        (c.cell, c.latency, c.admission_sequences) for c in s.cells]


def matrix_section(run: Run) -> str:
    rows, curves = [], {}
    for name, v in run.variants.items():
        for cell, lat, adm in _cells(v.systems):
            label = f"{cell['prompt_tokens']} in / {cell['output_tokens']} out, c={cell['concurrency']}, {cell['prefix']}"
            rows.append([escape(name), escape(label), fmt(lat.ttft_ms.p50, 1), fmt(lat.ttft_ms.p99, 1),
                         fmt(lat.tpot_ms.p50, 1), fmt(lat.tpot_ms.p99, 1), fmt(lat.output_tok_per_s, 1),
                         f"{lat.completed} / {lat.failed + lat.timed_out}", fmt(adm)])
            key = (cell["prompt_tokens"], cell["output_tokens"], cell["prefix"])
            if lat.tpot_ms.p50 is not None:
                curves.setdefault(key, {}).setdefault(name, []).append((cell["concurrency"], lat.tpot_ms.p50))
    if len(rows) <= sum(1 for v in run.variants.values() if v.systems and v.systems.latency):
        return ""  # no matrix beyond the primary cell
    charts = "".join(line_chart(f"p50 TPOT vs concurrency ({p} in / {o} out, {pre} prefix)", series)
                     for (p, o, pre), series in curves.items()
                     if any(len({c for c, _ in pts}) > 1 for pts in series.values()))
    return ("<h2>Workload matrix</h2>" + table(["variant", "cell", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                                                "output tok/s", "ok / failed", "KV admits (≤ max_num_seqs)"],
                                               rows, left=2) + charts)
