"""`quantize-eval search RECIPE`: the cheapest mixed-precision variant whose gates still pass.

    baseline + the recipe's variants   evaluated as in a run; the variants are references on the frontier
    sensitivity                        per decoder block and input-sharing Linear kinds, no engine
                                       (stages/sensitivity.py)
    ladder                             candidate k keeps the modules of the k parts (blocks, or groups of
                                       Linear kinds) most sensitive per weight at the fallback precision,
                                       the rest at the base 4-bit scheme; k = 0 first (the
                                       uniform scheme), then a first guess from the sensitivity curve,
                                       then bisection between the largest failing and smallest passing k
    each candidate                     a real llm-compressor checkpoint (pipeline/search/mixed.py), quantized,
                                       evaluated as a `scheme: custom` variant (its checkpoint and results
                                       cached: widening the search reuses them), judged on the search half of
                                       the quality data with a replication margin (pipeline/search/sealed.py)
    KV twins                           search.kv_cache: each passing candidate served again with an FP8 KV cache
    anchors                            search.anchors: another tool's layer choice at the pick's bits, built and
                                       judged alike, compared and never the answer (pipeline/search/anchors.py)
    answer                             confirmed on the sealed half, which nothing above read (sealed.confirm);
                                       RUN/search/search.json, the report's search section, and
                                       RUN/search/chosen-recipe.yaml reproducing the answer as a variant

Every figure on the frontier is measured on a built candidate; the sensitivity curve only chooses
which k to build next. Exit 0 when a candidate (or reference) is confirmed on the sealed half, 1 when none is.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import yaml

from pipeline.engines.workers.sensitivity_parts import kept_modules
from pipeline.measure.split import Split
from pipeline.progress import say
from pipeline.recipe.schema import Recipe
from pipeline.run import runner
from pipeline.runstore import run_lock, write_json
from pipeline.search import anchors, mixed, points, sealed
from pipeline.setup import envs
from pipeline.stages import sensitivity
from pipeline.store import keys, outcome
from pipeline.store.outcome import Spent

TOP1_MARGIN = 0.01  # the first guess aims this far above a top-1 gate (judged on its CI's lower bound)
SAFETY = 0.005  # a curve's guess aims this far above the point whose CI's lower bound would clear the gate


def candidate_name(fallback: str, k: int) -> str:
    return "search-uniform" if k == 0 else f"search-{fallback}-k{k:02d}"


def first_guess(ranked: list[dict], uniform_top1: float | None, top1_floor: float | None) -> int:
    """The first k (>= 1) to build after the uniform scheme, read off the sensitivity curve. With a top-1
    gate and the uniform candidate's measured top-1: the smallest k at which the uniform disagreement,
    shrunk in proportion to the per-block disagreement the kept blocks account for, clears the gate.
    Otherwise the smallest k whose blocks hold half the summed KL."""
    n = len(ranked)
    d = [1.0 - r["top1_agreement"] for r in ranked]
    if uniform_top1 is not None and top1_floor is not None and sum(d) > 0:
        for k in range(1, n + 1):
            if 1.0 - (1.0 - uniform_top1) * sum(d[k:]) / sum(d) >= top1_floor + TOP1_MARGIN:
                return k
        return n
    kl = [r["kl_mean"] for r in ranked]
    acc = 0.0
    for k, x in enumerate(kl, 1):
        acc += x
        if acc >= sum(kl) / 2:
            return k
    return n


def _at(points: list[tuple[int, float]], k: float) -> float:
    """Linear interpolation of (k, value) points, sorted by k; flat beyond the ends."""
    if k <= points[0][0]:
        return points[0][1]
    for (k0, v0), (k1, v1) in zip(points, points[1:], strict=False):  # consecutive pairs
        if k <= k1:
            return v0 + (v1 - v0) * (k - k0) / max(1, k1 - k0)
    return points[-1][1]


def _curve_points(sens: dict) -> list[tuple[int, float]] | None:
    """The sensitivity worker's emulated top-1 by k kept, from the all-quantized model (k = 0) on; None
    when the sensitivity has no curve."""
    if not sens.get("curve") or "uniform" not in sens:
        return None
    return [(0, sens["uniform"]["top1_agreement"])] + [(c["k"], c["top1_agreement"]) for c in sens["curve"]]


def _ci_margin(row: dict) -> float:
    """How far a built candidate's top-1 must sit above the floor to pass a search look: its CI's lower
    margin, widened to the replication margin (sealed.WIDEN); TOP1_MARGIN without a CI."""
    ci = row.get("top1_ci") or [None]
    return (row["top1_agreement"] - ci[0]) * sealed.WIDEN if ci[0] is not None else TOP1_MARGIN


def curve_guess(sens: dict, measured: dict[int, dict], top1_floor: float, n: int) -> int | None:
    """The next k read off the sensitivity worker's emulated curve (top-1 of the all-quantized model with
    the first k parts kept), calibrated on the largest k measured so far (all failing): the curve shifted
    by that candidate's measured - emulated top-1, aimed so that a CI as wide as that candidate's clears
    the floor. None when the curve never gets there (or there is none)."""
    points = _curve_points(sens)
    if points is None or not measured:
        return None
    ref = max(measured)
    row = measured[ref]
    if row.get("top1_agreement") is None:
        return None
    target = top1_floor + max(_ci_margin(row), 0.0) + SAFETY - (row["top1_agreement"] - _at(points, ref))
    for k in range(ref + 1, min(n, points[-1][0]) + 1):
        if _at(points, k) >= target:
            return k
    return None


def bracket(tried: dict[int, bool]) -> tuple[int, int] | None:
    """(largest failing k below the smallest passing k, that passing k), once something passes."""
    passing = [k for k, ok in tried.items() if ok]
    if not passing:
        return None
    hi = min(passing)
    return max((k for k, ok in tried.items() if not ok and k < hi), default=-1), hi


def next_k(tried: dict[int, bool], n: int, guess: int, inside: int | None = None) -> int | None:
    """The next k to build, or None when settled. tried: k -> passed. Uniform first; while nothing
    passes, the guess, then doubling up to n (every part kept); once something passes, `inside` (the
    curve's guess between the largest failing k below it and the smallest passing k) when it lies
    strictly between them, else bisection. Either way the bracket shrinks: the boundary is exact."""
    if 0 not in tried:
        return 0
    b = bracket(tried)
    if b is None:
        lo = max(tried)
        if lo >= n:
            return None
        return guess if guess > lo else min(n, max(lo + 1, 2 * lo))
    lo, hi = b
    if hi - lo <= 1:
        return None
    return inside if inside is not None and lo < inside < hi else (lo + hi) // 2


def bracket_guess(sens: dict, measured: dict[int, dict], top1_floor: float, lo: int, hi: int) -> int | None:
    """Between a failing lo and a passing hi, both built: the smallest k whose top-1 lower bound the curve
    predicts to clear the floor, the curve shifted by the measured - emulated top-1 and the CI's half-width
    both interpolated between lo and hi; hi - 1 when the curve puts the boundary at hi (one build then
    settles it). None without a curve or a measured top-1 at both ends."""
    a, b, points = measured.get(lo), measured.get(hi), _curve_points(sens)
    if points is None or a is None or b is None:
        return None
    if a.get("top1_agreement") is None or b.get("top1_agreement") is None:
        return None
    off_a, off_b = a["top1_agreement"] - _at(points, lo), b["top1_agreement"] - _at(points, hi)
    mar_a, mar_b = _ci_margin(a), _ci_margin(b)
    for k in range(lo + 1, hi):
        t = (k - lo) / (hi - lo)
        if _at(points, k) + off_a + t * (off_b - off_a) - (mar_a + t * (mar_b - mar_a)) >= top1_floor:
            return k
    return hi - 1


def _gate_floor(recipe: Recipe, metric: str) -> float | None:
    floors = [g.threshold for g in recipe.gates if g.metric == metric and g.op == ">=" and g.severity == "fail"]
    return max(floors) if floors else None


def ladder_length(ranked: list[dict], modules: list[str], fallback: str) -> int:
    """The largest k worth building: parts past the one that keeps every module add nothing, and keeping
    every module unquantized is the baseline itself."""
    for k in range(1, len(ranked) + 1):
        if len(kept_modules(ranked, k)) == len(modules):
            return k - 1 if fallback == "unquantized" else k
    return len(ranked)


def _candidate(ctx, manifest: dict, ranked: list[dict], modules: list[str], fallback: str, k: int) -> dict:
    sp = ctx.recipe.search
    name = candidate_name(fallback, k)
    kept = kept_modules(ranked, k)
    keep = set(kept)
    quantized = [m for m in modules if m not in keep]
    llmc = mixed.candidate_recipe(sp.base_scheme, sp.group_size, fallback, quantized, kept, ["lm_head"])
    v = points.custom_variant(ctx, name, llmc)
    say(name, f"search: k = {k}" + (f", keeping {mixed.describe_parts([r['part'] for r in ranked[:k]])} at {fallback}" if k else
                                    f", every decoder Linear at {sp.base_scheme} g{sp.group_size or 'channel'}"))
    ckpt = envs.home() / "checkpoints" / keys.quantize_key(ctx.recipe, v, ctx.model_id)[:24]
    built_before = (ckpt / "qe-checkpoint.json").exists()
    runner.run_stage(ctx, name)
    verdict = points.judge(ctx, manifest, v, Split("search", sp.split_seed))
    row = points.row_of(ctx, name, verdict, "candidate", fallback, k, [r["part"] for r in ranked[:k]])
    row["built_now"] = not built_before and (ckpt / "qe-checkpoint.json").exists()
    short = row["verdict"] in sealed.PASSING and not row["search_pass"]
    say(name, f"search: {row['verdict']} on search data" + (", short of the replication margin" if short else "")
        + (f" ({row['reason']})" if row["reason"] else "")
        + (f"; weights {row['native_weight_bytes'] / 2**20:.1f} MiB native" if row["native_weight_bytes"] else ""))
    return row


def choose(rows: list[dict], objective: str) -> dict | None:
    """What the search data alone would answer: among the candidates and references that pass a search look,
    the cheapest by the objective (sealed.cost: the least memory, or the most KV tokens)."""
    ok = [r for r in rows if sealed.can_answer(r, objective)]
    return min(ok, key=lambda r: (sealed.cost(r, objective), r["name"]), default=None)


def ladder(sp, ranked: list[dict], top1_floor: float | None, build, length=None, sens: dict | None = None
           ) -> list[dict]:
    """The candidates built, in order: build(fallback, k) -> its row (with "verdict" and
    "top1_agreement"); length(fallback) -> the largest k (default: every part); sens, the sensitivity
    result, whose emulated curve (if any) guesses k while nothing passes. Each fallback in turn, until one
    has a passing k or the cap is reached."""
    rows: list[dict] = []
    uniform = None
    for fallback in sp.fallbacks:
        n = length(fallback) if length else len(ranked)
        tried: dict[int, bool] = {} if uniform is None else {0: sealed.passes_search(uniform)}
        measured: dict[int, dict] = {} if uniform is None else {0: uniform}
        while len(rows) < sp.max_builds:
            guess = first_guess(ranked[:n], uniform["top1_agreement"] if uniform else None, top1_floor)
            inside = None
            if top1_floor is not None and (b := bracket(tried)) is None:
                guess = curve_guess(sens or {}, measured, top1_floor, n) or guess
            elif top1_floor is not None:
                inside = bracket_guess(sens or {}, measured, top1_floor, *b)
            k = next_k(tried, n, guess, inside)
            if k is None:
                break
            row = build(fallback, k)
            rows.append(row)
            if row["verdict"] == "FAILED-TO-RUN":  # says nothing of quality: stop rather than spend the cap
                return rows
            tried[k], measured[k] = sealed.passes_search(row), row
            uniform = row if k == 0 else uniform
            if sp.objective == "latency" and row.get("tpot_p95_ms") is None:  # served as dense weights here: no
                return rows  # candidate's latency can be measured, so no build can answer (unmeasured() says so)
        if any(tried.values()) or len(rows) >= sp.max_builds:
            break
    return rows


def search(recipe: Recipe, recipe_path: Path, fresh: bool = False) -> int:
    with run_lock(Path(recipe.runs_dir), recipe.name, envs.home() / "locks"):
        return _search(recipe, recipe_path, fresh)


def _search(recipe: Recipe, recipe_path: Path, fresh: bool) -> int:
    ctx, manifest, t_run, t_epoch = runner.prepared_start(recipe, recipe_path, fresh)
    runner.plan(ctx, recipe_path)
    seed = recipe.search.split_seed if recipe.search else 0
    seal = Split("sealed", seed)  # the run's own sign-off: on the data the search never read
    timings = runner.run_local(ctx)  # the baseline and the reference variants
    if outcome.read(ctx.run_dir.variant("baseline")).error:
        runner.conclude(ctx, manifest, timings, t_run, t_epoch, split=seal)
        return 1
    try:
        sens, ranked, rows = _measure_and_climb(ctx, manifest, recipe, timings)
    except Exception as exc:  # noqa: BLE001 - the baseline and references are measured: sign them off, say why
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"[:300]
        write_json(ctx.run_dir.root / "search" / "search.json", {"error": error, "answer": None})
        runner.conclude(ctx, manifest, timings, t_run, t_epoch, extra={"search": {"error": error}}, split=seal,
                        headline=f"SEARCH: NO ANSWER (the search failed: {error}); the measured variants' verdicts follow")
        return 1
    manifest["recipe"] = ctx.recipe.model_dump(mode="json")  # the candidates are the run's variants now
    try:
        look = Split("search", seed)
        refs = [points.row_of(ctx, v.name, points.judge(ctx, manifest, v, look), "reference") for v in recipe.variants]
        twins = points.kv_twins(ctx, manifest, rows, recipe.search.kv_cache, look)
        pts = rows + twins + refs
        picked = choose(pts, recipe.search.objective)  # what the search data alone would answer
        versus, anchor_runs = _anchors(ctx, manifest, ranked, sensitivity.linear_modules(sens), picked, look)
        pts += versus  # compared on the sealed half and the frontier, never the answer (sealed.can_answer)
        specs = {v.name: v for v in ctx.recipe.variants}
        for r in pts:  # every measured point, on the data no step above read
            r["sealed"] = sealed.sealed_fields(points.judge(ctx, manifest, specs[r["name"]], seal))
            r["gap"] = sealed.gap(r)
        answer, order, stopped = sealed.confirm(pts, recipe.search.objective)
        front = sealed.frontier(pts)
        summary = _answer(ctx, recipe, recipe_path, ranked, sens, rows, refs, answer)
        summary.update(search_answer=picked["name"] if picked else None, confirmation_rule=sealed.RULE,
                       margin_rule=sealed.MARGIN_RULE,
                       confirmation_order=order, stopped_at=stopped, frontier=front, split_seed=seed,
                       winners_curse=picked["gap"] if picked else None,
                       kv_space=points.kv_space(rows + twins, recipe.search), anchor_runs=anchor_runs)
        write_json(ctx.run_dir.root / "search" / "search.json",
                   {**summary, "rows": rows + twins, "references": refs, "anchors": versus, "sensitivity": sens["rows"]})
        summary["unmeasured"] = unmeasured(rows, recipe.search)
        headline = summary["unmeasured"] or _headline(answer, picked, stopped, len(rows))
    except Exception as exc:  # noqa: BLE001 - every candidate is measured and stored: still sign them off
        answer, summary = None, {"error": f"{type(exc).__name__}: {exc}"[:300]}
        write_json(ctx.run_dir.root / "search" / "search.json", {**summary, "answer": None})  # the page's banner
        headline = f"SEARCH: NO ANSWER (the summary failed: {summary['error']}); each candidate's verdict follows"
    runner.conclude(ctx, manifest, timings, t_run, t_epoch, extra={"search": summary}, headline=headline, split=seal)
    return 0 if answer else 1


def _anchors(ctx, manifest: dict, ranked, modules, picked, look) -> tuple[list[dict], list[dict]]:
    """The anchors' rows and runs; an anchor that fails says why and leaves the search's own answer standing."""
    try:
        return anchors.anchor_points(ctx, manifest, ranked, modules, picked, look)
    except Exception as exc:  # noqa: BLE001 - the candidates are measured: the comparison is extra
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"[:300]
        say("search", f"anchors: not compared ({error})")
        return [], [{"tool": t, "label": anchors.LABEL[t], "error": error} for t in ctx.recipe.search.anchors]


def unmeasured(rows: list[dict], sp) -> str | None:
    """The headline where the objective's own figure could not be measured for any candidate, so no answer could
    be given however the quality came out: latency, where the candidates were served as dense weights."""
    if sp.objective != "latency" or not rows or any(r.get("tpot_p95_ms") is not None for r in rows):
        return None
    return (f"SEARCH: UNVERIFIED — objective latency needs p95 TPOT, and none of the {len(rows)} candidate(s) could "
            "be timed here: the engine served them as dense weights (no native kernel for the base scheme on this "
            "host), so the search stopped; run it where the kernel is native")


def _headline(answer: dict | None, picked: dict | None, stopped: str | None, built: int) -> str:
    if answer:
        return (f"SEARCH: FOUND {answer['name']} (sealed {answer['sealed']['verdict']}), "
                f"{answer['native_weight_bytes'] / 2**20:.1f} MiB of weights as loaded natively"
                + (f"; {sealed.unconfirmed(picked, stopped)}" if picked and picked["name"] != answer["name"] else ""))
    if picked:
        return (f"SEARCH: NOT CONFIRMED: {stopped} passed on search data and not on sealed data "
                f"(the first of the confirmation sequence); nothing is signed off")
    return f"SEARCH: NONE PASSED in {built} candidate(s)"


def _measure_and_climb(ctx, manifest: dict, recipe: Recipe, timings: dict) -> tuple[dict, list[dict], list[dict]]:
    """Layer sensitivity, then the ladder of candidates it ranks."""
    t0, spent = time.time(), Spent()
    try:
        sens = sensitivity.measure(ctx, spent)
    finally:
        outcome.record(ctx.run_dir.root, "search", "sensitivity", t0, spent)
    ranked = sensitivity.ranked_parts(sens, recipe.search.units)
    modules = sensitivity.linear_modules(sens)
    t_ladder = time.perf_counter()
    try:
        rows = ladder(recipe.search, ranked, _gate_floor(recipe, "top1_agreement"),
                      lambda fallback, k: _candidate(ctx, manifest, ranked, modules, fallback, k),
                      lambda fallback: ladder_length(ranked, modules, fallback), sens)
    finally:
        timings["search ladder"] = time.perf_counter() - t_ladder
    return sens, ranked, rows


def _answer(ctx, recipe: Recipe, recipe_path: Path, ranked, sens, rows, refs, answer) -> dict:
    """The summary for search.json, and the recipe that reproduces the answer as an ordinary variant."""
    out = ctx.run_dir.root / "search"
    reproduce = None
    if answer and answer["kind"] == "candidate":
        llmc = out / f"{answer.get('parent') or answer['name']}.llmc.yaml"  # a KV twin: its sibling's checkpoint
        data = yaml.safe_load(Path(recipe_path).read_text())
        data.pop("search", None)
        data["name"] = f"{recipe.name}-chosen"
        data["variants"] = [{"name": answer["name"].removeprefix("search-"), "scheme": "custom",
                             "recipe": str(llmc.resolve()),
                             **({"kv_cache": answer["kv_cache"]} if answer.get("kv_cache", "auto") != "auto" else {})}]
        reproduce = out / "chosen-recipe.yaml"
        reproduce.write_text(f"# {answer['name']}, found by `quantize-eval search {recipe_path}`: keeps "
                             f"{mixed.describe_parts(answer['kept'])} at {answer['fallback']}\n"
                             + yaml.safe_dump(data, sort_keys=False))
    sp = recipe.search
    summary = {
        "base_scheme": sp.base_scheme, "group_size": sp.group_size, "fallbacks": list(sp.fallbacks), "units": sp.units,
        "objective": sp.objective, "max_builds": sp.max_builds, "candidates": len(rows),
        "built_now": sum(r["built_now"] for r in rows), "answer": answer["name"] if answer else None,
        "reproduce_recipe": str(reproduce) if reproduce else None,
        "sensitivity_grid": sens.get("grid"), "sensitivity_tokens": sens.get("tokens"),
        "sensitivity_method": sens.get("method", "rtn"), "sensitivity_uniform": sens.get("uniform"),
        "sensitivity_curve": sens.get("curve"),
        "ranking": [r["part"] for r in ranked],
    }
    if answer:
        say("search", f"answer, confirmed on sealed data: {answer['name']}: "
                      f"{answer['native_weight_bytes'] / 2**20:.1f} MiB weights (native), kept "
                      f"{mixed.describe_parts(answer['kept'])}; {len(rows)} candidate(s), "
                      f"{summary['built_now']} built now" + (f"; reproduce: {reproduce}" if reproduce else ""))
    else:
        say("search", f"no candidate was confirmed on sealed data ({len(rows)} candidate(s), max_builds "
                      f"{sp.max_builds})")
    return summary
