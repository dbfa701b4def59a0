"""Inline SVG charts: the quality trade-off scatters with their Pareto fronts, and the p50 TPOT
against concurrency lines of the workload matrix.

No scripts and no images: each chart is an <svg> element written into the page.
"""

from __future__ import annotations

from html import escape

from reports.capacity import memory_as_loaded, requests_that_fit
from reports.html import in_mib
from reports.view import Run, Variant

Point = tuple[str, float, float]  # (variant, x, overall accuracy)


def _axes(w: int, h: int, pad: int, xlabel: str, ylabel: str) -> str:
    return (f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#57606a"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#57606a"/>'
            f'<text x="{w / 2}" y="{h - 12}" font-size="12" text-anchor="middle">{escape(xlabel)}</text>'
            f'<text x="14" y="{h / 2}" font-size="12" transform="rotate(-90 14 {h / 2})" '
            f'text-anchor="middle">{escape(ylabel)}</text>')


def _figure(w: int, h: int, title: str, svg: str, caption: str) -> str:
    return (f"<figure style='display:inline-block;margin:0 18px 12px 0'><svg width='{w}' height='{h}' role='img' "
            f"aria-label='{escape(title)}'>{svg}</svg><figcaption class='small muted'>{caption}</figcaption></figure>")


def pareto(pts: list[Point], lower_x_better: bool) -> set[str]:
    """Names no other point beats on both axes (accuracy up, x down or up as stated)."""
    def beats(a, b) -> bool:
        bx = a[1] <= b[1] if lower_x_better else a[1] >= b[1]
        sx = a[1] < b[1] if lower_x_better else a[1] > b[1]
        return a[2] >= b[2] and bx and (a[2] > b[2] or sx)
    return {p[0] for p in pts if not any(beats(o, p) for o in pts if o is not p)}


def scatter(title: str, xlabel: str, pts: list[Point], projected: set[str], lower_x_better: bool) -> str:
    """An inline SVG scatter of accuracy against x; the Pareto front of the measured points is ringed and
    joined; projected points are hollow and stay off it."""
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

    front = pareto([p for p in pts if p[0] not in projected], lower_x_better)
    line = sorted((p for p in pts if p[0] in front), key=lambda p: p[1])
    poly = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for _, x, y in line)
    dots = "".join(
        (f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="9" fill="none" stroke="#bf8700" stroke-width="2"/>'
         if nm in front else "")
        + (f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="none" stroke="#0969da" stroke-dasharray="2 2"/>'
           if nm in projected else
           f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="{"#116329" if nm == "baseline" else "#0969da"}"/>')
        + f'<text x="{sx(x) + 11:.1f}" y="{sy(y) + 4:.1f}" font-size="12">{escape(nm)}</text>' for nm, x, y in pts)
    axes = (_axes(w, h, pad, xlabel, "accuracy (all suites)")
            + f'<text x="{pad}" y="{h - pad + 16}" font-size="11">{x0:.0f}</text>'
            f'<text x="{w - pad}" y="{h - pad + 16}" font-size="11" text-anchor="end">{x1:,.0f}</text>'
            f'<text x="{pad - 4}" y="{h - pad}" font-size="11" text-anchor="end">{y0:.2f}</text>'
            f'<text x="{pad - 4}" y="{pad + 4}" font-size="11" text-anchor="end">{y1:.2f}</text>')
    front_line = (f'<polyline points="{poly}" fill="none" stroke="#bf8700" stroke-dasharray="4 3"/>'
                  if len(line) > 1 else "")
    better = "left" if lower_x_better else "right"
    return _figure(w, h, title, axes + front_line + dots,
                   f"{escape(title)}: better is up and {better}; ringed = Pareto front ("
                   f"{escape(', '.join(sorted(front)))})")


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], xlabel: str = "concurrency",
               ylabel: str = "p50 TPOT (ms)", caption: str = "", hollow: set | None = None) -> str:
    """Inline SVG: one polyline per variant (by default p50 TPOT (ms) against concurrency); points in
    `hollow` ((name, x) pairs: not measured) are drawn hollow."""
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
                  + "".join(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" '
                            + (f'fill="white" stroke="{colour}"/>' if (name, x) in (hollow or set()) else
                               f'fill="{colour}"/>') for x, y in s)
                  + f'<text x="{sx(s[-1][0]) - 4:.1f}" y="{sy(s[-1][1]) - 8:.1f}" font-size="12" text-anchor="end" '
                    f'fill="{colour}">{escape(name)}</text>')
    axes = (_axes(w, h, pad, xlabel, ylabel)
            + f'<text x="{w - pad}" y="{h - pad + 16}" font-size="11" text-anchor="end">{x1:g}</text>'
            f'<text x="{pad - 4}" y="{pad + 4}" font-size="11" text-anchor="end">{y1:.0f}</text>')
    return _figure(w, h, title, axes + lines, caption or escape(title))


def budget_chart(run: Run) -> str:
    """Requests of the workload's shape that fit (the KV bound) against the memory budget, one line per
    variant whose engine sized its own pool: the run's budget is measured, the others are the arithmetic
    on that engine's measured non-KV memory (hollow)."""
    series, hollow = {}, set()
    for name, v in run.variants.items():
        plan = v.systems.kv.plan if v.systems and v.systems.kv else None
        if plan is None or plan.projected or not plan.across or plan.over_budget_bytes:
            continue
        series[name] = [(round(pt["budget_bytes"] / 2**30, 3), float(pt["requests"])) for pt in plan.across]
        hollow |= {(name, round(pt["budget_bytes"] / 2**30, 3)) for pt in plan.across if not pt["measured"]}
    if len(series) < 1:
        return ""
    return line_chart("Capacity across budgets", series, "memory budget (GiB)",
                      "requests of the workload's shape that fit",
                      "Capacity across budgets: filled = the engine sized its own pool at the run's budget "
                      "(measured); hollow = arithmetic on that engine's measured non-KV memory (how it would size "
                      "itself there), not measured. The KV bound, before max_num_seqs. A variant whose engine went "
                      "over its budget is left out.", hollow)


def _points(run: Run, x_of) -> tuple[list[Point], set[str]]:
    """(variant, x, overall accuracy) for each variant with both, and the names whose x is projected
    rather than measured; accuracy is QualityResult.overall_accuracy()."""
    pts, projected = [], set()
    for name, v in run.variants.items():
        x, is_projected = x_of(v)
        acc = v.quality.overall_accuracy() if v.quality else None
        if x is not None and acc is not None:
            label = f"{name} (projected)" if is_projected else name
            pts.append((label, float(x), acc))
            if is_projected:
                projected.add(label)
    return pts, projected


def _loaded_mib(v: Variant) -> tuple[float | None, bool]:
    b, projected = memory_as_loaded(v)
    return (in_mib(b) if b else None), projected


def _tpot_p99(v: Variant) -> tuple[float | None, bool]:
    s = v.systems
    return (s.latency.tpot_ms.p99 if s and s.latency else None), False


def _capacity(v: Variant) -> tuple[float | None, bool]:
    n, how = requests_that_fit(v)
    return n, how == "projected"


def chart_section(run: Run) -> str:
    """Trade-offs: overall accuracy against memory as loaded, p99 TPOT and capacity (requests that fit)."""
    charts = [scatter("Quality vs memory as loaded", "weights + KV pool (MiB)", *_points(run, _loaded_mib), True),
              scatter("Quality vs p99 TPOT", "p99 TPOT (ms)", *_points(run, _tpot_p99), True),
              scatter("Quality vs capacity", "concurrent requests of the workload's shape",
                      *_points(run, _capacity), False), budget_chart(run)]
    charts = [c for c in charts if c]
    if not charts:
        return ""
    missing = [n for n, v in run.variants.items() if not (v.systems and v.systems.latency)]
    note = (f"<p class='small muted'>Not on the latency chart (not measured): {escape(', '.join(missing))}. "
            "Hollow points are projected (no native kernel here), never on the Pareto front; checkpoint sizes "
            "are in the capacity table.</p>") if missing else ""
    return "<h2>Trade-offs</h2>" + "".join(charts) + note
