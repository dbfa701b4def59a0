"""Sign-off: paired quality statistics, gate outcomes and a verdict per variant.

Pure: reads result objects, writes nothing. Quality is paired item by item with the
baseline (flips, exact McNemar with Holm correction across slices, paired-bootstrap CI
of the delta). A gate on a metric with a CI has three outcomes (judge()). Exit code: 0 when
every fail gate passes, 1 when one fails (a variant that failed to run also fails the run),
4 when one could not be measured here, 5 when one is undecided at this sample size.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.measure import drift, metrics, stats
from pipeline.measure import split as split_rows
from pipeline.measure.split import Split
from pipeline.results import (
    GateOutcome,
    Measured,
    PairedDrift,
    PairedSlice,
    QualityResult,
    Signoff,
    VariantSignoff,
)
from pipeline.store.outcome import VariantOutcome


def _read_checked(vdir: Path, samples_file: str, sha: str | None) -> list[dict]:
    path = vdir / samples_file
    data = path.read_bytes()
    if sha and hashlib.sha256(data).hexdigest() != sha:
        raise ValueError(f"{path}: per-item samples do not match quality.json (rewritten since)")
    return [json.loads(line) for line in data.decode().splitlines()]


def load_rows(vdir: Path, quality: QualityResult, suite: str) -> dict[int, dict]:
    s = quality.suites[suite]
    return {r["doc_id"]: r for r in _read_checked(vdir, s.samples_file, s.samples_sha256)}


def paired_slices(base_dir: Path, base_q: QualityResult, var_dir: Path, var_q: QualityResult,
                  samples: int, seed: int, split: Split | None = None) -> list[PairedSlice]:
    """Per suite, per slice of each suite ('suite/dimension=value': category, context length, depth,
    prompt-length bucket...), and 'overall' (all suites' items pooled, a safety suite's refusals apart). McNemar p-values are
    Holm-adjusted across every suite and slice of the variant (the family it is judged on). With a split, only
    its side's items (a suite with none there is left out, so a gate on it has no data)."""
    pooled_b, pooled_v, near = [], [], []
    out = []
    for suite in base_q.suites:
        if suite not in var_q.suites:
            continue
        b, v = load_rows(base_dir, base_q, suite), load_rows(var_dir, var_q, suite)
        ids = sorted(set(b) & set(v))
        if split is not None:
            ids = split.items(suite, ids)
            if not ids:
                continue
        bs, vs = [b[i]["correct"] for i in ids], [v[i]["correct"] for i in ids]
        if base_q.suites[suite].pooled:
            pooled_b += bs
            pooled_v += vs
            near.append(base_q.suites[suite].near_chance)
        out.append(_paired(suite, bs, vs, samples, seed, base_q.suites[suite].near_chance, suite))
        groups: dict[str, list[int]] = {}
        for i in ids:
            for dim, val in (b[i].get("slices") or {}).items():
                groups.setdefault(f"{suite}/{dim}={val}", []).append(i)
        for key, gids in sorted(groups.items()):
            if len(gids) == len(ids):  # one value covers the suite: the suite row says it already
                continue
            gb, gv = [b[i]["correct"] for i in gids], [v[i]["correct"] for i in gids]
            chance = sum(b[i].get("chance", base_q.suites[suite].chance) for i in gids) / len(gids)
            lo, _ = stats.wilson(sum(gb), len(gb))
            out.append(_paired(key, gb, gv, samples, seed, lo <= chance, suite))
    adjusted = stats.holm([s.mcnemar_p for s in out])
    for s, p in zip(out, adjusted, strict=True):
        s.mcnemar_p_holm = p
    if pooled_b:
        out.append(_paired("overall", pooled_b, pooled_v, samples, seed, all(near), ""))
    return out


def paired_drift(base_dir: Path, base_q: QualityResult, var_dir: Path, var_q: QualityResult,
                 samples: int, seed: int, split: Split | None = None) -> tuple[PairedDrift | None, PairedDrift | None]:
    """(prose, code): drift on the essays' windows and on the second domain's, each None where it has no
    windows. With a split, its side's essays only, and code on the sealed side only (the search reads none)."""
    if base_q.drift is None or var_q.drift is None:
        return None, None
    b = _read_checked(base_dir, base_q.drift.samples_file, base_q.drift.samples_sha256)
    v = _read_checked(var_dir, var_q.drift.samples_file, var_q.drift.samples_sha256)
    if len(b) != len(v):
        raise ValueError(f"drift: baseline has {len(b)} windows, the variant {len(v)}")
    if split is None:
        sides = (split_rows.prose(b), split_rows.code(b))
    else:
        sides = (split.prose(b), split.code(b))
    top_k = min(base_q.drift.top_k, var_q.drift.top_k)
    out = []
    for rows in sides:
        picked = {r["window"] for r in rows}
        if not picked:
            out.append(None)
            continue
        vb = [r for r in b if r["window"] in picked]
        vv = [r for r in v if r["window"] in picked]
        out.append(PairedDrift(top_k=top_k, **drift.summarize(drift.compare(vb, vv), samples, seed)))
    return out[0], out[1]


def _paired(name: str, b: list[int], v: list[int], samples: int, seed: int, near: bool,
            suite: str = "") -> PairedSlice:
    n = len(b)
    if n == 0:
        raise ValueError(f"slice {name}: no items shared by the baseline and the variant")
    c2w = sum(1 for x, y in zip(b, v, strict=True) if x == 1 and y == 0)
    w2c = sum(1 for x, y in zip(b, v, strict=True) if x == 0 and y == 1)
    delta, lo, hi = stats.paired_delta_ci(b, v, samples, seed)
    return PairedSlice(slice=name, suite=suite, n=n, base_acc=sum(b) / n, var_acc=sum(v) / n, delta=delta,
                       delta_ci_low=lo, delta_ci_high=hi, flips_correct_to_wrong=c2w,
                       flips_wrong_to_correct=w2c, mcnemar_p=stats.mcnemar_exact(c2w, w2c),
                       near_chance=near)


def judge(gate, measured: Measured, why_missing: str = "not measured") -> GateOutcome:
    """Three outcomes for a value with a 95% interval (over items, windows or repeats), named so nobody
    misreads them: PASS when its conservative end clears the threshold (the lower bound for >=, the
    upper for <=); FAIL when the point estimate itself is beyond the threshold (the data say worse);
    INCONCLUSIVE in between (the point passes, the interval still reaches the threshold), with how many
    more items or repeats would certify it at today's spread. A point value is judged as it is."""
    common = dict(metric=gate.metric, scope=gate.scope, op=gate.op, threshold=gate.threshold,
                  severity=gate.severity, measured=measured)
    if measured.value is None:
        return GateOutcome(**common, judged_on="-", outcome="N/A", note=why_missing)

    def passes(x: float) -> bool:
        return x >= gate.threshold if gate.op == ">=" else x <= gate.threshold

    bad = "FAIL" if gate.severity == "fail" else "WARN"
    if measured.ci_low is None:
        return GateOutcome(**common, judged_on="point value", outcome="PASS" if passes(measured.value) else bad)
    worst, best = (measured.ci_low, measured.ci_high) if gate.op == ">=" else (measured.ci_high, measured.ci_low)
    over = "repeats" if measured.interval == "repeats" else "items"
    judged_on = f"95% CI {'lower' if gate.op == '>=' else 'upper'} bound and point" + (
        "" if over != "repeats" else " (over engine starts)" if measured.n_of == "workload.engine_starts"
        else " (over repeats)")
    if passes(worst):
        note = f"certified at 95%: {'at least' if gate.op == '>=' else 'at most'} {worst:.4g}"
        return GateOutcome(**common, judged_on=judged_on, outcome="PASS", note=note)
    if not passes(measured.value):
        note = ("certified beyond the threshold at 95% (the whole interval)" if not passes(best)
                else "the point estimate is beyond the threshold")
        return GateOutcome(**common, judged_on=judged_on, outcome=bad, note=note)
    need = stats.n_to_certify(measured.n or 0, measured.value, worst, gate.threshold)
    what = measured.n_of
    note = (f"the point passes but the 95% interval reaches the threshold: about {need} {what} in all "
            f"(now {measured.n}) would certify it with 80% chance if the estimate and its spread hold"
            if need else f"the point passes but the 95% interval reaches the threshold: more {what} would decide it")
    return GateOutcome(**common, judged_on=judged_on, outcome="INCONCLUSIVE", note=note)


def _one_gate(g, scope: str, inp: metrics.Inputs) -> GateOutcome:
    """One gate on one scope; an error computing it is that gate's ERROR, never sign-off's crash."""
    m = metrics.METRICS[g.metric]
    gate = g.model_copy(update={"scope": scope})
    try:
        measured = m.read(inp, scope)
    except Exception as exc:  # noqa: BLE001 - any error here must leave a verdict behind
        return GateOutcome(metric=g.metric, scope=scope, op=g.op, threshold=g.threshold, severity=g.severity,
                           judged_on="-", measured=Measured(value=None), outcome="ERROR",
                           note=f"could not be computed: {type(exc).__name__}: {exc}"[:300])
    out = _judged(gate, measured, inp)
    vacuous = metrics.cannot_fail(inp, g.metric, scope, g.op, g.threshold)
    out.note = "; ".join(x for x in (vacuous, out.note, measured.caveat) if x)
    return out


def _judged(gate, measured: Measured, inp: metrics.Inputs) -> GateOutcome:
    """judge(), and what an unmeasured gate means: quality with no paired items is missing data (ERROR on a
    fail gate); a systems fail gate this hardware cannot measure is UNVERIFIED, else FAIL."""
    m = metrics.METRICS[gate.metric]
    skipped = m.stage == "systems" and inp.systems is not None and inp.systems.status == "skipped"
    why = ((inp.systems.error if inp.systems else None) or "not measured") if m.stage == "systems" else "not measured"
    out = judge(gate, measured, why)
    if out.outcome == "N/A" and m.stage == "quality":  # no paired items there: missing data, never a pass
        out.note = f"missing data: no paired items (or drift windows) for {gate.scope!r}"
        out.outcome = "ERROR" if gate.severity == "fail" else "N/A"
    elif out.outcome == "N/A" and gate.severity == "fail":
        out.note = (f"fail gate not measurable on this hardware: {why}" if skipped
                    else f"fail gate not measured: {why}")
        if not skipped:  # not the hardware's doing: what should have been measured was not
            out.outcome = "FAIL"
    return out


def coverage_gaps(base_q: QualityResult, var_q: QualityResult) -> list[GateOutcome]:
    """A suite one side scored and the other did not: nothing about it can pass, so it is an ERROR that
    names it (pairing skipped it, and a per-suite gate expanded over the variant's own suites only, so a
    variant missing a whole suite read PASS)."""
    out = []
    for suite, where in [(x, "the baseline scored it; this variant has no result for it") for x in base_q.suites
                         if x not in var_q.suites] + \
                        [(x, "this variant scored it; the baseline has no result to pair it with") for x in var_q.suites
                         if x not in base_q.suites]:
        out.append(GateOutcome(metric="suite_coverage", scope=suite, op=">=", threshold=1.0, severity="fail",
                               judged_on="-", measured=Measured(value=None), outcome="ERROR",
                               note=f"missing data: {where}"))
    return out


def judge_gates(recipe, inp: metrics.Inputs) -> list[GateOutcome]:
    """Every gate of the recipe on one variant (each_suite expands to one gate per suite). A fail
    gate that could not be measured fails, unless this hardware cannot measure it (UNVERIFIED)."""
    return [_one_gate(g, scope, inp) for g in recipe.gates
            for scope in ([s for s, q in inp.quality.suites.items() if q.pooled] if g.scope == "each_suite"
                          else [g.scope])]


def verdict_of(gates: list[GateOutcome]) -> str:
    """FAIL on any failed or uncomputable gate; UNVERIFIED when a fail gate could not be measured here;
    INCONCLUSIVE when a fail gate's interval straddles its threshold (neither passed nor failed); else
    WARN or PASS."""
    outcomes = {x.outcome for x in gates}
    if outcomes & {"FAIL", "ERROR"}:
        return "FAIL"
    if any(x.outcome == "N/A" and x.severity == "fail" for x in gates):
        return "UNVERIFIED"
    if any(x.outcome == "INCONCLUSIVE" and x.severity == "fail" for x in gates):
        return "INCONCLUSIVE"
    return "WARN" if outcomes & {"WARN", "N/A", "INCONCLUSIVE"} or not gates else "PASS"


def second_domain_gates(recipe, inp: metrics.Inputs) -> list[GateOutcome]:
    """The recipe's drift gates judged again on the second text domain's windows (scope 'code'): a variant
    that holds on prose and not on code does not pass."""
    out = []
    for g in recipe.gates:
        if metrics.METRICS[g.metric].needs == "drift":
            o = _one_gate(g, "overall", inp)
            o.scope = "code"
            out.append(o)
    return out


def variant_signoff(recipe, run_root: Path, name: str, r: VariantOutcome, base: VariantOutcome,
                    split: Split | None = None) -> VariantSignoff:
    """One variant's verdict from its outcome and the baseline's; with a split, on its side of the data."""
    data = split.describe() if split else "all"
    if r.skipped:
        return VariantSignoff(variant=name, verdict="SKIPPED", reason=r.skipped, data=data)
    if r.error or base.error or r.quality is None or r.systems is None:
        why = r.error or (f"baseline failed: {base.error}" if base.error else "results missing")
        return VariantSignoff(variant=name, verdict="FAILED-TO-RUN", reason=why, data=data)
    q, s = r.quality, r.systems
    try:
        paired = paired_slices(run_root / "baseline", base.quality, run_root / name, q,
                               recipe.quality.bootstrap_samples, recipe.quality.seed, split)
        pd, code = paired_drift(run_root / "baseline", base.quality, run_root / name, q,
                                recipe.quality.bootstrap_samples, recipe.quality.seed, split)
    except (OSError, ValueError, KeyError) as exc:
        return VariantSignoff(variant=name, verdict="FAILED-TO-RUN", reason=f"sign-off: {type(exc).__name__}: {exc}",
                              data=data)
    gates = coverage_gaps(base.quality, q) + judge_gates(
        recipe, metrics.Inputs(quality=q, systems=s, base_systems=base.systems, paired=paired, drift=pd))
    if code is not None:
        gates += second_domain_gates(recipe, metrics.Inputs(quality=q, systems=s, base_systems=base.systems,
                                                            paired=paired, drift=code))
    verdict = verdict_of(gates)
    where = (r.support or {}).get("native_on") or "hardware where this engine runs the scheme natively"
    failing = [f"{x.metric}[{x.scope}] {x.outcome}" + (f" ({x.note})" if x.outcome == "INCONCLUSIVE" else "")
               for x in gates if x.outcome != "PASS"]
    reason = "; ".join(failing + (["no gates declared"] if not gates else [])
                       + ([f"systems not measured: {s.error}"] if s.status == "skipped" else [])
                       + ([f"measurable on {where}"] if verdict == "UNVERIFIED" else []))
    return VariantSignoff(variant=name, verdict=verdict, reason=reason, gates=gates, paired=paired, drift=pd,
                          drift_code=code, data=data)


def signoff(recipe, recipe_hash: str, run_root: Path, results: dict, split: Split | None = None) -> Signoff:
    """results[variant]: its VariantOutcome (pipeline/store/outcome.py; a dict of the same fields is accepted).
    Never raises: an error signing one variant off is that variant's FAIL, with the reason. With a split
    (a search), every variant is judged on that side of the quality data only."""
    results = {n: VariantOutcome.coerce(r) for n, r in results.items()}
    base = results.get("baseline") or VariantOutcome(error="no baseline outcome")
    verdicts = []
    for v in recipe.variants:
        try:
            verdicts.append(variant_signoff(recipe, run_root, v.name, results.get(v.name, VariantOutcome()), base,
                                            split))
        except Exception as exc:  # noqa: BLE001 - the verdict must be written whatever went wrong
            verdicts.append(VariantSignoff(variant=v.name, verdict="FAIL", data=split.describe() if split else "all",
                                           reason=f"sign-off error: {type(exc).__name__}: {exc}"[:500]))
    passing = [x.variant for x in verdicts if x.verdict in ("PASS", "WARN")]
    bad = any(x.verdict in ("FAIL", "FAILED-TO-RUN") for x in verdicts) or not verdicts or bool(base.error)
    # every variant SKIPPED (the engine here cannot run any): nothing was measured, so nothing failed and
    # nothing passed. UNVERIFIED, never PASS (it signs nothing off) and never FAIL ("a fail gate failed")
    unverified = not bad and (any(x.verdict == "UNVERIFIED" for x in verdicts)
                              or all(x.verdict == "SKIPPED" for x in verdicts))
    undecided = not bad and any(x.verdict == "INCONCLUSIVE" for x in verdicts)
    warn = any(x.verdict in ("WARN", "SKIPPED") for x in verdicts)
    recommended = None
    rule, key = OBJECTIVES[recipe.objective]
    ranked = [n for n in passing if _safe(key, results[n]) is not None]
    if ranked and split is None:  # a search's answer is its confirmed candidate (search.json), chosen by its rule
        recommended = min(ranked, key=lambda n: _safe(key, results[n]))
    if split is not None:
        rule = "a search recommends its answer (search.json), confirmed on the sealed half by the search's rule"
    verdict = ("FAIL" if bad else "UNVERIFIED" if unverified else "INCONCLUSIVE" if undecided
               else "WARN" if warn else "PASS")
    return Signoff(recipe=recipe.name, recipe_hash=recipe_hash, verdict=verdict, exit_code=EXIT_CODES[verdict],
                   variants=verdicts, recommended=recommended,
                   recommendation_rule=rule if split is not None else
                   f"{rule}, among variants whose gates pass (PASS or WARN)")


# the process's exit code per run verdict (2: bad input, from the CLI; 3: `compare`, not like for like)
EXIT_CODES = {"PASS": 0, "WARN": 0, "FAIL": 1, "UNVERIFIED": 4, "INCONCLUSIVE": 5}


def _safe(key, r: VariantOutcome):
    try:
        return key(r)
    except Exception:  # noqa: BLE001 - a result that cannot be ranked is not recommended
        return None


def _lat(r: VariantOutcome, kind: str) -> float | None:
    return getattr(r.systems.latency, kind).p50 if r.systems and r.systems.latency else None


def _kv_tokens(r: VariantOutcome) -> int | None:
    return -r.systems.kv.tokens if r.systems and r.systems.kv and r.systems.kv.tokens else None


def _accuracy(r: VariantOutcome) -> float | None:
    a = r.quality.overall_accuracy() if r.quality else None
    return -a if a is not None else None


# objective -> (what it means, key to minimise; None = cannot be ranked on it)
OBJECTIVES = {
    "smallest_checkpoint": ("smallest checkpoint on disk", lambda r: r.systems.checkpoint_bytes if r.systems else None),
    "most_kv_capacity": ("most KV-cache tokens", _kv_tokens),
    "lowest_tpot": ("lowest p50 TPOT", lambda r: _lat(r, "tpot_ms")),
    "lowest_ttft": ("lowest p50 TTFT", lambda r: _lat(r, "ttft_ms")),
    "best_quality": ("highest overall accuracy", _accuracy),
}
