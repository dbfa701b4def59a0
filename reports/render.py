"""Render a run folder into one self-contained report.html plus results.json.

A pure function of the files in the run folder: it never imports stage code or engines,
so `quantize-eval report RUN_DIR` rebuilds the page from saved JSON alone. The page has
inline CSS and inline SVG, no scripts it needs and no network; every string that came
from a model, a dataset or a recipe is HTML-escaped.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

from pipeline.runstore import atomic_write_text, write_json
from pipeline.stats import wilson

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1180px;color:#1b1f24;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:right;vertical-align:top}
th{background:#f6f8fa}td.l,th.l{text-align:left}.muted{color:#57606a}.small{font-size:12px}
.banner{padding:14px 18px;border-radius:8px;font-size:20px;font-weight:700;margin:12px 0}
.PASS{background:#dafbe1;color:#116329}.WARN{background:#fff8c5;color:#7d4e00}.FAIL,.FAILED-TO-RUN{background:#ffebe9;color:#a40e26}
.SKIPPED,.N\\/A{background:#eaeef2;color:#57606a}span.tag{padding:1px 6px;border-radius:4px;font-weight:600;font-size:12px}
code,pre{font:12px ui-monospace,Menlo,monospace}pre{background:#f6f8fa;padding:8px;overflow:auto;white-space:pre-wrap}
.caveat{background:#fff8c5;padding:8px 12px;border-radius:6px;margin:6px 0}
"""


class ReportError(Exception):
    pass


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect(run_dir: Path) -> dict:
    """Everything the run wrote, merged into one JSON-able dict (results.json)."""
    manifest = _load(run_dir / "manifest.json")
    if manifest is None:
        raise ReportError(f"{run_dir}: not a run folder (no readable manifest.json)")
    signoff = _load(run_dir / "signoff.json")
    names = ["baseline", *[v["name"] for v in manifest["recipe"]["variants"]]]
    variants = {}
    for name in names:
        vdir = run_dir / name
        variants[name] = {stage: _load(vdir / f"{stage}.json")
                          for stage in ("quantize", "quality", "systems", "error", "support",
                                        "quality.origin", "systems.origin")}
    return {"schema_version": 1, "manifest": manifest, "signoff": signoff, "variants": variants}


def fmt(x, digits=3, pct=False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if pct:
        return f"{x * 100:.1f}%"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def mib(b) -> str:
    return "–" if b is None else f"{b / 2**20:,.0f} MiB"


def tag(outcome: str) -> str:
    return f'<span class="tag {escape(outcome)}">{escape(outcome)}</span>'


def table(headers: list[str], rows: list[list[str]], left: int = 1, last_left: bool = False) -> str:
    def cls(i: int) -> str:
        return "l" if i < left or (last_left and i == len(headers) - 1) else ""

    th = "".join(f'<th class="{cls(i)}">{h}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{cls(i)}">{c}</td>'
                                     for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def verdict_section(data: dict) -> str:
    so = data["signoff"]
    if so is None:
        return '<div class="banner WARN">NO VERDICT: the run has not finished (no signoff.json)</div>'
    rec = (f" — recommended: <b>{escape(so['recommended'])}</b> "
           f"<span class='small'>({escape(so['recommendation_rule'])})</span>") if so["recommended"] else ""
    rows = [[escape(v["variant"]), tag(v["verdict"]), escape(v.get("reason") or
             ", ".join(f"{g['metric']}[{g['scope']}] {g['outcome']}" for g in v["gates"]) or "no gates")]
            for v in so["variants"]]
    return (f'<div class="banner {escape(so["verdict"])}">VERDICT: {escape(so["verdict"])}{rec}</div>'
            + table(["variant", "verdict", "why"], rows, left=3))


def gates_section(data: dict) -> str:
    so = data["signoff"]
    if not so:
        return ""
    rows = []
    for v in so["variants"]:
        for g in v["gates"]:
            m = g["measured"]
            ci = f" [{fmt(m['ci_low'], 4)}, {fmt(m['ci_high'], 4)}]" if m.get("ci_low") is not None else ""
            rows.append([escape(v["variant"]), escape(g["metric"]), escape(g["scope"]),
                         f"{escape(g['op'])} {fmt(g['threshold'], 4)}", escape(g["severity"]),
                         f"{fmt(m['value'], 4)}{ci}", escape(g["judged_on"]), tag(g["outcome"]),
                         escape(g.get("note", ""))])
    if not rows:
        return "<h2>Gates</h2><p>No gates declared in the recipe.</p>"
    return ("<h2>Gates</h2><p class='small muted'>Metrics with a confidence interval are judged on its "
            "conservative end (lower bound for ≥, upper bound for ≤): non-inferiority, not a point ratio."
            "</p>" + table(["variant", "metric", "scope", "threshold", "severity", "measured [95% CI]",
                            "judged on", "outcome", "note"], rows, left=3, last_left=True))


def quality_section(data: dict) -> str:
    so = data["signoff"] or {"variants": []}
    paired = {v["variant"]: {p["slice"]: p for p in v["paired"]} for v in so["variants"]}
    rows = []
    for name, r in data["variants"].items():
        q = r["quality"]
        if not q:
            continue
        for suite, s in q["suites"].items():
            p = paired.get(name, {}).get(suite)
            delta = (f"{p['delta'] * 100:+.1f} pt [{p['delta_ci_low'] * 100:+.1f}, "
                     f"{p['delta_ci_high'] * 100:+.1f}]") if p else "–"
            flips = f"{p['flips_correct_to_wrong']} / {p['flips_wrong_to_correct']}" if p else "–"
            pv = f"{fmt(p['mcnemar_p'], 3)} ({fmt(p['mcnemar_p_holm'], 3)})" if p else "–"
            near = "<b>near chance</b>" if s["near_chance"] else ""
            cats = s.get("categories") or {}
            failures = " · ".join(f"{k} {v}" for k, v in sorted(cats.items(), key=lambda kv: -kv[1])
                                  if k != "correct") if s.get("kind", "mc") != "mc" else "wrong " + str(
                                      cats.get("wrong", s["n"] - s["correct"]))
            rows.append([escape(name), escape(suite), str(s["n"]),
                         f"{fmt(s['accuracy'], pct=True)} [{fmt(s['ci_low'], pct=True)}, {fmt(s['ci_high'], pct=True)}]",
                         fmt(s["chance"], pct=True), delta, flips, pv, escape(failures), near])
        p = paired.get(name, {}).get("overall")
        if p:
            k = round(p["var_acc"] * p["n"])
            lo, hi = wilson(k, p["n"])
            rows.append([escape(name), "<b>overall</b>", str(p["n"]),
                         f"{fmt(p['var_acc'], pct=True)} [{fmt(lo, pct=True)}, {fmt(hi, pct=True)}]", "",
                         f"{p['delta'] * 100:+.1f} pt [{p['delta_ci_low'] * 100:+.1f}, {p['delta_ci_high'] * 100:+.1f}]",
                         f"{p['flips_correct_to_wrong']} / {p['flips_wrong_to_correct']}",
                         f"{fmt(p['mcnemar_p'], 3)} (unadjusted)", "", ""])
    return ("<h2>Quality, paired against the baseline</h2><p class='small muted'>Per item: multiple choice "
            "is lm-eval acc_norm (length-normalised loglikelihood); generation is scored by "
            "evalsuites/qe_utils.py (number, tool call, needle word) and every miss gets one failure category "
            "(wrong, malformed, truncated, refusal, empty; truncation is judged from the re-tokenized output, "
            "so it is approximate). Accuracy with 95% Wilson CI; chance is 1/choices (0 for generation). "
            "Delta is variant − baseline on the same items; its 95% CI is "
            "the union of a paired bootstrap and the Agresti–Min interval (the bootstrap alone collapses "
            "to a point when few items flip). Flips: correct→wrong / wrong→correct. McNemar: exact two-sided p "
            "(Holm-adjusted across every suite and slice of the variant).</p>"
            + table(["variant", "suite", "n", "accuracy [95% CI]", "chance", "Δ vs baseline [95% CI]",
                     "flips c→w / w→c", "McNemar p (Holm)", "failures", ""], rows, left=2))


def drift_section(data: dict) -> str:
    so = data["signoff"] or {"variants": []}
    base = (data["variants"].get("baseline", {}).get("quality") or {}).get("drift")
    rows = []
    for v in so["variants"]:
        d = v.get("drift")
        if not d:
            continue
        rows.append([escape(v["variant"]), str(d["tokens"]),
                     f"{d['ppl_base']:.2f} → {d['ppl_var']:.2f}",
                     f"{d['ppl_ratio']:.4f} [{d['ppl_ratio_ci_low']:.4f}, {d['ppl_ratio_ci_high']:.4f}]",
                     f"{d['kl_mean']:.5f} [{d['kl_ci_low']:.5f}, {d['kl_ci_high']:.5f}]", f"{d['kl_p99']:.4f}",
                     f"{d['top1_agreement'] * 100:.2f}% [{d['top1_ci_low'] * 100:.2f}, {d['top1_ci_high'] * 100:.2f}]"])
    if not rows:
        return ""
    corpus = escape(base["corpus"]) if base else ""
    k = so["variants"][0].get("drift", {}) or {}
    return ("<h2>Token-level drift against the baseline</h2><p class='small muted'>Corpus: " + corpus + ". "
            "From the engine's own logprobs (echo, top-" + str(k.get("top_k", "k")) + " per position). KL(baseline ‖ "
            "variant) in nats per token over a partition: the tokens both engines list at a position, plus one "
            "bucket for the rest. <b>This is a lower bound of the full-vocabulary KL</b> (merging outcomes never "
            "raises KL), exact when k covers the vocabulary. Top-1: positions where both engines' most likely "
            "next token agree. 95% CIs resample whole windows.</p>"
            + table(["variant", "tokens", "perplexity base → variant", "PPL ratio [95% CI]",
                     "mean KL nats/token [95% CI]", "KL p99", "top-1 agreement [95% CI]"], rows, left=1))


def systems_section(data: dict) -> str:
    mem_rows, lat_rows, roof_rows, extra_rows, probe_rows, ramp_rows = [], [], [], [], [], []
    for name, r in data["variants"].items():
        s = r["systems"]
        if not s:
            continue
        kv = s.get("kv") or {}
        if s.get("status") == "skipped":
            mem_rows.append([escape(name), mib(s.get("checkpoint_bytes")),
                             f"<i>not measured: {escape(s.get('error') or '')}</i>"] + [""] * 9)
            continue
        dev, dev_src = s.get("device_memory_peak_bytes"), s.get("device_memory_source") or ""
        dev_txt = f" (device {mib(dev)}" + (", whole GPU − before start: approximate"
                                             if dev_src.startswith("whole") else "") + ")"
        mem_rows.append([escape(name), mib(s.get("checkpoint_bytes")), mib(s.get("weight_memory_bytes")),
                         mib(s.get("peak_memory_bytes")) + (dev_txt if dev else ""),
                         fmt(kv.get("tokens")), fmt(kv.get("tokens_config")), fmt(kv.get("num_blocks")),
                         fmt(kv.get("block_size")), fmt(kv.get("bytes_per_token_config")),
                         fmt(kv.get("max_concurrency"), 2),
                         f"{fmt(kv.get('admission_sequences'))} (KV alone {fmt(kv.get('admission_kv_only'))})",
                         fmt(s.get("engine_start_s"), 0)])
        pr = kv.get("probe")
        if pr and "steps" in pr:  # (a run from before the ramp has a one-batch probe: not shown)
            probe_rows.append([escape(name), f"{pr['prompt_tokens']} + {pr['output_tokens']} "
                               f"({pr['blocks_per_sequence']} blocks)",
                               f"{pr['predicted']} ({escape(pr['binding'])} binds)",
                               f"<b>{pr['knee']}</b>" if pr.get("first_queued") else f"≥ {pr['knee']} (not reached)",
                               fmt(pr.get("first_queued")), str(pr["requests"]),
                               str(pr["preemptions"]),
                               fmt(pr["kv_usage_peak"], pct=True) if pr.get("kv_usage_peak") is not None else "–",
                               f"{fmt(kv.get('tokens'))} / {fmt(kv.get('tokens_config'))} / "
                               f"{fmt(pr.get('empirical_tokens'))}", escape(pr["note"])])
            for st in pr["steps"]:
                ramp_rows.append([escape(name), str(st["concurrency"]), str(st["max_running"]),
                                  str(st["max_waiting"]), str(st["preemptions"]),
                                  fmt(st["kv_usage_peak"], pct=True) if st.get("kv_usage_peak") is not None else "–",
                                  "<b>queued</b>" if st["queued"] else ("all ran at once" if st.get("overlapped", True)
                                                                       else "never all running: no test"),
                                  f"{fmt(st.get('ttft_p50_ms'), 0)} / {fmt(st.get('ttft_max_ms'), 0)}",
                                  fmt(st.get("tpot_p50_ms"), 1),
                                  fmt(st.get("e2e_p50_ms"), 0), f"{st['completed']} / {st['failed']}",
                                  fmt(st.get("duration_s"), 1)])
        lat = s.get("latency")
        roof = s.get("roofline")
        if roof:
            roof_rows.append([escape(name), f"{roof['bytes_per_step'] / 2**20:,.1f} MiB",
                              escape(roof.get("weight_bytes_source") or "checkpoint bytes"),
                              f"{roof['bandwidth_gbps']:.1f} GB/s", escape(roof["bandwidth_source"]),
                              fmt(roof["floor_tpot_ms"], 1), fmt(lat["tpot_ms"]["p50"], 1) if lat else "–",
                              f"{fmt(roof['measured_over_floor'], 1)}×"])
        if lat:
            extra_rows.append([escape(name), fmt(lat.get("goodput_req_per_s"), 3),
                               fmt(lat.get("slo_attainment"), pct=True),
                               fmt(lat.get("cost_per_1k_requests_usd"), 4),
                               " / ".join(fmt(x, 1) for x in lat.get("repeats_tpot_p50_ms") or []) or "–",
                               fmt(lat.get("tpot_p50_spread"), pct=True)])
            def p(k, lat=lat):
                return " / ".join(fmt(lat[k][q], 1) for q in ("p50", "p95", "p99"))
            lat_rows.append([escape(name), p("ttft_ms"), p("tpot_ms"), p("itl_ms"), p("e2e_ms"),
                             fmt(lat["output_tok_per_s"], 1), f"{lat['completed']} / {lat['failed']} / "
                             f"{lat['timed_out']}"])
    wl = next((r["systems"]["workload"] for r in data["variants"].values() if r["systems"]), {})
    cell = (f"{wl.get('prompt_tokens')} prompt tokens, {wl.get('output_tokens')} output tokens, "
            f"concurrency {wl.get('concurrency')}, {wl.get('num_requests')} measured requests after "
            f"{wl.get('warmup_requests')} warm-up; prefix cache: {wl.get('prefix_cache')}") if wl else ""
    timers = next((r["systems"]["timers"] for r in data["variants"].values() if r["systems"]), "")
    return ("<h2>Memory and capacity</h2><p class='small muted'>KV tokens: engine's own figure "
            "(blocks × block size) beside the config arithmetic (pool bytes ÷ 2·layers·kv_heads·head_dim·"
            "bytes, whole blocks). Admission: sequences of the workload's prompt+output length that fit "
            "at once, capped by engine.max_num_seqs. Weights loaded: parameters + buffers the engine holds "
            "once the model is loaded, reported from inside it (engine dtype; quantized tensors as stored). "
            "Peak memory: RSS summed over the engine's process tree (GPU: plus device memory), "
            "sampled every 0.25 s "
            "(approximate: a shorter spike can be missed).</p>"
            + table(["variant", "checkpoint", "weights loaded", "peak memory", "KV tokens (engine)",
                     "KV tokens (config)", "blocks", "block", "KV bytes/token", "max conc. @max_len",
                     "admission @workload (≤ max_num_seqs)",
                     "engine start s"], mem_rows)
            + ("<h3>Admission knee, measured</h3><p class='small muted'>A request shape filling whole KV "
               "blocks, sized so the KV pool binds before max_num_seqs where max_model_len allows. Concurrency "
               "is ramped (1, 2, 4, … below the prediction, then the prediction and one past it; bisected if "
               "requests queue sooner), each step a fresh batch sent at once while the engine's gauges "
               "(running, waiting, preemptions, KV usage) are polled every 0.05 s. A step <i>queued</i> when a "
               "request waited while the pool had no room for one more sequence (or max_num_seqs ran), or a "
               "sequence was preempted; waiting alone is not queueing, since the token budget admits long "
               "prompts a few per engine step. Knee: the most requests that all ran at once. KV tokens three "
               "ways: engine (blocks × block) / config arithmetic / empirical (the knee's sequences × their "
               "blocks ÷ the engine's usage gauge; KV-bound probes without preemption only). Admission is "
               "whole sequences, so the empirical figure sits up to one sequence below the pool; the note "
               "says what the rest is.</p>"
               + table(["variant", "shape (prompt + output)", "predicted", "knee (measured)", "first queued",
                        "requests sent", "preemptions", "peak KV usage", "KV tokens engine / config / empirical",
                        "note"], probe_rows, last_left=True)
               + "<p class='small muted'>The ramp, step by step: latency of the step's requests (TTFT "
                 "includes the batch's prefill; past the knee, its max includes the queued requests' wait).</p>"
               + table(["variant", "concurrency", "max running", "max waiting", "preemptions", "peak KV usage",
                        "outcome", "TTFT p50 / max ms", "TPOT p50 ms", "e2e p50 ms", "ok / failed", "step wall s"],
                       ramp_rows)
               if probe_rows else "")
            + f"<h2>Latency at fixed concurrency</h2><p class='small muted'>{escape(cell)}. {escape(timers)} "
              "One run per variant: differences under ~10–15% are within run-to-run noise here.</p>"
            + table(["variant", "TTFT ms p50/p95/p99", "TPOT ms p50/p95/p99", "ITL ms p50/p95/p99",
                     "e2e ms p50/p95/p99", "output tok/s", "ok / failed / timeout"], lat_rows)
            + table(["variant", "goodput req/s (SLO)", "SLO attainment", "$ / 1k requests",
                     "p50 TPOT per repeat (ms)", "spread of p50 TPOT"], extra_rows)
            + ("<h2>Decode roofline</h2><p class='small muted'>Floor TPOT = bytes read per decode step "
               "(all weights once + the batch's KV cache at its mean context) ÷ memory bandwidth. An "
               "approximation that ignores activations and caches; the ratio says how far decode is from "
               "the memory wall.</p>" + table(["variant", "bytes / step", "weights from", "bandwidth", "source",
                                                "floor TPOT ms", "p50 TPOT ms", "measured / floor"], roof_rows)
               if roof_rows else ""))


def _points(data: dict, x_of) -> list[tuple[str, float, float]]:
    pts = []
    for name, r in data["variants"].items():
        q = r["quality"]
        x = x_of(r)
        if not q or x is None:
            continue
        k = sum(s["correct"] for s in q["suites"].values())
        n = sum(s["n"] for s in q["suites"].values())
        if n:
            pts.append((name, float(x), k / n))
    return pts


def pareto(pts: list[tuple[str, float, float]], lower_x_better: bool) -> set[str]:
    """Names no other point beats on both axes (accuracy up, x down or up as stated)."""
    def beats(a, b) -> bool:
        bx = a[1] <= b[1] if lower_x_better else a[1] >= b[1]
        sx = a[1] < b[1] if lower_x_better else a[1] > b[1]
        return a[2] >= b[2] and bx and (a[2] > b[2] or sx)
    return {p[0] for p in pts if not any(beats(o, p) for o in pts if o is not p)}


def scatter(title: str, xlabel: str, pts: list[tuple[str, float, float]], lower_x_better: bool) -> str:
    """An inline SVG scatter of accuracy against x; the Pareto front is ringed and joined."""
    if len(pts) < 2:
        return ""
    w, h, pad = 460, 280, 52
    xs, ys = [p[1] for p in pts], [p[2] for p in pts]
    x0, x1 = 0.0, max(xs) * 1.12 or 1.0
    y0, y1 = max(0.0, min(ys) - 0.05), min(1.0, max(ys) + 0.05)

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (w - 2 * pad)

    def sy(y: float) -> float:
        return h - pad - (y - y0) / ((y1 - y0) or 1) * (h - 2 * pad)

    front = pareto(pts, lower_x_better)
    line = sorted((p for p in pts if p[0] in front), key=lambda p: p[1])
    poly = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for _, x, y in line)
    dots = "".join(
        (f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="9" fill="none" stroke="#bf8700" stroke-width="2"/>'
         if nm in front else "")
        + f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="{"#116329" if nm == "baseline" else "#0969da"}"/>'
        f'<text x="{sx(x) + 11:.1f}" y="{sy(y) + 4:.1f}" font-size="12">{escape(nm)}</text>' for nm, x, y in pts)
    axes = (f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#57606a"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#57606a"/>'
            f'<text x="{w / 2}" y="{h - 12}" font-size="12" text-anchor="middle">{escape(xlabel)}</text>'
            f'<text x="14" y="{h / 2}" font-size="12" transform="rotate(-90 14 {h / 2})" '
            f'text-anchor="middle">accuracy (all suites)</text>'
            f'<text x="{pad}" y="{h - pad + 16}" font-size="11">{x0:.0f}</text>'
            f'<text x="{w - pad}" y="{h - pad + 16}" font-size="11" text-anchor="end">{x1:,.0f}</text>'
            f'<text x="{pad - 4}" y="{h - pad}" font-size="11" text-anchor="end">{y0:.2f}</text>'
            f'<text x="{pad - 4}" y="{pad + 4}" font-size="11" text-anchor="end">{y1:.2f}</text>')
    front_line = (f'<polyline points="{poly}" fill="none" stroke="#bf8700" stroke-dasharray="4 3"/>'
                  if len(line) > 1 else "")
    better = "left" if lower_x_better else "right"
    return (f"<figure style='display:inline-block;margin:0 18px 12px 0'><svg width='{w}' height='{h}' role='img' "
            f"aria-label='{escape(title)}'>{axes}{front_line}{dots}</svg><figcaption class='small muted'>"
            f"{escape(title)}: better is up and {better}; ringed = Pareto front ("
            f"{escape(', '.join(sorted(front)))})</figcaption></figure>")


def _cells(s: dict) -> list[tuple[dict, dict, int | None]]:
    """(cell, latency) for the primary cell and every matrix cell of a systems result."""
    if not s or not s.get("latency"):
        return []
    wl = s.get("workload") or {}
    primary = {k: wl.get(k) for k in ("prompt_tokens", "output_tokens", "concurrency")}
    adm = (s.get("kv") or {}).get("admission_sequences")
    return [({**primary, "prefix": "unique"}, s["latency"], adm)] + [
        (c["cell"], c["latency"], c.get("admission_sequences")) for c in s.get("cells", [])]


def matrix_section(data: dict) -> str:
    rows, curves = [], {}
    for name, r in data["variants"].items():
        for cell, lat, adm in _cells(r["systems"]):
            label = f"{cell['prompt_tokens']} in / {cell['output_tokens']} out, c={cell['concurrency']}, {cell['prefix']}"
            rows.append([escape(name), escape(label), fmt(lat["ttft_ms"]["p50"], 1), fmt(lat["ttft_ms"]["p99"], 1),
                         fmt(lat["tpot_ms"]["p50"], 1), fmt(lat["tpot_ms"]["p99"], 1), fmt(lat["output_tok_per_s"], 1),
                         f"{lat['completed']} / {lat['failed'] + lat['timed_out']}", fmt(adm)])
            key = (cell["prompt_tokens"], cell["output_tokens"], cell["prefix"])
            if lat["tpot_ms"]["p50"] is not None:
                curves.setdefault(key, {}).setdefault(name, []).append((cell["concurrency"], lat["tpot_ms"]["p50"]))
    if len(rows) <= sum(1 for r in data["variants"].values() if (r["systems"] or {}).get("latency")):
        return ""  # no matrix beyond the primary cell
    charts = "".join(line_chart(f"p50 TPOT vs concurrency ({p} in / {o} out, {pre} prefix)", series)
                     for (p, o, pre), series in curves.items()
                     if any(len({c for c, _ in pts}) > 1 for pts in series.values()))
    return ("<h2>Workload matrix</h2>" + table(["variant", "cell", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                                                "output tok/s", "ok / failed", "KV admits (≤ max_num_seqs)"],
                                               rows, left=2) + charts)


def line_chart(title: str, series: dict[str, list[tuple[float, float]]]) -> str:
    """Inline SVG: one polyline per variant of p50 TPOT (ms) against concurrency."""
    w, h, pad = 460, 260, 52
    pts = [p for s in series.values() for p in s]
    x1, y1 = max(x for x, _ in pts) or 1, max(y for _, y in pts) * 1.15 or 1

    def sx(x: float) -> float:
        return pad + x / x1 * (w - 2 * pad)

    def sy(y: float) -> float:
        return h - pad - y / y1 * (h - 2 * pad)

    palette = ["#116329", "#0969da", "#bf3989", "#bf8700", "#8250df", "#cf222e"]
    lines = ""
    for i, (name, s) in enumerate(series.items()):
        s = sorted(s)
        colour = palette[i % len(palette)]
        lines += (f'<polyline points="{" ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)}" fill="none" '
                  f'stroke="{colour}" stroke-width="2"/>'
                  + "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>' for x, y in s)
                  + f'<text x="{sx(s[-1][0]) - 4:.1f}" y="{sy(s[-1][1]) - 8:.1f}" font-size="12" text-anchor="end" '
                    f'fill="{colour}">{escape(name)}</text>')
    axes = (f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#57606a"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#57606a"/>'
            f'<text x="{w / 2}" y="{h - 12}" font-size="12" text-anchor="middle">concurrency</text>'
            f'<text x="14" y="{h / 2}" font-size="12" transform="rotate(-90 14 {h / 2})" text-anchor="middle">'
            f'p50 TPOT (ms)</text><text x="{w - pad}" y="{h - pad + 16}" font-size="11" text-anchor="end">{x1:g}</text>'
            f'<text x="{pad - 4}" y="{pad + 4}" font-size="11" text-anchor="end">{y1:.0f}</text>')
    return (f"<figure style='display:inline-block;margin:0 18px 12px 0'><svg width='{w}' height='{h}' role='img' "
            f"aria-label='{escape(title)}'>{axes}{lines}</svg><figcaption class='small muted'>{escape(title)}"
            "</figcaption></figure>")


def chart_section(data: dict) -> str:
    def mib_of(r):
        s = r["systems"]
        return s["checkpoint_bytes"] / 2**20 if s and s.get("checkpoint_bytes") else None

    def tpot99(r):
        s = r["systems"]
        return s["latency"]["tpot_ms"]["p99"] if s and s.get("latency") else None

    def kv_tokens(r):
        s = r["systems"]
        return (s.get("kv") or {}).get("tokens") if s else None

    charts = [scatter("Quality vs weight size", "checkpoint size (MiB)", _points(data, mib_of), True),
              scatter("Quality vs p99 TPOT", "p99 TPOT (ms)", _points(data, tpot99), True),
              scatter("Quality vs KV capacity", "KV-cache capacity (tokens)", _points(data, kv_tokens), False)]
    charts = [c for c in charts if c]
    if not charts:
        return ""
    missing = [n for n, r in data["variants"].items() if not (r["systems"] or {}).get("latency")]
    note = (f"<p class='small muted'>Not on the latency/capacity charts (not measured): "
            f"{escape(', '.join(missing))}.</p>") if missing else ""
    return "<h2>Trade-offs</h2>" + "".join(charts) + note


def heatmap_section(data: dict) -> str:
    """Slice (rows) x variant (columns): delta in points, coloured by size, bold where significant
    (95% CI excludes 0 or Holm-adjusted McNemar p < 0.05); flips in brackets."""
    so = data["signoff"] or {"variants": []}
    slices: list[str] = []
    info: dict[str, dict] = {}
    for v in so["variants"]:
        for p in v["paired"]:
            if p["slice"] not in slices:
                slices.append(p["slice"])
                info[p["slice"]] = p
    if not slices:
        return ""
    by = {v["variant"]: {p["slice"]: p for p in v["paired"]} for v in so["variants"]}
    rows = []
    for sl in slices:
        ref = info[sl]
        label = escape(sl) if "/" not in sl else "&nbsp;&nbsp;" + escape(sl.split("/", 1)[1])
        cells = [f"<b>{label}</b>" if "/" not in sl else label, str(ref["n"]),
                 fmt(ref["base_acc"], pct=True) + (" <b>near chance</b>" if ref["near_chance"] else "")]
        for v in so["variants"]:
            p = by[v["variant"]].get(sl)
            if not p:
                cells.append("–")
                continue
            d = p["delta"] * 100
            a = min(1.0, abs(d) / 10)
            colour = f"rgba(207,34,46,{a:.2f})" if d < 0 else f"rgba(26,127,55,{a:.2f})"
            sig = p["delta_ci_high"] < 0 or p["delta_ci_low"] > 0 or (p.get("mcnemar_p_holm") or 1) < 0.05
            txt = f"{d:+.1f}" + (" *" if sig else "")
            cells.append(f"<span style='background:{colour};padding:2px 6px;border-radius:3px'>"
                         f"{'<b>' + txt + '</b>' if sig else txt}</span> "
                         f"<span class='small muted'>({p['flips_correct_to_wrong']}↓/{p['flips_wrong_to_correct']}↑)</span>")
        rows.append(cells)
    return ("<h2>Deltas by slice</h2><p class='small muted'>Variant − baseline accuracy in points per suite and "
            "per slice of it (category, context length, depth, prompt-length bucket); "
            "* significant (95% CI excludes 0, or Holm-adjusted McNemar p &lt; 0.05 across all of the variant's "
            "slices); (c→w↓ / w→c↑ flips). Slices whose baseline CI reaches chance cannot show damage. "
            "Small slices have wide intervals: read the n.</p>"
            + table(["slice", "n", "baseline", *(escape(v["variant"]) for v in so["variants"])], rows, left=1))


CSV_COLUMNS = ["variant", "verdict", "slice", "n", "base_acc", "var_acc", "delta", "delta_ci_low",
               "delta_ci_high", "flips_correct_to_wrong", "flips_wrong_to_correct", "mcnemar_p",
               "checkpoint_bytes", "peak_memory_bytes", "kv_tokens", "ttft_p50_ms", "ttft_p99_ms",
               "tpot_p50_ms", "tpot_p99_ms", "output_tok_per_s"]


def to_csv(data: dict) -> str:
    """One row per variant and slice, with the variant's systems figures repeated."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    so = data["signoff"] or {"variants": []}
    for v in so["variants"]:
        s = data["variants"].get(v["variant"], {}).get("systems") or {}
        lat = s.get("latency") or {}
        sysrow = {"checkpoint_bytes": s.get("checkpoint_bytes"), "peak_memory_bytes": s.get("peak_memory_bytes"),
                  "kv_tokens": (s.get("kv") or {}).get("tokens"),
                  "ttft_p50_ms": (lat.get("ttft_ms") or {}).get("p50"), "ttft_p99_ms": (lat.get("ttft_ms") or {}).get("p99"),
                  "tpot_p50_ms": (lat.get("tpot_ms") or {}).get("p50"), "tpot_p99_ms": (lat.get("tpot_ms") or {}).get("p99"),
                  "output_tok_per_s": lat.get("output_tok_per_s")}
        for p in v["paired"] or [{"slice": ""}]:
            w.writerow({"variant": v["variant"], "verdict": v["verdict"], **p, **sysrow})
    return buf.getvalue()


def flips_section(data: dict, run_dir: Path, limit: int = 15) -> str:
    out = []
    base_q = data["variants"]["baseline"]["quality"]
    if not base_q:
        return ""
    for name, r in data["variants"].items():
        if name == "baseline" or not r["quality"]:
            continue
        rows = []
        for suite, s in r["quality"]["suites"].items():
            if suite not in base_q["suites"]:
                continue
            b = {x["doc_id"]: x for x in _jsonl(run_dir / "baseline" / base_q["suites"][suite]["samples_file"])}
            for x in _jsonl(run_dir / name / s["samples_file"]):
                y = b.get(x["doc_id"])
                if y and y["correct"] != x["correct"] and len(rows) < limit:
                    if "choices" in x and isinstance(x.get("label"), int) and x.get("pred") is not None:
                        ch = x["choices"]
                        gold, said_b, said_v = ch[x["label"]], ch[y["pred"]], ch[x["pred"]]
                    else:  # generation: what each engine wrote, and its failure category
                        gold = x.get("target", "")
                        said_b = f"[{y.get('category', '')}] {y.get('output', '')}"
                        said_v = f"[{x.get('category', '')}] {x.get('output', '')}"
                    rows.append([escape(suite), escape(str(x["doc_id"])), escape(str(x["question"])[:300]),
                                 escape(str(gold)[:120]), escape(said_b[:200]), escape(said_v[:200]),
                                 "correct→wrong" if y["correct"] else "wrong→correct"])
        if rows:
            out.append(f"<h3>{escape(name)}</h3>" + table(
                ["suite", "item", "question", "gold", "baseline answer", "variant answer", "flip"], rows, left=7))
    if not out:
        return ""
    return "<h2>Flipped items (first 15 per variant)</h2>" + "".join(out)


def _jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def provenance_section(data: dict) -> str:
    m = data["manifest"]
    rows = [["recipe", escape(f"{m['recipe_name']} ({m['recipe_file']}), sha256 {m['recipe_hash'][:16]}…")],
            ["model", escape(m["model_dir"])],
            ["weights sha256", escape(m["model"]["weights_sha256"])],
            ["tokenizer sha256", escape(m["model"]["tokenizer_sha256"])],
            ["engine dtype", escape(m["engine_dtype"])],
            ["engine args", f"<code>{escape(json.dumps(m['recipe']['engine']))}</code>"],
            ["versions", escape(", ".join(f"{k} {v}" for k, v in m["versions"].items()))],
            ["hardware", escape(json.dumps(m["hardware"]))],
            ["started / finished (UTC)", escape(f"{m.get('started_utc')} / {m.get('finished_utc', '–')}")]]
    for name, r in data["variants"].items():
        qz = r["quantize"]
        if qz:
            rows.append([f"{escape(name)} checkpoint", escape(
                f"{qz['scheme']}, {mib(qz['checkpoint_bytes'])}, quantized in {fmt(qz['quantize_wall_s'], 0)} s, "
                f"peak RSS {mib(qz['peak_rss_bytes'])}, ignored {qz['ignored_modules']}, "
                f"{'cached ' if qz['cached'] else ''}key {qz['cache_key']}; versions {qz['versions']}")
                + "".join(f"<br><span class='small muted'>warning: {escape(w)}</span>" for w in qz["warnings"])])
        if r["error"]:
            rows.append([f"{escape(name)} error", escape(r["error"]["error"])])
        for stage in ("quality", "systems"):
            o = r.get(f"{stage}.origin")
            if o:
                rows.append([f"{escape(name)} {stage}", escape(
                    f"reused from the result cache: measured with identical inputs in {o.get('run')} "
                    f"({o.get('stored_utc')})")])
        if r.get("support"):
            rows.append([f"{escape(name)} engine support", escape(
                f"{r['support']['mode']} on {r['support']['platform']}: {r['support']['reason']}")])
    caveats = []
    if m.get("model_note"):
        caveats.append(m["model_note"])
    for name, r in data["variants"].items():
        for suite, s in ((r["quality"] or {}).get("suites") or {}).items():
            if name == "baseline" and s["near_chance"]:
                caveats.append(f"Suite {suite}: the baseline's 95% CI reaches chance "
                               f"({s['chance']:.2f}); it cannot show damage.")
    if any(v.get("drift") for v in (data["signoff"] or {}).get("variants", [])):
        caveats.append("Token-level KL is computed from the engines' top-k logprobs: a lower bound of the "
                       "full-vocabulary KL (see the drift section).")
    caveats.append("Latency and memory come from one run per variant on shared hardware; treat small "
                   "differences as noise. Peak memory is sampled, hence approximate.")
    return ("<h2>Provenance and caveats</h2>" + "".join(f"<div class='caveat'>{escape(c)}</div>" for c in caveats)
            + table(["", ""], rows, left=2))


def schemes_section(data: dict) -> str:
    """What each variant is, how this engine ran it, and what its checkpoint costs per weight."""
    variants = {v["name"]: v for v in data["manifest"]["recipe"]["variants"]}
    rows = []
    for name, r in data["variants"].items():
        if name == "baseline":
            continue
        v, sup, qz = variants.get(name, {}), r.get("support") or {}, r.get("quantize") or {}
        facts = qz.get("facts") or {}
        scheme = v.get("scheme", "?") + ("" if v.get("kv_cache", "auto") == "auto" else f" + KV {v['kv_cache']}")
        mode = sup.get("mode")
        shown = {"native": "native", "emulated": "emulated (quality only)", "unsupported": "SKIPPED"}.get(mode, "–")
        unq = facts.get("unquantized_modules")
        rows.append([escape(name), escape(scheme), escape(sup.get("format", "–")),
                     tag("SKIPPED") if mode == "unsupported" else escape(shown),
                     mib(qz.get("checkpoint_bytes")), fmt(facts.get("bits_per_weight"), 2),
                     escape("–" if unq is None else (", ".join(unq[:4]) + (f" +{len(unq) - 4} more" if len(unq) > 4
                                                                         else "") or "none")),
                     fmt(qz.get("quantize_wall_s"), 0), mib(qz.get("peak_rss_bytes")),
                     escape(sup.get("reason", "–"))])
    if not rows:
        return ""
    return ("<h2>Schemes and engine support</h2><p class='small muted'>Decided before any work from the "
            "installed engine's own answers (kernels in its ISA library, its kernels' is_supported(), its "
            "attention backend). Bits/weight in effect = all weight bytes on disk × 8 / base parameters "
            "(scales and unquantized layers included). Unquantized: 2-D weights left in floating point.</p>"
            + table(["variant", "scheme", "format", "here", "checkpoint", "bits/weight", "unquantized",
                     "quantize s", "quantize peak RSS", "engine support"], rows, left=3, last_left=True))


def render_html(data: dict, run_dir: Path) -> str:
    m = data["manifest"]
    raw = json.dumps(data, default=str).replace("<", "\\u003c")  # no tag can open or close in it
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
            f"<title>quantize-eval: {escape(m['recipe_name'])}</title><style>{CSS}</style></head><body>"
            f"<h1>quantize-eval report: {escape(m['recipe_name'])}</h1>"
            f"<div class='muted small'>{escape(str(run_dir))} · model {escape(m['model_dir'])}</div>"
            + verdict_section(data) + schemes_section(data) + gates_section(data) + quality_section(data)
            + heatmap_section(data) + drift_section(data) + chart_section(data)
            + systems_section(data) + matrix_section(data) + flips_section(data, run_dir) + provenance_section(data)
            + f"<script type='application/json' id='results'>{raw}</script></body></html>")


def render_run(run_dir: Path) -> Path:
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: run folder not found")
    data = collect(run_dir)
    write_json(run_dir / "results.json", data)
    atomic_write_text(run_dir / "results.csv", to_csv(data))
    out = run_dir / "report.html"
    atomic_write_text(out, render_html(data, run_dir))
    return out
