"""Sign-off: paired quality statistics, gate outcomes and a verdict per variant.

Pure: reads result objects, writes nothing. Quality is paired item by item with the
baseline (flips, exact McNemar with Holm correction across slices, paired-bootstrap CI
of the delta). A gate on a metric with a CI is judged on the CI's conservative end:
the lower bound for `>=`, the upper bound for `<=`. Exit code: 0 when no fail gate
fails, 1 otherwise (a variant that failed to run also fails the run).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline import drift, metrics, stats
from pipeline.results import (
    GateOutcome,
    Measured,
    PairedDrift,
    PairedSlice,
    QualityResult,
    Signoff,
    SystemsResult,
    VariantSignoff,
)


def _read_checked(vdir: Path, samples_file: str, sha: str | None) -> list[dict]:
    path = vdir / samples_file
    data = path.read_bytes()
    if sha and hashlib.sha256(data).hexdigest() != sha:
        raise ValueError(f"{path}: per-item samples do not match quality.json (rewritten since)")
    return [json.loads(line) for line in data.decode().splitlines()]


def load_rows(vdir: Path, quality: QualityResult, suite: str) -> dict[int, dict]:
    s = quality.suites[suite]
    return {r["doc_id"]: r for r in _read_checked(vdir, s.samples_file, s.samples_sha256)}


def load_samples(vdir: Path, quality: QualityResult, suite: str) -> dict[int, int]:
    return {i: r["correct"] for i, r in load_rows(vdir, quality, suite).items()}


def paired_slices(base_dir: Path, base_q: QualityResult, var_dir: Path, var_q: QualityResult,
                  samples: int, seed: int) -> list[PairedSlice]:
    """Per suite, per slice of each suite ('suite/dimension=value': category, context length, depth,
    prompt-length bucket...), and 'overall' (all suites' items pooled). McNemar p-values are
    Holm-adjusted across every suite and slice of the variant (the family it is judged on)."""
    pooled_b, pooled_v, near = [], [], []
    out = []
    for suite in base_q.suites:
        if suite not in var_q.suites:
            continue
        b, v = load_rows(base_dir, base_q, suite), load_rows(var_dir, var_q, suite)
        ids = sorted(set(b) & set(v))
        bs, vs = [b[i]["correct"] for i in ids], [v[i]["correct"] for i in ids]
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
                 samples: int, seed: int) -> PairedDrift | None:
    if base_q.drift is None or var_q.drift is None:
        return None
    b = _read_checked(base_dir, base_q.drift.samples_file, base_q.drift.samples_sha256)
    v = _read_checked(var_dir, var_q.drift.samples_file, var_q.drift.samples_sha256)
    s = drift.summarize(drift.compare(b, v), samples, seed)
    return PairedDrift(top_k=min(base_q.drift.top_k, var_q.drift.top_k), **s)


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


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b in (None, 0):
        return None
    return a / b


def systems_metric(name: str, v: SystemsResult, b: SystemsResult) -> Measured:
    lv, lb = v.latency, b.latency
    value = None
    if name == "checkpoint_bytes_ratio":
        return Measured(value=_ratio(v.checkpoint_bytes, b.checkpoint_bytes))
    if lv is None or lb is None or v.status != "ok" or b.status != "ok":
        return Measured(value=None)
    if name.endswith("_ratio") and name.split("_")[0] in ("ttft", "tpot"):
        kind, pct = name.split("_")[0], name.split("_")[1]
        value = _ratio(getattr(getattr(lv, f"{kind}_ms"), pct), getattr(getattr(lb, f"{kind}_ms"), pct))
    elif name in ("ttft_p99_ms", "tpot_p99_ms"):
        value = getattr(lv, name[:-7] + "_ms").p99
    elif name == "error_rate":
        total = lv.completed + lv.failed + lv.timed_out
        value = (lv.failed + lv.timed_out) / total if total else None
    elif name == "peak_memory_ratio":
        value = _ratio(v.peak_memory_bytes, b.peak_memory_bytes)
    elif name == "kv_tokens_ratio":
        value = _ratio(v.kv.tokens if v.kv else None, b.kv.tokens if b.kv else None)
    return Measured(value=value)


def quality_metric(name: str, scope: str, var_q: QualityResult, paired: list[PairedSlice],
                   pd: PairedDrift | None = None) -> Measured:
    if name in ("kl_divergence", "top1_agreement", "perplexity_ratio"):
        if pd is None:
            return Measured(value=None)
        key = {"kl_divergence": ("kl_mean", "kl"), "top1_agreement": ("top1_agreement", "top1"),
               "perplexity_ratio": ("ppl_ratio", "ppl_ratio")}[name]
        return Measured(value=getattr(pd, key[0]), ci_low=getattr(pd, f"{key[1]}_ci_low"),
                        ci_high=getattr(pd, f"{key[1]}_ci_high"))
    if name == "accuracy" and "/" in scope:
        suite, key = scope.split("/", 1)
        st = var_q.suites[suite].slices.get(key) if suite in var_q.suites else None
        if st is None:
            return Measured(value=None)
        return Measured(value=st.accuracy, ci_low=st.ci_low, ci_high=st.ci_high)
    if name == "accuracy":
        if scope == "overall":
            k = sum(s.correct for s in var_q.suites.values())
            n = sum(s.n for s in var_q.suites.values())
        else:
            k, n = var_q.suites[scope].correct, var_q.suites[scope].n
        lo, hi = stats.wilson(k, n)
        return Measured(value=k / n if n else None, ci_low=lo, ci_high=hi)
    ps = next((p for p in paired if p.slice == scope), None)
    if ps is None and "/" in scope:  # a slice covering its whole suite is reported as the suite row
        suite, key = scope.split("/", 1)
        st = var_q.suites[suite].slices.get(key) if suite in var_q.suites else None
        if st is not None and st.n == var_q.suites[suite].n:
            ps = next((p for p in paired if p.slice == suite), None)
    if ps is None:
        return Measured(value=None)
    return Measured(value=ps.delta, ci_low=ps.delta_ci_low, ci_high=ps.delta_ci_high)


def judge(gate, measured: Measured, why_missing: str = "not measured") -> GateOutcome:
    if measured.value is None:
        return GateOutcome(metric=gate.metric, scope=gate.scope, op=gate.op, threshold=gate.threshold,
                           severity=gate.severity, judged_on="-", measured=measured, outcome="N/A",
                           note=why_missing)
    if measured.ci_low is not None:
        judged_on, x = ("CI lower bound", measured.ci_low) if gate.op == ">=" else \
            ("CI upper bound", measured.ci_high)
    else:
        judged_on, x = "point value", measured.value
    ok = x >= gate.threshold if gate.op == ">=" else x <= gate.threshold
    outcome = "PASS" if ok else ("FAIL" if gate.severity == "fail" else "WARN")
    return GateOutcome(metric=gate.metric, scope=gate.scope, op=gate.op, threshold=gate.threshold,
                       severity=gate.severity, judged_on=judged_on, measured=measured, outcome=outcome)


def signoff(recipe, recipe_hash: str, run_root: Path, results: dict[str, dict]) -> Signoff:
    """results[variant] = {"quality": QualityResult|None, "systems": ..., "error": str|None}."""
    base = results["baseline"]
    base_q, base_s = base.get("quality"), base.get("systems")
    verdicts = []
    for v in recipe.variants:
        r = results.get(v.name, {})
        if r.get("skipped"):
            verdicts.append(VariantSignoff(variant=v.name, verdict="SKIPPED", reason=r["skipped"]))
            continue
        err = r.get("error") or base.get("error")
        if err or r.get("quality") is None or r.get("systems") is None:
            why = r.get("error") or (f"baseline failed: {base.get('error')}" if base.get("error")
                                     else "results missing")
            verdicts.append(VariantSignoff(variant=v.name, verdict="FAILED-TO-RUN", reason=why))
            continue
        q, s = r["quality"], r["systems"]
        try:
            paired = paired_slices(run_root / "baseline", base_q, run_root / v.name, q,
                                   recipe.quality.bootstrap_samples, recipe.quality.seed)
            pd = paired_drift(run_root / "baseline", base_q, run_root / v.name, q,
                              recipe.quality.bootstrap_samples, recipe.quality.seed)
        except (OSError, ValueError, KeyError) as exc:
            verdicts.append(VariantSignoff(variant=v.name, verdict="FAILED-TO-RUN",
                                           reason=f"sign-off: {type(exc).__name__}: {exc}"))
            continue
        gates = []
        for g in recipe.gates:
            m = metrics.METRICS[g.metric]
            scopes = list(q.suites) if g.scope == "each_suite" else [g.scope]
            for scope in scopes:
                measured = (quality_metric(g.metric, scope, q, paired, pd) if m.stage == "quality"
                            else systems_metric(g.metric, s, base_s))
                why = (s.error or "not measured") if m.stage == "systems" else "not measured"
                gates.append(judge(g.model_copy(update={"scope": scope}), measured, why))
        # a fail gate that could not be measured cannot pass: it fails, with its reason
        for x in gates:
            if x.outcome == "N/A" and x.severity == "fail":
                x.outcome = "FAIL"
                x.note = f"fail gate not measured: {x.note}"
        outcomes = {x.outcome for x in gates}
        verdict = "FAIL" if "FAIL" in outcomes else "WARN" if outcomes & {"WARN", "N/A"} or not gates else "PASS"
        failing = [f"{x.metric}[{x.scope}] {x.outcome}" for x in gates if x.outcome != "PASS"]
        reason = "; ".join(failing + (["no gates declared"] if not gates else [])
                           + ([f"systems not measured: {s.error}"] if s.status == "skipped" else []))
        verdicts.append(VariantSignoff(variant=v.name, verdict=verdict, reason=reason, gates=gates,
                                       paired=paired, drift=pd))
    passing = [x.variant for x in verdicts if x.verdict in ("PASS", "WARN")]
    # nothing evaluated (all skipped) is not a sign-off either
    bad = any(x.verdict in ("FAIL", "FAILED-TO-RUN") for x in verdicts) or not passing
    warn = any(x.verdict in ("WARN", "SKIPPED") for x in verdicts)
    recommended = None
    rule, key = OBJECTIVES[recipe.objective]
    ranked = [n for n in passing if key(results[n]) is not None]
    if ranked:
        recommended = min(ranked, key=lambda n: key(results[n]))
    return Signoff(recipe=recipe.name, recipe_hash=recipe_hash,
                   verdict="FAIL" if bad else ("WARN" if warn else "PASS"), exit_code=1 if bad else 0,
                   variants=verdicts, recommended=recommended,
                   recommendation_rule=f"{rule}, among variants whose gates pass (PASS or WARN)")


def _overall_acc(r: dict) -> float | None:
    q = r.get("quality")
    n = sum(s.n for s in q.suites.values()) if q else 0
    return sum(s.correct for s in q.suites.values()) / n if n else None


def _lat(r: dict, kind: str) -> float | None:
    s = r.get("systems")
    return getattr(s.latency, kind).p50 if s and s.latency else None


# objective -> (what it means, key to minimise; None = cannot be ranked on it)
OBJECTIVES = {
    "smallest_checkpoint": ("smallest checkpoint on disk",
                            lambda r: r["systems"].checkpoint_bytes if r.get("systems") else None),
    "most_kv_capacity": ("most KV-cache tokens",
                         lambda r: -r["systems"].kv.tokens if r.get("systems") and r["systems"].kv
                         and r["systems"].kv.tokens else None),
    "lowest_tpot": ("lowest p50 TPOT", lambda r: _lat(r, "tpot_ms")),
    "lowest_ttft": ("lowest p50 TTFT", lambda r: _lat(r, "ttft_ms")),
    "best_quality": ("highest overall accuracy",
                     lambda r: -a if (a := _overall_acc(r)) is not None else None),
}
