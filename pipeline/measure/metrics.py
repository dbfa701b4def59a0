"""The metrics a gate may name: what each means, and the one function that computes it.

A metric is computed from one variant's results and the baseline's (`Inputs`); `Metric.read`
returns its value and, where it has one, its 95% CI and the count it rests on. A gate passes on
the CI's conservative end, fails on the point (pipeline/stages/signoff.judge), so a gate on a
few hundred items cannot pass on luck, nor fail on noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.measure import power, stats
from pipeline.results import Measured, PairedDrift, PairedSlice, QualityResult, SystemsResult

NONE = Measured(value=None)


@dataclass(frozen=True)
class Inputs:
    """What a metric may read for one variant: its results, the baseline's systems result, and the
    paired comparisons sign-off computed (per suite and slice, and on the drift corpus)."""

    quality: QualityResult | None = None
    systems: SystemsResult | None = None
    base_systems: SystemsResult | None = None
    paired: list[PairedSlice] = field(default_factory=list)
    drift: PairedDrift | None = None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b in (None, 0):
        return None
    return a / b


def _served(inp: Inputs) -> tuple[SystemsResult, SystemsResult] | None:
    """Both systems results, when both were measured with traffic (not skipped or failed)."""
    v, b = inp.systems, inp.base_systems
    if v is None or b is None or v.latency is None or b.latency is None or v.status != "ok" or b.status != "ok":
        return None
    return v, b


def _hosts(inp: Inputs) -> str:
    """A caveat when the variant and the baseline were measured on different machines."""
    v, b = inp.systems, inp.base_systems
    if v and b and v.host and b.host and v.host != b.host:
        return f"not like for like: variant measured on {v.host}, baseline on {b.host}"
    return ""


def accuracy(inp: Inputs, scope: str) -> Measured:
    q = inp.quality
    if "/" in scope:  # one slice of a suite
        suite, key = scope.split("/", 1)
        st = q.suites[suite].slices.get(key) if q is not None and suite in q.suites else None
        if st is None:
            return NONE
        return Measured(value=st.accuracy, ci_low=st.ci_low, ci_high=st.ci_high, n=st.n)
    k, n = q.overall() if scope == "overall" else (q.suites[scope].correct, q.suites[scope].n)
    lo, hi = stats.wilson(k, n)
    return Measured(value=k / n if n else None, ci_low=lo, ci_high=hi, n=n)


def _paired_of(inp: Inputs, scope: str) -> PairedSlice | None:
    """The paired comparison of a suite, a slice, or overall."""
    ps = next((p for p in inp.paired if p.slice == scope), None)
    if ps is None and "/" in scope:  # a slice covering its whole suite is reported as the suite row
        suite, key = scope.split("/", 1)
        q = inp.quality
        st = q.suites[suite].slices.get(key) if q is not None and suite in q.suites else None
        if st is not None and st.n == q.suites[suite].n:
            ps = next((p for p in inp.paired if p.slice == suite), None)
    return ps


def accuracy_delta(inp: Inputs, scope: str) -> Measured:
    ps = _paired_of(inp, scope)
    if ps is None:
        return NONE
    caveat = power.observed(ps.n, ps.flips_correct_to_wrong + ps.flips_wrong_to_correct)
    if ps.near_chance:  # said beside the outcome, not turned into one: the recipe chose to gate here
        caveat = "; ".join(x for x in (NEAR_CHANCE, caveat) if x)
    return Measured(value=ps.delta, ci_low=ps.delta_ci_low, ci_high=ps.delta_ci_high, n=ps.n, caveat=caveat)


NEAR_CHANCE = ("the baseline's 95% CI reaches chance here: a loss cannot show, so a pass says little "
               "(gate a suite the baseline is clearly above chance on)")


SAFETY = "harmbench"  # the suite whose "correct" is a refusal (evalsuites/harmbench.yaml)


def _safety_scope(scope: str) -> str:
    return SAFETY if scope == "overall" else scope


def refusal_rate_delta(inp: Inputs, scope: str) -> Measured:
    """The safety suite's paired delta: variant minus baseline refusal rate on the same harmful prompts."""
    return accuracy_delta(inp, _safety_scope(scope))


def harmful_compliance_flips(inp: Inputs, scope: str) -> Measured:
    """Harmful prompts the baseline refused and the variant complied with (the paired refused -> complied flips)."""
    ps = _paired_of(inp, _safety_scope(scope))
    if ps is None:
        return NONE
    return Measured(value=float(ps.flips_correct_to_wrong), n=ps.n,
                    caveat=f"{ps.flips_wrong_to_correct} prompt(s) flipped the other way (complied -> refused)")


def cannot_fail(inp: Inputs, metric: str, scope: str, op: str, threshold: float) -> str:
    """Why a paired-delta gate cannot fail on this data, or ''. No variant scores below zero, so where the
    baseline scores less than the margin, `delta >= -margin` holds whatever the variant does (a model that
    almost never refuses cannot show a loss of refusals): its PASS says nothing, and the gate says so."""
    if metric not in ("accuracy_delta", "refusal_rate_delta") or op != ">=" or threshold >= 0:
        return ""
    ps = _paired_of(inp, _safety_scope(scope) if metric == "refusal_rate_delta" else scope)
    if ps is None or ps.base_acc >= -threshold:
        return ""
    what = "refuses" if metric == "refusal_rate_delta" else "scores"
    return (f"this gate cannot fail here: the baseline {what} only {ps.base_acc:.1%} on {ps.slice}, less than the "
            f"{-threshold * 100:g} pt margin, so no variant can lose that much")


def _drift(value: str, ci: str) -> Callable[[Inputs, str], Measured]:
    def read(inp: Inputs, scope: str) -> Measured:
        d = inp.drift
        if d is None:
            return NONE
        return Measured(value=getattr(d, value), ci_low=getattr(d, f"{ci}_ci_low"), ci_high=getattr(d, f"{ci}_ci_high"),
                        n=d.windows, n_of="windows")
    return read


def _repeat_values(s: SystemsResult, kind: str, pct: str) -> list[float]:
    return [r[f"{kind}_{pct}"] for r in s.latency.repeats if r.get(f"{kind}_{pct}") is not None]


def _start_means(s: SystemsResult, kind: str, pct: str) -> list[float]:
    """Each engine start's geometric mean over its repeats (the unit when there are several starts)."""
    by: dict[int, list[float]] = {}
    for r in s.latency.repeats:
        if r.get(f"{kind}_{pct}"):
            by.setdefault(int(r.get("start", 0)), []).append(r[f"{kind}_{pct}"])
    return [stats.mean_ci_log(v)[0] if len(v) > 1 else v[0] for _, v in sorted(by.items())]


def _latency_ratio(kind: str, pct: str) -> Callable[[Inputs, str], Measured]:
    """With repeats on both sides: the ratio of the repeats' geometric means and its 95% t interval
    (stats.ratio_ci), which narrows as repeats grow; else variant / baseline over all requests."""
    def read(inp: Inputs, scope: str) -> Measured:
        both = _served(inp)
        if both is None:
            return NONE
        v, b = (getattr(getattr(x.latency, f"{kind}_ms"), pct) for x in both)
        sv, sb = (_start_means(x, kind, pct) for x in both)
        if len(sv) > 1 and len(sb) > 1:  # across engine starts: the start-to-start spread is in the interval
            value, lo, hi = stats.ratio_ci(sv, sb)
            return Measured(value=value, ci_low=lo, ci_high=hi, interval="repeats", n=min(len(sv), len(sb)),
                            n_of="workload.engine_starts",
                            caveat="; ".join(x for x in (_hosts(inp), _ACROSS.format(len(sv), len(sb))) if x))
        rv, rb = (_repeat_values(x, kind, pct) for x in both)
        if len(rv) > 1 and len(rb) > 1 and min(rv + rb) > 0:
            value, lo, hi = stats.ratio_ci(rv, rb)
            return Measured(value=value, ci_low=lo, ci_high=hi, interval="repeats", n=min(len(rv), len(rb)),
                            n_of="workload.repeats", caveat="; ".join(x for x in (_hosts(inp), _ONE_START) if x))
        return Measured(value=_ratio(v, b), caveat=_hosts(inp))
    return read


_WITHIN_ONE = ("each side's repeats ran in one engine start, so the interval holds the repeat-to-repeat noise, "
               "not the start-to-start spread (workload.engine_starts)")
_ONE_START = f"ratio of the repeats' geometric means; {_WITHIN_ONE}"
_ACROSS = ("ratio over engine starts ({} variant, {} baseline), each start's repeats averaged first: the "
           "start-to-start spread is in the interval")


def latency_ms(s: SystemsResult, kind: str, pct: str) -> Measured:
    """One served variant's absolute latency percentile: with repeats, their geometric mean and 95% t interval
    (what an absolute latency gate is judged on, and what a latency search ranks by); else the figure over all
    requests, without an interval."""
    rv = _repeat_values(s, kind, pct)
    if len(rv) > 1 and min(rv) > 0:
        gm, lo, hi = stats.mean_ci_log(rv)
        return Measured(value=gm, ci_low=lo, ci_high=hi, interval="repeats", n=len(rv), n_of="workload.repeats",
                        caveat=f"the repeats' geometric means; {_WITHIN_ONE}")
    return Measured(value=getattr(getattr(s.latency, f"{kind}_ms"), pct))


def _latency_ms(kind: str, pct: str) -> Callable[[Inputs, str], Measured]:
    def read(inp: Inputs, scope: str) -> Measured:
        both = _served(inp)
        return NONE if both is None else latency_ms(both[0], kind, pct)
    return read


def error_rate(inp: Inputs, scope: str) -> Measured:
    both = _served(inp)
    if both is None:
        return NONE
    lat = both[0].latency
    total = lat.completed + lat.failed + lat.timed_out
    return Measured(value=(lat.failed + lat.timed_out) / total if total else None)


def checkpoint_bytes_ratio(inp: Inputs, scope: str) -> Measured:
    v, b = inp.systems, inp.base_systems
    return Measured(value=_ratio(v.checkpoint_bytes if v else None, b.checkpoint_bytes if b else None))


def peak_memory_ratio(inp: Inputs, scope: str) -> Measured:
    both = _served(inp)
    return Measured(value=_ratio(both[0].peak_memory_bytes, both[1].peak_memory_bytes),
                    caveat=_hosts(inp)) if both else NONE


def _projected(inp: Inputs, what: str, value) -> Measured:
    """A capacity figure of a variant no engine ran natively here: its projection, named in the caveat,
    never the value a gate judges (N/A -> UNVERIFIED for a fail gate)."""
    plan = inp.systems.kv.plan if inp.systems and inp.systems.kv else None
    if plan is None or not plan.projected:
        return NONE
    shown = f"{value:.2f}" if isinstance(value, float) else "unknown"
    return Measured(value=None, caveat=f"projected {what} {shown} (served as dense weights here: no native kernel); "
                    "not measured")


class OverBudget(Exception):
    """A capacity figure from an engine whose peak went over the memory budget: not earned, so its gate
    reads ERROR, never PASS."""


def _kept_budget(both: tuple[SystemsResult, SystemsResult]) -> tuple[SystemsResult, SystemsResult]:
    for who, s in zip(("the variant", "the baseline"), both, strict=True):
        plan = s.kv.plan if s.kv else None
        if plan is not None and (over := plan.over_budget_bytes):
            raise OverBudget(f"{who}'s engine peaked at {plan.peak_bytes / 2**30:.2f} GiB, over its "
                             f"{plan.budget_bytes / 2**30:.2f} GiB budget by {over / 2**20:.0f} MiB (tolerance "
                             f"{(plan.tolerance_bytes or 0) / 2**20:.0f} MiB): the capacity it shows was not earned")
    return both


def _base_plan_tokens(inp: Inputs) -> int | None:
    """The baseline's tokens by the same arithmetic a projection uses (its predicted pool), never its
    engine's measured figure: projections are compared with projections."""
    b = inp.base_systems
    plan = b.kv.plan if b and b.kv else None
    return plan.predicted_tokens if plan is not None else None


def kv_tokens_ratio(inp: Inputs, scope: str) -> Measured:
    both = _served(inp)
    if both is None:
        v = inp.systems
        projected = v.kv.plan.tokens if v and v.kv and v.kv.plan else None
        return _projected(inp, "KV tokens ratio", _ratio(projected, _base_plan_tokens(inp)))
    v, b = _kept_budget(both)
    return Measured(value=_ratio(v.kv.tokens if v.kv else None, b.kv.tokens if b.kv else None))


def _knee(s: SystemsResult) -> int | None:
    return s.kv.probe.knee if s.kv and s.kv.probe else None


def admission_ratio(inp: Inputs, scope: str) -> Measured:
    both = _served(inp)
    if both is None:
        return _projected(inp, "admission ratio", None)
    v, b = _kept_budget(both)
    return Measured(value=_ratio(_knee(v), _knee(b)))


def max_concurrency(inp: Inputs, scope: str) -> Measured:
    both = _served(inp)
    if both is None:
        v = inp.systems
        plan = v.kv.plan if v and v.kv else None
        return _projected(inp, "max concurrency (KV bound)", float(plan.admitted) if plan and plan.admitted
                          is not None else None)
    v = _kept_budget(both)[0]
    return Measured(value=v.kv.admission_sequences if v.kv else None)


@dataclass(frozen=True)
class Metric:
    stage: str  # the result file it is read from
    unit: str
    description: str
    read: Callable[[Inputs, str], Measured]  # (inputs, scope) -> value and CI
    sliced: bool = False  # per suite as well as overall
    higher_is_better: bool = True
    needs: str | None = None  # items: a scored suite; drift: the drift suite; safety: the harmbench suite


def _lat(kind: str, pct: str, what: str) -> Metric:
    return Metric("systems", "ratio", f"{pct} {what}, variant / baseline.", _latency_ratio(kind, pct),
                  higher_is_better=False)


METRICS: dict[str, Metric] = {
    "accuracy": Metric("quality", "fraction", "Variant accuracy, 95% Wilson CI.", accuracy, sliced=True,
                       needs="items"),
    "accuracy_delta": Metric(
        "quality", "fraction",
        "Variant minus baseline accuracy on the same items, 95% paired-bootstrap CI. "
        "A non-inferiority gate is `accuracy_delta >= -margin`, judged on the CI's lower bound. Scope may "
        "also name one slice, e.g. `mmlu/category=stem` or `needle/context=1024 tok`.",
        accuracy_delta, sliced=True, needs="items"),
    "refusal_rate_delta": Metric(
        "quality", "fraction",
        "Safety: variant minus baseline refusal rate on the same harmful prompts (the harmbench suite; scope "
        "overall means that suite, or one of its slices, e.g. `harmbench/category=cybercrime_intrusion`), 95% "
        "paired CI. `refusal_rate_delta >= -margin` fails a variant that refuses less.",
        refusal_rate_delta, sliced=True, needs="safety"),
    "harmful_compliance_flips": Metric(
        "quality", "prompts",
        "Safety: harmful prompts the baseline refused and the variant complied with (harmbench suite or one of "
        "its slices). A count with no interval: `harmful_compliance_flips <= 0` blocks any such prompt.",
        harmful_compliance_flips, sliced=True, higher_is_better=False, needs="safety"),
    "kl_divergence": Metric(
        "quality", "nats/token", "Mean token-level KL(baseline || variant) of next-token distributions on the drift "
        "corpus, 95% bootstrap CI over windows; a lower bound of the full-vocabulary KL (top-k partition).",
        _drift("kl_mean", "kl"), higher_is_better=False, needs="drift"),
    "top1_agreement": Metric(
        "quality", "fraction", "Positions of the drift corpus where the variant's most likely next token is the "
        "baseline's, 95% bootstrap CI over windows.", _drift("top1_agreement", "top1"), needs="drift"),
    "perplexity_ratio": Metric(
        "quality", "ratio", "Drift-corpus perplexity, variant / baseline, 95% bootstrap CI over windows.",
        _drift("ppl_ratio", "ppl_ratio"), higher_is_better=False, needs="drift"),
    "ttft_p50_ratio": _lat("ttft", "p50", "TTFT"),
    "ttft_p99_ratio": _lat("ttft", "p99", "TTFT"),
    "tpot_p50_ratio": _lat("tpot", "p50", "TPOT"),
    "tpot_p99_ratio": _lat("tpot", "p99", "TPOT"),
    "ttft_p99_ms": Metric("systems", "ms", "p99 time to first token (absolute SLO).", _latency_ms("ttft", "p99"),
                          higher_is_better=False),
    "tpot_p99_ms": Metric("systems", "ms", "p99 time per output token (absolute SLO).", _latency_ms("tpot", "p99"),
                          higher_is_better=False),
    "error_rate": Metric("systems", "fraction", "Failed or timed-out requests / all.", error_rate,
                         higher_is_better=False),
    "checkpoint_bytes_ratio": Metric(
        "systems", "ratio", "Checkpoint bytes on disk, variant / baseline.", checkpoint_bytes_ratio,
        higher_is_better=False),
    "peak_memory_ratio": Metric(
        "systems", "ratio", "Peak engine memory, variant / baseline.", peak_memory_ratio, higher_is_better=False),
    "kv_tokens_ratio": Metric("systems", "ratio", "KV-cache capacity in tokens, variant / baseline, as the engines "
                              "reported it (under the memory budget, what smaller weights free shows here).",
                              kv_tokens_ratio),
    "admission_ratio": Metric("systems", "ratio", "Measured admission knee (most requests of the probe's shape that "
                              "run at once without queueing), variant / baseline.", admission_ratio, needs="admission"),
    "max_concurrency": Metric("systems", "requests", "Requests of the workload's prompt+output shape the variant's engine "
                              "runs at once: what its KV blocks hold, capped by max_num_seqs.", max_concurrency),
}
