"""The page's small vocabulary: number formatting, outcome tags, tables and the inline CSS.

Every section writes its cells through these, so a dash for "not measured", a percentage or a
MiB figure reads the same everywhere on the page.
"""

from __future__ import annotations

import math
from html import escape

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1180px;color:#1b1f24;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:right;vertical-align:top}
th{background:#f6f8fa}td.l,th.l{text-align:left}.muted{color:#57606a}.small{font-size:12px}
.banner{padding:14px 18px;border-radius:8px;font-size:20px;font-weight:700;margin:12px 0}
.PASS{background:#dafbe1;color:#116329}.WARN{background:#fff8c5;color:#7d4e00}.FAIL,.FAILED-TO-RUN,.ERROR{background:#ffebe9;color:#a40e26}
.UNVERIFIED,.INCOMPLETE,.INCONCLUSIVE{background:#ddf4ff;color:#0a3069}
.SKIPPED,.N\\/A{background:#eaeef2;color:#57606a}span.tag{padding:1px 6px;border-radius:4px;font-weight:600;font-size:12px}
code,pre{font:12px ui-monospace,Menlo,monospace}pre{background:#f6f8fa;padding:8px;overflow:auto;white-space:pre-wrap}
.caveat{background:#fff8c5;padding:8px 12px;border-radius:6px;margin:6px 0}
"""


def fmt(x, digits=3, pct=False) -> str:
    """A number as the page shows it: "–" when missing, a percentage with pct, else `digits` decimals."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if pct:
        return f"{x * 100:.1f}%"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def in_mib(b: float) -> float:
    return b / 2**20


def mib(b) -> str:
    return "–" if b is None else f"{in_mib(b):,.0f} MiB"


def tag(outcome: str) -> str:
    return f'<span class="tag {escape(outcome)}">{escape(outcome)}</span>'


def table(headers: list[str], rows: list[list[str]], left: int = 1, last_left: bool = False) -> str:
    """A table whose first `left` columns (and the last, with last_left) are left-aligned text."""
    def cls(i: int) -> str:
        return "l" if i < left or (last_left and i == len(headers) - 1) else ""

    th = "".join(f'<th class="{cls(i)}">{h}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{cls(i)}">{c}</td>'
                                     for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"
