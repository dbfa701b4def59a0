"""Capacity under the memory budget: what each variant's weights leave for KV, and the trade-off line.

Reads each variant's systems.json: the pool plan (pipeline/measure/membudget.py, `kv.plan`), the engine's own
KV figures and the measured admission knee. A variant no engine ran natively here has a *projected*
plan only: its figures are marked projected wherever they appear and never enter a measured column.
"""

from __future__ import annotations

from html import escape

from pipeline.results import BudgetPlan, SystemsResult
from reports.html import fmt, mib, table
from reports.view import Run, Variant

PROJECTED = "<span class='projected' title='no native kernel here: arithmetic, not measured'>projected</span>"


def plan_of(v: Variant) -> BudgetPlan | None:
    s = v.systems
    return s.kv.plan if s and s.kv else None


def requests_that_fit(v: Variant) -> tuple[float | None, str]:
    """Concurrent requests of the workload's shape this variant holds, and how that was found: the
    measured knee where the admission probe ran, else the engine's KV blocks; projected plans last. An
    engine that peaked over its budget earned none of it: None, and the table says by how much."""
    s, plan = v.measured, plan_of(v)
    if over_budget(v):
        return None, "over budget"
    if s and s.kv and s.kv.probe:
        bound = "; max_num_seqs bound it, the pool holds more" if s.kv.probe.binding == "max_num_seqs" else ""
        return float(s.kv.probe.knee), f"knee, measured{bound}"
    if s and s.kv and s.kv.admission_kv_only is not None:
        return float(s.kv.admission_kv_only), "engine KV blocks"
    if plan and plan.projected and plan.admitted is not None:
        return float(plan.admitted), "projected"
    if s and s.kv and s.kv.admission_sequences is not None:  # a run from before the budget (fixed pool)
        return float(s.kv.admission_sequences), "engine KV blocks, ≤ max_num_seqs"
    return None, ""


def memory_as_loaded(v: Variant) -> tuple[float | None, bool]:
    """Weights the engine holds + its KV pool (bytes), and whether that is projected."""
    plan, s = plan_of(v), v.measured
    if plan is None and s and s.kv and s.weight_memory_bytes and s.kv.pool_bytes_config:
        return float(s.weight_memory_bytes + s.kv.pool_bytes_config), False  # a run from before the budget
    if plan is None or plan.loaded_bytes is None:
        return None, False
    weights = plan.engine_weights_bytes if plan.engine_weights_bytes is not None else plan.weights_bytes
    return float(weights + plan.pool_bytes), plan.projected


def baseline_fits(base: Variant | None, how: str) -> float | None:
    """What a variant's requests that fit are divided by: the baseline's, found the same way; a projection
    is compared with the baseline's own prediction (the same arithmetic), never with its measurement."""
    if base is None:
        return None
    if how == "projected":
        bp = plan_of(base)
        return float(bp.predicted_admitted) if bp and bp.predicted_admitted else None
    return requests_that_fit(base)[0]


def over_budget(v: Variant) -> int | None:
    """Bytes by which this variant's engine peaked over its budget beyond the tolerance (None: it kept it)."""
    plan = plan_of(v)
    return plan.over_budget_bytes if plan is not None and not plan.projected else None


def _budget_words(plan: BudgetPlan) -> str:
    if plan.mode == "budget":
        derived = plan.budget_source.startswith("derived")
        return f"budget {plan.budget_bytes / 2**30:.2f} GiB" + (f" ({escape(plan.budget_source)})" if derived else "")
    if plan.mode == "gpu":
        return escape(plan.budget_source)
    return f"a fixed {plan.pool_bytes / 2**30:.2f} GiB KV pool (weight savings do not show as capacity)"


def _delta(p) -> str:
    return f"{p.delta * 100:+.1f} pt [{p.delta_ci_low * 100:+.1f}, {p.delta_ci_high * 100:+.1f}]"


def tradeoff_line(run: Run, name: str, v: Variant) -> str:
    """'fits N× the baseline's concurrent requests of shape P/O tokens under budget B; quality Δ [CI]
    overall, worst slice S Δ [CI]', as far as it was measured."""
    base = run.variants.get("baseline")
    mine, how = requests_that_fit(v)
    theirs = baseline_fits(base, how)
    wl = (base.systems.workload if base and base.systems else {}) or {}
    plan = plan_of(v)
    over = [n for n, x in (("this variant", v), ("the baseline", base)) if x and over_budget(x)]
    if plan is None:
        fits = "capacity not measured"
    elif over:
        fits = (f"<b>capacity not earned</b>: {' and '.join(over)} peaked over the budget "
                f"(the capacity table says by how much)")
    elif mine is not None and theirs:
        shape = f"{wl.get('prompt_tokens')}/{wl.get('output_tokens')}"
        fits = (f"fits <b>{mine / theirs:.2f}×</b> the baseline's concurrent requests of shape {shape} tokens "
                f"({mine:.0f} vs {theirs:.0f}, {how}{'; the baseline predicted alike' if how == 'projected' else ''}) "
                f"under {_budget_words(plan) if plan else 'the same engine'}")
        if how == "projected":
            fits = f"{PROJECTED}: " + fits
        elif plan and plan.mode == "budget" and base and base.measured and base.measured.kv and v.measured and \
                v.measured.kv and v.measured.kv.tokens and base.measured.kv.tokens:
            freed = v.measured.kv.tokens - base.measured.kv.tokens
            fits += (f", {freed:+,} KV tokens against the baseline's (a difference of pools, the same at any "
                     "budget both fit: capacity across budgets is charted)")
    else:
        fits = "capacity not measured"
    paired = run.paired(name)
    quality = "quality not compared"
    if "overall" in paired:
        quality = f"quality Δ {_delta(paired['overall'])} overall"
        slices = [p for k, p in paired.items() if k != "overall"]
        if slices:
            worst = min(slices, key=lambda p: p.delta)
            quality += f", worst slice {escape(worst.slice)} Δ {_delta(worst)}"
    return f"<li><b>{escape(name)}</b>: {fits}; {quality}</li>"


def tradeoff_section(run: Run) -> str:
    lines = [tradeoff_line(run, name, v) for name, v in run.variants.items() if name != "baseline"]
    if not lines:
        return ""
    return ("<h2>The trade-off</h2><p class='small muted'>Capacity: concurrent requests of the workload's shape "
            "under the memory budget every engine shares (the measured admission knee where the recipe probes "
            "it, else what the engine's KV blocks hold). Quality: paired accuracy delta vs the baseline, 95% "
            "bootstrap CI.</p><ul>" + "".join(lines) + "</ul>")


def _row(name: str, v: Variant, base: Variant | None) -> list[str]:
    plan, s = plan_of(v), v.systems
    tag = f" {PROJECTED}" if plan.projected else ""
    engine_tokens = "–" if plan.projected else fmt(plan.engine_tokens)
    fits, how = requests_that_fit(v)
    theirs = baseline_fits(base, how)
    ratio = f"{fits / theirs:.2f}×" if fits is not None and theirs else "–"
    peak, over_by = plan.peak_bytes, over_budget(v)
    over = (f" <b>over budget by {mib(over_by)}: capacity not earned</b>" if over_by else "")
    if plan.mode == "budget":
        kept = f"{mib(plan.outside_bytes)} + {mib(plan.runtime_bytes)}" if plan.outside_bytes is not None \
            else mib(plan.reserve_bytes)  # a run from before engine sizing
        pool = mib(plan.pool_bytes) if plan.projected or plan.predicted_pool_bytes is None else \
            f"{mib(plan.predicted_pool_bytes)} / {mib(plan.pool_bytes)}"
    else:
        kept, pool = "–", mib(plan.pool_bytes)
    return [escape(name) + tag, escape(plan.mode), mib(plan.budget_bytes),
            f"{mib(plan.weights_bytes)} / {'–' if plan.projected else mib(plan.engine_weights_bytes)}",
            kept, pool, f"{fmt(plan.tokens)} / {engine_tokens}",
            fmt(plan.admitted), f"{fits:.0f} ({escape(how)})" if fits is not None else "–", ratio,
            (mib(peak) + over) if peak else "–", _checkpoint(s)]


def _checkpoint(s: SystemsResult | None) -> str:
    return mib(s.checkpoint_bytes) if s else "–"


def capacity_section(run: Run) -> str:
    base = run.variants.get("baseline")
    rows = [_row(name, v, base) for name, v in run.variants.items() if plan_of(v)]
    if not rows:
        return ""
    plan = next(plan_of(v) for v in run.variants.values() if plan_of(v))
    how = {"budget": ("each engine sized its own pool so that its process tree keeps within the budget: its worker "
                      "was asked for the budget less what its sizing does not count (outside: API server, helpers, "
                      "transients), and kept as KV cache what its weights and runtime left; predicted pool = budget − "
                      "outside − weights − runtime (" + escape(plan.overhead_source) + "), beside the pool the engine "
                      "chose. A peak over the budget by more than "
                      + mib(plan.tolerance_bytes or 0) + " marks that variant's capacity as not earned")
                     if plan.outside_bytes is not None else
                     "pool = budget − weights as loaded − runtime reserve (" + escape(plan.reserve_source) + ")",
           "gpu": "vLLM sized each pool from its own memory profiling within gpu_memory_utilization",
           "fixed": "every engine got the same fixed KV pool (engine.kv_cache_gib): weight savings do not show "
                    "as capacity here"}[plan.mode]
    return ("<h2>Capacity under one memory budget</h2><p class='small muted'>" + how + ". Weights: predicted "
            "from the checkpoint's safetensors headers (engine dtype for floating-point tensors, quantized "
            "tensors as stored) / as the engine reported loading them. KV tokens: the arithmetic on the pool "
            "(cut as vLLM cuts it) / the engine's own figure. Requests at the workload's shape: by the "
            "arithmetic / as found (the measured knee, or the engine's blocks). Peak: the engine tree's "
            "kernel high-water mark, beside the budget. A <i>projected</i> row had no native kernel here: its "
            "quality was measured on dequantized weights, its capacity is the arithmetic on the weights its "
            "checkpoint would load as, and nothing in it was measured.</p>"
            + table(["variant", "pool", "budget", "weights predicted / engine", "outside + runtime",
                     "KV pool predicted / engine",
                     "KV tokens arithmetic / engine", "requests @shape (arithmetic)", "requests @shape (found)",
                     "× baseline", "peak", "checkpoint"], rows))
