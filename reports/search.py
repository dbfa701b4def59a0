"""The search's answer (RUN/search/search.json, written by pipeline/search/ladder.py): which candidate, what it
keeps at higher precision, every candidate built with its search-half and sealed-half figures side by side (the
gap between them, the confirmation rule, the Pareto frontier), and the measured sensitivity per block and per
Linear kind. Reads search.json only; it judges nothing.
"""

from __future__ import annotations

from html import escape

from pipeline.search.mixed import describe_modules, describe_parts
from pipeline.search.sealed import unconfirmed
from reports.charts import _axes, _figure
from reports.html import fmt, in_mib, mib, table, tag
from reports.view import Run

VERDICT_COLOUR = {"PASS": "#116329", "WARN": "#7d4e00", "FAIL": "#cf222e", "UNVERIFIED": "#0a3069", "INCONCLUSIVE": "#0a3069"}


def search_banner(run: Run) -> str:
    s = run.search
    if not s:
        return ""
    if s.get("error"):
        return (f'<div class="banner FAIL">SEARCH: NO ANSWER — the search failed: {escape(s["error"])}. '
                "The variants it measured before that are signed off below.</div>")
    if s.get("unmeasured"):  # the objective's own figure could not be measured here: no answer either way
        return f'<div class="banner UNVERIFIED">{escape(s["unmeasured"])}</div>'
    rows = {r["name"]: r for r in s.get("rows", []) + s.get("references", [])}
    answer = rows.get(s.get("answer") or "")
    picked = rows.get(s.get("search_answer") or "")
    tried = (f"{s['candidates']} candidate(s) of at most {s['max_builds']} ({s['built_now']} built by this "
             "invocation, the rest reused from the cache)")
    if not answer:
        if picked:
            sealed = picked.get("sealed") or {}
            return (f'<div class="banner FAIL">SEARCH: NOT CONFIRMED — {escape(s.get("stopped_at") or picked["name"])} '
                    f"passed on the search data and not on the sealed data (sealed {escape(sealed.get('verdict', '–'))}"
                    f"); nothing is signed off</div><p class='small'>{escape(tried)}. {_rule(s)}</p>")
        return (f'<div class="banner FAIL">SEARCH: NONE PASSED — no candidate or reference passed every fail gate '
                f'on the search data; {escape(tried)}</div>')
    kept = (f"keeps {escape(describe_parts(answer['kept']))} at "
            f"{escape(answer['fallback'])}, every other decoder Linear at {escape(s['base_scheme'])} "
            f"g{s['group_size'] or 'channel'}" if answer["kind"] == "candidate" else "a reference variant of the recipe")
    how = (f"<p>Reproduce it as an ordinary variant: <code>quantize-eval {escape(s['reproduce_recipe'])}</code></p>"
           if s.get("reproduce_recipe") else "")
    halves = bool(s.get("confirmation_rule"))  # a search from before the halves judged on all of its data
    verdict = (answer.get("sealed") or {}).get("verdict", answer["verdict"])
    other = (f" {escape(unconfirmed(picked, s.get('stopped_at')))[0].upper()}"
             f"{escape(unconfirmed(picked, s.get('stopped_at')))[1:]}."
             if halves and picked and picked["name"] != answer["name"] else "")
    return (f'<div class="banner {escape(verdict)}">SEARCH ANSWER: {escape(answer["name"])} — '
            f'{in_mib(answer["native_weight_bytes"]):.1f} MiB of weights as loaded natively; {kept}'
            + ("; confirmed on sealed data" if halves else "") + "</div>"
            f"<p class='small'>{escape(tried)}; objective: {escape(s['objective'])}.{other} {_rule(s)} The run's "
            "verdict below counts every candidate" + (" on the sealed data" if halves else "")
            + ": a failing candidate is the search at work, not a failure of the answer.</p>" + how)


def _rule(s: dict) -> str:
    if not s.get("confirmation_rule"):
        return ""
    return (f"The ladder read only the search half of the quality data (split seed {s.get('split_seed', 0)}); "
            f"{escape(s.get('margin_rule', ''))}; the answer is signed off on the sealed half, by this rule: "
            f"{escape(s['confirmation_rule'])}.")


def _ci(pair, digits: int = 3) -> str:
    return f" [{fmt(pair[0], digits)}, {fmt(pair[1], digits)}]" if pair else ""


def _signed(x) -> str:
    return "–" if x is None else f"{x:+.3f}"


def search_section(run: Run) -> str:
    s = run.search
    if not s or s.get("error"):
        return ""
    rows = []
    for r in s.get("rows", []) + s.get("references", []) + s.get("anchors", []):
        what = ("reference" if r["kind"] == "reference" else _anchor_what(r) if r["kind"] == "anchor" else
                f"k={r['k']}" + (f" at {r['fallback']}: {describe_parts(r['kept'])}"
                                 if r["k"] else " (uniform)")) + (
            f"; KV cache {r['kv_cache']}" if r.get("kv_cache", "auto") != "auto" else "")
        kv = fmt(r["kv_tokens"]) + (" (projected)" if r["kv_projected"] else "") if r["kv_tokens"] else "–"
        z = r.get("sealed") or {}
        gap = r.get("gap") or {}
        mark = ("answer" if r["name"] == s.get("answer") else "confirmed" if r.get("confirmed") else
                "compared, not chosen" if r["kind"] == "anchor" else
                "stopped here" if r["name"] == s.get("stopped_at") else "–")
        code = fmt(z.get("code_top1_agreement"), 3) + _ci(z.get("code_top1_ci")) if z.get("code_windows") else "–"
        look = tag(r["verdict"]) + (" <span class='small'>short of the replication margin</span>"
                                    if r.get("search_pass") is False and r["verdict"] in ("PASS", "WARN") else "")
        rows.append([escape(r["name"]), escape(what), look, tag(z["verdict"]) if z else "–",
                     escape(mark),
                     fmt(r["top1_agreement"], 3) + _ci(r.get("top1_ci")),
                     fmt(z.get("top1_agreement"), 3) + _ci(z.get("top1_ci")), code,
                     _signed(gap.get("top1_agreement")),
                     fmt(r["accuracy_delta"], 3) + _ci(r.get("accuracy_delta_ci")),
                     fmt(z.get("accuracy_delta"), 3) + _ci(z.get("accuracy_delta_ci")),
                     _signed(gap.get("accuracy_delta")), fmt(r["kl_mean"], 5),
                     mib(r["native_weight_bytes"]), mib(r["checkpoint_bytes"]), kv,
                     fmt(r.get("tpot_p95_ms"), 1) + _ci(r.get("tpot_p95_ci"), 1),
                     "yes" if r.get("pareto") else "–",
                     "built" if r["built_now"] else ("cached" if r["kind"] in ("candidate", "anchor") else "–")])
    note = ("<p class='small muted'>Every row is a built checkpoint, evaluated and signed off like any variant; "
            "nothing on this table is extrapolated. Weights as loaded natively: floating-point tensors in the "
            "model's own dtype, quantized tensors as stored (what a native kernel holds; where this CPU lacks "
            "the 4-bit kernel the quality was measured on exact dequantized weights and KV tokens are "
            f"projected). Sensitivity: {escape(str(s.get('sensitivity_grid')))}, on "
            f"{s.get('sensitivity_tokens')} held-out tokens of the drift corpus; parts ("
            + escape(str(s.get("units", "blocks"))) + ") ranked by " + escape(_ranked_by(s))
            + "; it only chose which k to build.</p>")
    table_html = table(["candidate", "keeps", "search verdict", "sealed verdict", "confirmation", "search top-1 [CI]",
                        "sealed top-1 [CI]", "sealed top-1, code [CI]", "top-1 gap", "search Δ accuracy [CI]",
                        "sealed Δ accuracy [CI]", "Δ accuracy gap", "search KL", "weights (native)", "checkpoint",
                        "KV tokens", "p95 TPOT (ms) [CI over repeats]", "Pareto", "build"], rows, left=2)
    return ("<h2>Search frontier: search data and sealed data</h2>" + _halves(s) + table_html + frontier_chart(s)
            + sensitivity_chart(s) + note)


def _anchor_what(r: dict) -> str:
    a = r.get("anchor") or {}
    return (f"{a.get('label', 'anchor')} at {fmt(a.get('avg_bits_target'), 3)} bits, {a.get('matched')}'s counted "
            f"its way: {describe_modules(r['kept'])} at {r['fallback']}")


def _anchors(s: dict) -> str:
    """The head-to-head: what each anchor tool was asked, and why one was not compared."""
    runs = s.get("anchor_runs") or []
    said = [f"{a['label']}: not compared ({a.get('skipped') or a.get('error')})" if a.get("skipped") or a.get("error")
            else f"{a['label']} {a.get('version') or ''} chose its 8-bit layers at {fmt(a.get('avg_bits_target'), 3)} "
                 f"bits (achieved {fmt(a.get('avg_bits_achieved'), 3)}), the average bits of {a['matched']} as it "
                 f"counts them; its choice was built with the search's own base scheme and judged on the same halves"
            for a in runs]
    return f" <b>Head-to-head</b> — {escape('; '.join(said))}." if said else ""


def _halves(s: dict) -> str:
    """What each half held, the winner's curse of the search's own pick, and the frontier's axes."""
    if not s.get("confirmation_rule"):
        return ""
    rows = s.get("rows", []) + s.get("references", [])
    z = next((r["sealed"] for r in rows if r.get("sealed")), {})
    curse = s.get("winners_curse") or {}
    curse_txt = ("; ".join(f"{k.replace('_', ' ')} {v:+.4f}" for k, v in curse.items())
                 if curse else "no figure both halves have")
    front = s.get("frontier") or {}
    left = front.get("not_measured_for_every_point") or []
    return ("<p class='small'>"
            f"<b>Search half</b> (the ladder read it): the drift windows of half the essays, half of each suite's "
            f"items. <b>Sealed half</b> (no step of the search read it): {z.get('windows', 0)} drift windows from "
            f"other essays, {z.get('code_windows', 0)} windows of code (a second text domain, judged apart: scope "
            f"'code'), and {z.get('items', 0)} paired items, the other half of each suite. "
            f"<b>Winner's curse</b> of the search data's pick ({escape(s.get('search_answer') or 'none')}), search "
            f"minus sealed: {escape(curse_txt)}. Positive gaps are what choosing on the search data adds; the sealed "
            "column is the figure to sign on."
            + (f" <b>Pareto</b>: {escape(front['note'])}." if front.get("note") else
               f" <b>Pareto</b>: not beaten on every one of {escape(', '.join(front.get('axes') or ['–']))}"
               + (f" (left out, not measured for every point: {escape(', '.join(left))})" if left else "") + ".")
            + _kv_space(s) + _anchors(s) + "</p>")


def _kv_space(s: dict) -> str:
    """What the KV-cache precisions in the space came to: served, or why the engine here would not."""
    space = {k: v for k, v in (s.get("kv_space") or {}).items() if k not in ("auto", "note")}
    parts = [f"{kv}: served with {v['served']} candidate(s)" if v["served"] else
             f"{kv}: not served here ({v['why'] or 'no candidate passed on the search data to try it with'})"
             for kv, v in space.items()]
    note = (s.get("kv_space") or {}).get("note")
    return (f" <b>KV-cache precision</b> — {escape('; '.join(parts))}" + (f"; {escape(note)}" if note else "") + "."
            if parts else "")


def _ranked_by(s: dict) -> str:
    if s.get("sensitivity_method") == "calibrated":
        return ("the KL that part alone adds, quantized by the base scheme's own calibration (run in memory), per "
                "weight kept; an emulated curve of the top parts kept guessed the first k")
    return "the KL that part alone adds when rounded to the nearest point of the base grid, per weight kept"


def frontier_chart(s: dict) -> str:
    """Top-1 agreement against weights as loaded natively, one dot per built candidate and reference,
    coloured by verdict: the sealed half's figures and verdicts, Pareto points ringed (a search from before the
    halves: its single figures)."""
    def sealed_or_search(r: dict) -> tuple:
        z = r.get("sealed")
        return (z.get("top1_agreement"), z.get("verdict"), r.get("pareto")) if z else (r["top1_agreement"],
                                                                                        r["verdict"], False)

    pts = [(r["name"], in_mib(r["native_weight_bytes"]), *sealed_or_search(r))
           for r in s.get("rows", []) + s.get("references", []) + s.get("anchors", []) if r["native_weight_bytes"]]
    pts = [p for p in pts if p[2] is not None]
    sealed = any(r.get("sealed") for r in s.get("rows", []))
    if not pts:
        return ""
    w, h, pad = 520, 300, 56
    x0, x1 = min(p[1] for p in pts) * 0.95, max(p[1] for p in pts) * 1.05
    y0, y1 = min(p[2] for p in pts) - 0.02, min(1.0, max(p[2] for p in pts) + 0.02)

    def sx(x: float) -> float:
        return pad + (x - x0) / ((x1 - x0) or 1) * (w - 2 * pad)

    def sy(y: float) -> float:
        return h - pad - (y - y0) / ((y1 - y0) or 1) * (h - 2 * pad)

    dots = "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="{VERDICT_COLOUR.get(v, "#57606a")}"'
                   + (' stroke="#1b1f24" stroke-width="2"' if front else "") + "/>"
                   f'<text x="{sx(x) + 8:.1f}" y="{sy(y) - 6:.1f}" font-size="11">{escape(n)}</text>'
                   for n, x, y, v, front in pts)
    axes = (_axes(w, h, pad, "weights as loaded natively (MiB)", f"{'sealed ' if sealed else ''}top-1 agreement")
            + f'<text x="{pad}" y="{h - pad + 16}" font-size="11">{x0:.0f}</text>'
            f'<text x="{w - pad}" y="{h - pad + 16}" font-size="11" text-anchor="end">{x1:.0f}</text>'
            f'<text x="{pad - 4}" y="{h - pad}" font-size="11" text-anchor="end">{y0:.2f}</text>'
            f'<text x="{pad - 4}" y="{pad + 4}" font-size="11" text-anchor="end">{y1:.2f}</text>')
    return _figure(w, h, "Search frontier", axes + dots,
                   "Searched frontier: better is up and left; green passes every fail gate, red fails one"
                   + ("; judged on the sealed data, Pareto points ringed" if sealed else ""))


def sensitivity_chart(s: dict) -> str:
    """Mean KL per token when only that part is quantized (the rest unquantized): one bar per block, then per
    kind."""
    rows = [r for r in s.get("sensitivity") or [] if r["kind"] in ("block", "kind")]
    if not rows:
        return block_kind_chart(s)
    kept = set()
    answer = next((r for r in s.get("rows", []) if r["name"] == s.get("answer")), None)
    if answer:
        kept = set(answer["kept"])
    w, h, pad, top = 24 + 16 * len(rows) + 60, 240, 48, max(r["kl_mean"] for r in rows) or 1.0
    bw = 12
    bars = ""
    for i, r in enumerate(rows):
        x = pad + i * 16
        bh = r["kl_mean"] / top * (h - 2 * pad)
        colour = "#bf8700" if r["part"] in kept else ("#8250df" if r["kind"] == "kind" else "#0969da")
        label = r["part"].rsplit(".", 1)[-1]
        bars += (f'<rect x="{x}" y="{h - pad - bh:.1f}" width="{bw}" height="{bh:.1f}" fill="{colour}">'
                 f'<title>{escape(r["part"])}: KL {r["kl_mean"]:.5f}, top-1 {r["top1_agreement"]:.3f}</title></rect>'
                 f'<text x="{x + bw / 2}" y="{h - pad + 12}" font-size="9" text-anchor="end" '
                 f'transform="rotate(-60 {x + bw / 2} {h - pad + 12})">{escape(label)}</text>')
    axes = (_axes(w, h, pad, "", "mean KL (nats/token)")
            + f'<text x="{pad - 4}" y="{pad + 4}" font-size="11" text-anchor="end">{top:.3f}</text>')
    return _figure(w, h, "Sensitivity per block and Linear kind", axes + bars,
                   "Sensitivity: mean KL to the baseline when only that block (blue; kept by the answer: amber) or "
                   "that Linear kind in every block (purple) is quantized by the base scheme") + block_kind_chart(s)


GROUP_COLOURS = ("#0969da", "#8250df", "#1a7f37", "#cf222e", "#57606a", "#9a6700")


def block_kind_chart(s: dict) -> str:
    """units: block_kinds: per block, one thin bar per input-sharing kind group (KL per weight, the ranking's
    measure, as the groups differ in size); the answer's kept groups amber."""
    rows = [r for r in s.get("sensitivity") or [] if r["kind"] == "block_kind"]
    if not rows:
        return ""
    answer = next((r for r in s.get("rows", []) if r["name"] == s.get("answer")), None)
    kept = set(answer["kept"]) if answer else set()
    blocks = list(dict.fromkeys(r["part"].split(":", 1)[0] for r in rows))
    groups = list(dict.fromkeys(r["part"].split(":", 1)[1] for r in rows))
    per_weight = {r["part"]: r["kl_mean"] / max(1, r["params"]) * 1e6 for r in rows}
    bw, gap, pad, h = 4, 6, 56, 240
    step = bw * len(groups) + gap
    w, top = pad + step * len(blocks) + 24, max(per_weight.values()) or 1.0
    bars = ""
    for i, b in enumerate(blocks):
        x0 = pad + i * step
        for j, g in enumerate(groups):
            r = next((r for r in rows if r["part"] == f"{b}:{g}"), None)
            if r is None:
                continue
            bh = per_weight[r["part"]] / top * (h - 2 * pad)
            colour = "#bf8700" if r["part"] in kept else GROUP_COLOURS[j % len(GROUP_COLOURS)]
            bars += (f'<rect x="{x0 + j * bw}" y="{h - pad - bh:.1f}" width="{bw}" height="{bh:.1f}" fill="{colour}">'
                     f'<title>{escape(g)} in block {escape(b.rsplit(".", 1)[-1])}: KL {r["kl_mean"]:.5f} '
                     f'({per_weight[r["part"]]:.4f} per million weights), top-1 {r["top1_agreement"]:.3f}'
                     f'{", kept" if r["part"] in kept else ""}</title></rect>')
        bars += (f'<text x="{x0 + bw * len(groups) / 2}" y="{h - pad + 12}" font-size="9" '
                 f'text-anchor="middle">{escape(b.rsplit(".", 1)[-1])}</text>')
    legend = "; ".join(f'<span style="color:{GROUP_COLOURS[j % len(GROUP_COLOURS)]}">&#9632;</span> {escape(g)}'
                       for j, g in enumerate(groups))
    axes = (_axes(w, h, pad, "decoder block", "KL per million weights")
            + f'<text x="{pad - 4}" y="{pad + 4}" font-size="11" text-anchor="end">{top:.4f}</text>')
    return _figure(w, h, "Sensitivity per Linear kind in each block", axes + bars,
                   "Sensitivity per kind in each block: KL when only that group is quantized, per weight it would "
                   "keep (the ranking's measure): "
                   f"{legend}; kept by the answer: amber")
