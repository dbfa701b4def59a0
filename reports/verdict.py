"""The top of the page: the sign-off verdict, its recommendation, and every gate it judged.

Both read signoff.json only; the report does not re-judge anything.
"""

from __future__ import annotations

from html import escape

from pipeline.results import VERDICT_MEANING
from reports.html import fmt, table, tag
from reports.view import Run


def missing_stages(run: Run) -> list[str]:
    """The stage results a finished run would have that this folder lacks (SKIPPED variants need none)."""
    out = []
    for name, v in run.variants.items():
        if (v.support or {}).get("mode") == "unsupported" or v.error:
            continue
        out += [f"{name} {stage}" for stage in ("quality", "systems") if getattr(v, stage) is None]
    return out


def verdict_section(run: Run) -> str:
    so = run.signoff
    if so is None:
        missing = missing_stages(run)
        return ('<div class="banner INCOMPLETE">INCOMPLETE — NO VERDICT: the run has not finished (no signoff.json)'
                '</div>' + (f"<p>Stages without a result yet: {escape(', '.join(missing))}.</p>" if missing else ""))
    rec = (f" — recommended: <b>{escape(so.recommended)}</b> "
           f"<span class='small'>({escape(so.recommendation_rule)})</span>") if so.recommended else ""
    rows = [[escape(v.variant), escape(_computed(run, v.variant)), _agreement(run, v.variant), tag(v.verdict),
             escape(v.reason or ", ".join(f"{g.metric}[{g.scope}] {g.outcome}" for g in v.gates) or "no gates")]
            for v in so.variants]
    head = ["variant", "computed as", "second engine agrees", "verdict", "why"]
    if run.search:  # the search's answer is the banner; this is every candidate's own sign-off
        where = (" on the sealed half of the quality data (the search never read it)"
                 if run.search.get("confirmation_rule") else "")
        return f"<h2>Sign-off of every candidate and reference{where}</h2>" + table(head, rows, left=5)
    base = (f"<p class='small'>The baseline, served by the same engine — second engine agrees: "
            f"{_agreement(run, 'baseline')}</p>") if "baseline" in run.variants else ""
    return (f'<div class="banner {escape(so.verdict)}">VERDICT: {escape(so.verdict)}{rec}{_why(so)}</div>'
            + table(head, rows, left=5) + base)


def _why(so) -> str:
    """Why the run is not PASS, on the banner's line: the meaning, then each such variant's reason."""
    if so.verdict not in VERDICT_MEANING:
        return ""
    reasons = "; ".join(f"{v.variant}: {v.reason}" for v in so.variants if v.verdict not in ("PASS",) and v.reason)
    short = reasons if len(reasons) <= 400 else reasons[:399] + "…"
    return f"<div class='small'>{escape(VERDICT_MEANING[so.verdict])}{' — ' + escape(short) if short else ''}</div>"


def _computed(run: Run, name: str) -> str:
    """The precision the engine really computed the variant in (support.json; the schemes table has why)."""
    sup = (run.variants[name].support if name in run.variants else None) or {}
    return f"{sup['compute']} × {sup.get('activations')}" if sup.get("compute") else "–"


def _agreement(run: Run, name: str) -> str:
    """The engine-agreement check (pipeline/stages/agreement.py) in one cell: a disagreement stands out."""
    a = run.variants[name].agreement if name in run.variants else None
    if a is None:
        return "not checked"
    if a.status != "ok":
        return escape(f"{'not checked' if a.status == 'skipped' else 'check FAILED'}: {a.error}")
    n, same = sum(s.n for s in a.suites.values()), sum(s.same_answer for s in a.suites.values())
    figures = escape(f"{same}/{n} same answers ({a.reference}, {a.dtype}); {a.reason}")
    return (f"<b class='FAIL'>NO</b> — {figures}" if a.flagged else f"yes — {figures}")


def gates_section(run: Run) -> str:
    so = run.signoff
    if so is None:
        return ""
    rows = []
    for v in so.variants:
        for g in v.gates:
            m = g.measured
            ci = f" [{fmt(m.ci_low, 4)}, {fmt(m.ci_high, 4)}]" if m.ci_low is not None else ""
            rows.append([escape(v.variant), escape(g.metric), escape(g.scope),
                         f"{escape(g.op)} {fmt(g.threshold, 4)}", escape(g.severity),
                         f"{fmt(m.value, 4)}{ci}", escape(g.judged_on), tag(g.outcome), escape(g.note)])
    if not rows:
        return "<h2>Gates</h2><p>No gates declared in the recipe.</p>"
    return ("<h2>Gates</h2><p class='small muted'>A metric with a 95% interval (over items, drift windows, "
            "or a latency cell's repeats) has three outcomes: PASS when its conservative end clears the "
            "threshold (lower bound for ≥, upper bound for ≤: non-inferiority, not a point ratio), FAIL when "
            "the point estimate is beyond it, INCONCLUSIVE in between (neither a pass nor a regression: the "
            "note says how many more items or repeats would decide it). N/A: not measured (on a fail "
            "gate: UNVERIFIED when this hardware cannot measure it); ERROR: could not be computed."
            "</p>" + table(["variant", "metric", "scope", "threshold", "severity", "measured [95% CI or range]",
                            "judged on", "outcome", "note"], rows, left=3, last_left=True))
