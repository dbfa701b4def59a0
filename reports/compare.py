"""Compare two finished runs (the canary against the last release): what changed, beyond noise.

    quantize-eval compare RUN_A RUN_B

Pure over each run's results.json. First it says whether the runs are comparable at all
(model weights, tokenizer, engine arguments, engine dtype, library versions, hardware);
then, per variant present in both, it flags a quality regression when the two accuracy
95% CIs do not overlap and B is lower, and a latency regression when B's p50 is more than
`LATENCY_NOISE` above A's (two baseline runs here differed by 10-12%).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.results import QualityResult
from reports.view import validated

LATENCY_NOISE = 0.15
PROVENANCE_KEYS = (("model", "weights_sha256"), ("model", "tokenizer_sha256"), ("model", "config_sha256"),
                   ("recipe", "engine"), ("recipe", "quality"), ("recipe", "workload"),
                   ("recipe", "calibration"), ("recipe", "variants"), ("engine_dtype",), ("versions",),
                   ("hardware",))


class CompareError(Exception):
    pass


def _results(run_dir: Path) -> dict:
    path = run_dir / "results.json"
    try:
        return json.loads(path.read_text())
    except OSError:
        raise CompareError(f"{path}: not found (is {run_dir} a finished run folder?)") from None
    except ValueError:
        raise CompareError(f"{path}: not valid JSON") from None


def _get(d: dict, keys: tuple[str, ...]):
    for k in keys:
        d = d.get(k, {}) if isinstance(d, dict) else {}
    return d


def _overall(quality: dict | None) -> tuple[float, int, int] | None:
    """(accuracy, correct, n) pooled over every suite: QualityResult's own definition."""
    q = validated(QualityResult, quality)
    if q is None or q.overall_accuracy() is None:
        return None
    return (q.overall_accuracy(), *q.overall())


def compare(a_dir: Path, b_dir: Path) -> tuple[list[str], bool, bool]:
    """Lines to print, whether anything regressed beyond noise, and whether like for like."""
    from pipeline.stats import wilson

    a, b = _results(a_dir), _results(b_dir)
    lines = [f"A: {a_dir}", f"B: {b_dir}"]
    diffs = [".".join(k) for k in PROVENANCE_KEYS if _get(a["manifest"], k) != _get(b["manifest"], k)]
    if diffs:
        lines.append("NOT LIKE FOR LIKE: the runs differ in " + ", ".join(diffs) + " — deltas below mix causes")
    else:
        lines.append("comparable: same weights, tokenizer, engine arguments, dtype, versions and hardware")
    regressed = False
    for name in a["variants"]:
        if name not in b["variants"]:
            lines.append(f"{name}: only in A")
            continue
        va, vb = a["variants"][name], b["variants"][name]
        qa, qb = _overall(va.get("quality")), _overall(vb.get("quality"))
        if qa and qb:
            lo_a, hi_a = wilson(qa[1], qa[2])
            lo_b, hi_b = wilson(qb[1], qb[2])
            worse = hi_b < lo_a
            regressed |= worse
            lines.append(f"{name}: accuracy {qa[0]:.3f} -> {qb[0]:.3f} (n {qa[2]} / {qb[2]})"
                         + ("  REGRESSION (95% CIs do not overlap)" if worse else "  within noise"))
        sa, sb = va.get("systems") or {}, vb.get("systems") or {}
        la, lb = sa.get("latency"), sb.get("latency")
        if la and lb:
            for metric in ("ttft_ms", "tpot_ms"):
                x, y = la[metric]["p50"], lb[metric]["p50"]
                if x and y:
                    worse = y > x * (1 + LATENCY_NOISE)
                    regressed |= worse
                    lines.append(f"{name}: {metric[:-3]} p50 {x:.1f} -> {y:.1f} ms ({y / x - 1:+.0%})"
                                 + (f"  REGRESSION (> {LATENCY_NOISE:.0%})" if worse else "  within noise"))
    for name in b["variants"]:
        if name not in a["variants"]:
            lines.append(f"{name}: only in B")
    va_, vb_ = (a.get("signoff") or {}).get("verdict"), (b.get("signoff") or {}).get("verdict")
    lines.append(f"verdict: {va_} -> {vb_}")
    return lines, regressed, not diffs
