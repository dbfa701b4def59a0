"""Compare two finished runs (the canary against the last release): what changed, beyond noise.

    quantize-eval compare RUN_A RUN_B

Over each run's results.json and per-item samples. First it says whether the runs are comparable
at all (model weights, tokenizer, engine arguments, engine dtype, each suite's settings: task definition,
chat template, few-shot count, stop strings, max_gen_toks, data pin; library versions, hardware);
then, per variant present in both:
  quality   paired item by item when both runs scored the same items (exact McNemar on the flips,
            95% paired CI of the delta: a regression when the whole CI is below zero); otherwise it
            says it cannot pair and falls back to the two accuracy CIs not overlapping
  compute   the precision the engine computed each variant in (W4A16 vs W4A8, weight-only FP8 vs
            FP8 x FP8) and the engine environment that chose it: a change makes that variant not
            like for like, said before its deltas
  verdict   PASS in A and anything else in B is a regression (WARN, INCONCLUSIVE, SKIPPED included), as
            is WARN in A and anything but PASS/WARN in B
  missing   an unfinished run (no sign-off), a variant in one run only, or a suite one side scored and
            the other did not: nothing about it can be compared, so compare names it and exits 3
            whatever else it found
  capacity  checkpoint bytes, weights as loaded, KV tokens and admission are deterministic: any
            worsening is a regression; peak memory is sampled, so only beyond 10%
  latency   a regression only beyond max(5%, twice the repeat spread of either run); a run without
            repeats has no measured spread, and then 15% (two single baseline runs differed 10-12%)
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.measure import stats
from pipeline.results import QualityResult
from reports.provenance import env_text
from reports.view import validated

NOISE_FLOOR, NO_SPREAD_NOISE, PEAK_MEMORY_NOISE = 0.05, 0.15, 0.10
PROVENANCE_KEYS = (("model", "weights_sha256"), ("model", "tokenizer_sha256"), ("model", "config_sha256"),
                   ("recipe", "engine"), ("recipe", "quality"), ("recipe", "workload"),
                   ("recipe", "calibration"), ("recipe", "variants"), ("engine_dtype",), ("engine_numerics_env",),
                   ("versions",),
                   ("hardware",))
GOOD = ("PASS", "WARN")  # ordered: from the first, anything else is worse; from the second, anything not GOOD


def _worse(a: str | None, b: str | None) -> bool:
    """Is verdict b a step down from verdict a? (PASS -> anything not PASS; WARN -> anything not PASS/WARN.)"""
    return a in GOOD and b not in GOOD[:GOOD.index(a) + 1]


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


def _items(run_dir: Path, name: str, q: QualityResult) -> dict[tuple[str, int], tuple[int, str | None]]:
    """(suite, item) -> (correct, prompt hash), from the variant's samples files."""
    out = {}
    for suite, s in q.suites.items():
        path = run_dir / name / s.samples_file
        for line in path.read_text().splitlines() if path.exists() else []:
            r = json.loads(line)
            out[(suite, r["doc_id"])] = (int(r["correct"]), r.get("prompt_hash"))
    return out


def quality_lines(name: str, a_dir: Path, b_dir: Path, qa: QualityResult, qb: QualityResult) -> tuple[list[str], bool]:
    ia, ib = _items(a_dir, name, qa), _items(b_dir, name, qb)
    same = bool(ia) and ia.keys() == ib.keys() and all(ia[k][1] == ib[k][1] for k in ia)
    (ka, na), (kb, nb) = qa.overall(), qb.overall()
    head = f"{name}: accuracy {ka / na:.3f} -> {kb / nb:.3f} (n {na} / {nb})" if na and nb else f"{name}: accuracy –"
    if not same:
        lo_a, hi_a = stats.wilson(ka, na)
        lo_b, hi_b = stats.wilson(kb, nb)
        worse = hi_b < lo_a
        return [head + ("  REGRESSION (95% CIs do not overlap)" if worse else "  within noise")
                + "  [cannot pair: the runs did not score the same items; unpaired CIs are far less sensitive]"], worse
    keys = sorted(ia)
    a, b = [ia[k][0] for k in keys], [ib[k][0] for k in keys]
    delta, lo, hi = stats.paired_delta_ci(a, b)
    c2w = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    w2c = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    worse = hi < 0
    return [head + f"; paired on {len(keys)} items: Δ {delta * 100:+.1f} pt [{lo * 100:+.1f}, {hi * 100:+.1f}], "
            f"flips {c2w} c→w / {w2c} w→c, McNemar p {stats.mcnemar_exact(c2w, w2c):.3g}"
            + ("  REGRESSION (the paired 95% CI is below zero)" if worse else "  within noise")], worse


def _spread(lat: dict) -> float | None:
    return lat.get("tpot_p50_spread")


def latency_lines(name: str, la: dict, lb: dict) -> tuple[list[str], bool]:
    spreads = [s for s in (_spread(la), _spread(lb)) if s is not None]
    noise = max(NOISE_FLOOR, 2 * max(spreads)) if spreads else NO_SPREAD_NOISE
    lines, regressed = [], False
    for metric in ("ttft_ms", "tpot_ms"):
        x, y = la[metric]["p50"], lb[metric]["p50"]
        if x and y:
            worse = y > x * (1 + noise)
            regressed |= worse
            lines.append(f"{name}: {metric[:-3]} p50 {x:.1f} -> {y:.1f} ms ({y / x - 1:+.0%})"
                         + (f"  REGRESSION (> {noise:.0%})" if worse else f"  within noise (±{noise:.0%})"))
    return lines, regressed


def capacity_lines(name: str, sa: dict, sb: dict) -> tuple[list[str], bool]:
    """(label, value in A, value in B, higher is worse, tolerance) for each memory and capacity figure."""
    kv_a, kv_b = sa.get("kv") or {}, sb.get("kv") or {}
    figures = (("checkpoint bytes", sa.get("checkpoint_bytes"), sb.get("checkpoint_bytes"), True, 0.0),
               ("weights as loaded", sa.get("weight_memory_bytes"), sb.get("weight_memory_bytes"), True, 0.0),
               ("KV tokens", kv_a.get("tokens"), kv_b.get("tokens"), False, 0.0),
               ("admission", kv_a.get("admission_sequences"), kv_b.get("admission_sequences"), False, 0.0),
               ("peak memory", sa.get("peak_memory_bytes"), sb.get("peak_memory_bytes"), True, PEAK_MEMORY_NOISE))
    lines, regressed = [], False
    for label, x, y, up_is_worse, tol in figures:
        if x is None or y is None:
            continue
        change = (y - x) / x if x else 0.0
        worse = change > tol if up_is_worse else change < -tol
        regressed |= worse
        if x != y:
            lines.append(f"{name}: {label} {x:,} -> {y:,} ({change:+.1%})" + ("  REGRESSION" if worse else ""))
    return lines, regressed


def _path(v: dict) -> str:
    s = v.get("support") or {}
    if not s.get("compute"):
        return "–" if not s else f"{s.get('mode')} (no compute path recorded)"
    env = env_text(s.get("engine_env"))
    return f"{s['compute']}, activations {s.get('activations')}" + (f" [{env}]" if env else "")


def compute_lines(name: str, va: dict, vb: dict) -> tuple[list[str], bool]:
    """The compute path in each run; False when it changed (the variant's deltas then mix causes)."""
    pa, pb = _path(va), _path(vb)
    if pa == pb:
        return ([f"{name}: computed as {pa}"] if pa != "–" else []), True
    return [f"{name}: NOT LIKE FOR LIKE: computed as {pa} in A, {pb} in B — its deltas below mix the engine's "
            "compute path with the change"], False


def verdict_lines(a: dict, b: dict) -> tuple[list[str], bool]:
    sa, sb = a.get("signoff") or {}, b.get("signoff") or {}
    va = {v["variant"]: v["verdict"] for v in sa.get("variants", [])}
    vb = {v["variant"]: v["verdict"] for v in sb.get("variants", [])}
    lines, regressed = [], False
    for name in sorted(va.keys() & vb.keys()):
        worse = _worse(va[name], vb[name])
        regressed |= worse
        if va[name] != vb[name]:
            lines.append(f"{name}: verdict {va[name]} -> {vb[name]}" + ("  REGRESSION" if worse else ""))
    worse = _worse(sa.get("verdict"), sb.get("verdict"))
    lines.append(f"verdict: {sa.get('verdict')} -> {sb.get('verdict')}" + ("  REGRESSION" if worse else ""))
    return lines, regressed or worse


def missing(a_dir: Path, b_dir: Path, a: dict, b: dict) -> list[str]:
    """What one side lacks that the other has: nothing about it can be compared (exit 3, named)."""
    out = []
    for side, d, r in (("A", a_dir, a), ("B", b_dir, b)):
        if not (r.get("signoff") or {}).get("verdict"):
            out.append(f"run {side} ({d}) is unfinished: it has no sign-off")
    for name in a["variants"]:
        if name not in b["variants"]:
            out.append(f"variant {name} is in A only")
    out += [f"variant {name} is in B only" for name in b["variants"] if name not in a["variants"]]
    for name in sorted(a["variants"].keys() & b["variants"].keys()):
        qa = (a["variants"][name].get("quality") or {}).get("suites") or {}
        qb = (b["variants"][name].get("quality") or {}).get("suites") or {}
        out += [f"{name}: suite {s} was scored in A only" for s in sorted(qa.keys() - qb.keys())]
        out += [f"{name}: suite {s} was scored in B only" for s in sorted(qb.keys() - qa.keys())]
    return out


def suite_diffs(ma: dict, mb: dict) -> list[str]:
    """Each setting of a suite both runs scored that differs (suites.settings: the task definition, chat
    template, few-shot count, stop strings, max_gen_toks, generation settings, the data's pin), by name. A run
    that does not record them (written before they were) cannot be shown to match, so it does not."""
    sa, sb = ma.get("suites"), mb.get("suites")
    if sa is None and sb is None:
        return []
    if sa is None or sb is None:
        return [f"suites (run {'A' if sa is None else 'B'} does not record its suites' settings)"]
    return [f"suites.{name}.{field}" for name in sorted(set(sa) & set(sb))
            for field in sorted(set(sa[name]) | set(sb[name])) if sa[name].get(field) != sb[name].get(field)]


def compare(a_dir: Path, b_dir: Path) -> tuple[list[str], bool, bool, list[str]]:
    """Lines to print, whether anything regressed beyond noise, whether like for like, and what one side
    lacks (each a reason the comparison is incomplete)."""
    a, b = _results(a_dir), _results(b_dir)
    lines = [f"A: {a_dir}", f"B: {b_dir}"]
    absent = missing(a_dir, b_dir, a, b)
    lines += [f"CANNOT COMPARE: {m}" for m in absent]
    diffs = [".".join(k) for k in PROVENANCE_KEYS if _get(a["manifest"], k) != _get(b["manifest"], k)]
    diffs += suite_diffs(a["manifest"], b["manifest"])
    lines.append("NOT LIKE FOR LIKE: the runs differ in " + ", ".join(diffs) + " — deltas below mix causes" if diffs
                 else "same weights, tokenizer, engine arguments, dtype, suite settings, versions and hardware"
                 + ("" if absent else ": comparable"))
    regressed = False
    for name in a["variants"]:
        if name not in b["variants"]:
            continue
        va, vb = a["variants"][name], b["variants"][name]
        path, same_path = compute_lines(name, va, vb)
        lines += path
        diffs += [] if same_path else [f"{name}'s compute path"]
        qa, qb = validated(QualityResult, va.get("quality")), validated(QualityResult, vb.get("quality"))
        sa, sb = va.get("systems") or {}, vb.get("systems") or {}
        parts = [quality_lines(name, a_dir, b_dir, qa, qb) if qa and qb else ([], False),
                 capacity_lines(name, sa, sb),
                 latency_lines(name, sa["latency"], sb["latency"]) if sa.get("latency") and sb.get("latency")
                 else ([], False)]
        for more, worse in parts:
            lines += more
            regressed |= worse
    more, worse = verdict_lines(a, b)
    return lines + more, regressed or worse, not diffs, absent
