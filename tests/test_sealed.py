"""The search's halves (pipeline/measure/split.py), its sealed confirmation rule and frontier
(pipeline/search/sealed.py), and a simulation of the rule against choosing and judging on the same data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.measure.split import Split
from pipeline.search import sealed
from pipeline.search.ladder import choose
from pipeline.stages import signoff
from tests import minirun


def drift_rows(docs: list[str], code: int = 0) -> list[dict]:
    rows = [{"window": i, "domain": "essays", "doc": d} for i, d in enumerate(docs)]
    return rows + [{"window": len(docs) + j, "domain": "code", "doc": f"code/HumanEval/{j}"} for j in range(code)]


def test_item_halves_are_disjoint_cover_everything_and_depend_only_on_the_seed():
    ids = list(range(1000))
    a, b = Split("search", 3).items("piqa", ids), Split("sealed", 3).items("piqa", ids)
    assert not set(a) & set(b) and sorted(a + b) == ids and 450 < len(a) < 550
    assert Split("search", 3).items("piqa", ids[::-1]) == a  # the order the ids came in does not matter
    assert Split("search", 4).items("piqa", ids) != a  # another seed, another half
    assert Split("search", 3).items("siqa", ids) != a  # each suite cut on its own
    # an item's side never moves with the other items a variant shares: a sealed item stays sealed
    fewer = [i for i in ids if i != 37]
    assert set(Split("search", 3).items("piqa", fewer)) == set(a) - {37}


def test_prose_is_split_by_whole_essays_balanced_and_code_is_sealed_only():
    docs = ["essays/a"] * 5 + ["essays/b"] * 4 + ["essays/c"] * 6 + ["essays/d"] * 5 + ["essays/e"] * 4
    rows = drift_rows(docs, code=6)
    look, seal = Split("search", 1), Split("sealed", 1)
    a, b = look.prose(rows), seal.prose(rows)
    assert {r["doc"] for r in a}.isdisjoint({r["doc"] for r in b})  # other documents, not other windows
    assert len(a) + len(b) == 24 and abs(len(a) - len(b)) <= 6  # the largest essay bounds the imbalance
    assert look.code(rows) == [] and [r["domain"] for r in seal.code(rows)] == ["code"] * 6
    seeds = {frozenset(Split("sealed", s).essays(rows)) for s in range(10)}
    assert len(seeds) > 2  # the seed moves the split


def test_signoff_on_a_half_judges_only_its_items(tmp_path):
    r = minirun.recipe(gates=[{"metric": "accuracy_delta", "op": ">=", "threshold": -0.05}])
    root = minirun.make_run(tmp_path / "run", r, {"piqa": [1] * 100}, {"piqa": [1] * 50 + [0] * 50})
    results = {n: json.loads((root / n / "quality.json").read_text()) for n in ("baseline", "v4")}
    from pipeline.results import QualityResult
    b, v = (QualityResult.model_validate(results[n]) for n in ("baseline", "v4"))
    n = {}
    for side in ("search", "sealed"):
        sl = signoff.paired_slices(root / "baseline", b, root / "v4", v, 200, 0, Split(side, 0))
        n[side] = next(x for x in sl if x.slice == "piqa").n
    full = next(x for x in signoff.paired_slices(root / "baseline", b, root / "v4", v, 200, 0) if x.slice == "piqa")
    assert n == {side: len(Split(side, 0).items("piqa", list(range(100)))) for side in n} and full.n == 100
    assert n["search"] + n["sealed"] == 100 and min(n.values()) > 30


def row(name: str, weights: int, search: str, sealed_verdict: str, **kw) -> dict:
    return {"name": name, "kind": "candidate", "verdict": search, "native_weight_bytes": weights,
            "kv_tokens": kw.pop("kv", None), "sealed": {"verdict": sealed_verdict, **kw.pop("sealed", {})}, **kw}


def test_confirmation_goes_from_the_most_costly_and_stops_at_the_first_sealed_failure():
    rows = [row("k0", 100, "FAIL", "FAIL"), row("k2", 110, "PASS", "PASS"), row("k4", 120, "PASS", "PASS"),
            row("k1", 105, "PASS", "FAIL"), row("ref", 200, "PASS", "PASS")]
    answer, order, stopped = sealed.confirm(rows, "memory")
    assert order == ["ref", "k4", "k2", "k1"] and answer["name"] == "k2" and stopped == "k1"
    assert [r["name"] for r in rows if r["confirmed"]] == ["k2", "k4", "ref"]
    # a cheaper candidate past the stop that passes sealed is not confirmed: the sequence ended
    rows = [row("k1", 105, "PASS", "PASS"), row("k2", 110, "PASS", "FAIL"), row("ref", 200, "PASS", "PASS")]
    answer, _, stopped = sealed.confirm(rows, "memory")
    assert answer["name"] == "ref" and stopped == "k2"
    # nothing confirmed when the most costly already fails on sealed data
    answer, _, stopped = sealed.confirm([row("k1", 105, "PASS", "INCONCLUSIVE")], "memory")
    assert answer is None and stopped == "k1"
    # capacity: most KV tokens is the cheapest
    rows = [row("a", 100, "PASS", "PASS", kv=9000), row("b", 120, "PASS", "PASS", kv=5000)]
    assert sealed.confirm(rows, "capacity")[0]["name"] == "a"


def test_frontier_marks_what_nothing_beats_on_the_axes_measured_for_all():
    rows = [row("a", 100, "PASS", "PASS", tpot_p95_ms=None, sealed={"top1_agreement": 0.80}),
            row("b", 120, "PASS", "PASS", tpot_p95_ms=None, sealed={"top1_agreement": 0.90}),
            row("c", 130, "PASS", "PASS", tpot_p95_ms=None, sealed={"top1_agreement": 0.85}),
            row("d", 100, "PASS", "PASS", tpot_p95_ms=None, sealed={"top1_agreement": 0.80})]
    f = sealed.frontier(rows)
    assert [r["name"] for r in rows if r["pareto"]] == ["a", "b", "d"]  # c: b has less weight and more top-1
    assert f["axes"] == ["weights as loaded natively", "sealed top-1 agreement"]
    assert "p95 TPOT" in f["not_measured_for_every_point"]


def test_no_shippable_point_means_no_frontier_not_unmeasured_axes():
    rows = [row("a", 100, "FAIL", "FAIL", sealed={"top1_agreement": 0.80}),
            row("b", 120, "INCONCLUSIVE", "INCONCLUSIVE", sealed={"top1_agreement": 0.86})]
    f = sealed.frontier(rows)
    assert not any(r["pareto"] for r in rows) and f["axes"] == [] and f["not_measured_for_every_point"] == []
    assert "no candidate or reference passed its sealed half" in f["note"]


def test_gap_is_search_minus_sealed():
    r = row("a", 1, "PASS", "PASS", top1_agreement=0.86, accuracy_delta=None,
            sealed={"top1_agreement": 0.84, "accuracy_delta": -0.01})
    assert sealed.gap(r) == pytest.approx({"top1_agreement": 0.02})


# --- the rule, simulated -----------------------------------------------------------------------------------

FLOOR = 0.85
# nested candidates, cheapest first, top-1 rising through the floor: the case, several candidates a hair
# either side of it (k = 54 and 55 a fourth decimal apart)
THETA = np.linspace(0.80, 0.88, 41)


def gate_row(j: int, est: float, se: float) -> dict:
    """A candidate as the ladder sees it: its top-1 gate judged as judge() does (95% interval)."""
    lo, hi = est - sealed.Z95 * se, est + sealed.Z95 * se
    verdict = "PASS" if lo >= FLOOR else "FAIL" if est < FLOOR else "INCONCLUSIVE"
    return {"name": f"k{j:02d}", "kind": "candidate", "kv_tokens": None, "native_weight_bytes": 100 + j,
            "verdict": verdict, "gates": [{"gate": "top1_agreement[overall]", "value": est, "ci_low": lo,
                                           "ci_high": hi, "op": ">=", "threshold": FLOOR, "severity": "fail"}]}


def simulate(n_windows: int, sims: int, seed: int = 0) -> dict:
    """Search and sealed halves of n_windows each; an estimate's SE scales as 1/sqrt(windows) (0.0027 at 24,
    the figure the issue measured), nested candidates correlated 0.95 within a half (a shared component)."""
    rng = np.random.default_rng(seed)
    se = 0.0027 * np.sqrt(24 / n_windows)
    k, rho = len(THETA), 0.95

    def half() -> np.ndarray:
        return THETA + se * (np.sqrt(rho) * rng.standard_normal((sims, 1))
                             + np.sqrt(1 - rho) * rng.standard_normal((sims, k)))

    look, seal = half(), half()
    out = {"nominal_replicates": 0, "nominal": 0, "replicates": 0, "picked": 0, "false": 0, "answered": 0}
    for i in range(sims):
        rows = [gate_row(j, look[i, j], se) for j in range(k)]
        for j, r in enumerate(rows):
            r["sealed"] = {"verdict": gate_row(j, seal[i, j], se)["verdict"]}
        nominal = min((r for r in rows if r["verdict"] == "PASS"), key=lambda r: r["native_weight_bytes"], default=None)
        if nominal is not None:  # today's look: the gates' own 95% intervals on the search data
            out["nominal"] += 1
            out["nominal_replicates"] += nominal["sealed"]["verdict"] == "PASS"
        picked = choose(rows, "memory")  # the look with the replication margin
        if picked is not None:
            out["picked"] += 1
            out["replicates"] += picked["sealed"]["verdict"] == "PASS"
        answer, _, _ = sealed.confirm(rows, "memory")
        if answer is not None:
            out["answered"] += 1
            out["false"] += THETA[int(answer["name"][1:])] < FLOOR
    return {"nominal_replication": out["nominal_replicates"] / max(1, out["nominal"]),
            "replication": out["replicates"] / max(1, out["picked"]),
            "false": out["false"] / sims, "answered": out["answered"] / sims}


def test_simulated_search_picks_an_answer_that_replicates_where_the_nominal_look_does_not():
    r = simulate(12, 3000)  # the default search recipe's halves: 12 essay windows each
    assert r["nominal_replication"] <= 0.7, r  # the finding: a coin flip, near enough
    assert r["replication"] >= 0.88, r  # the margin: about 9 in 10 picks pass their sealed half
    assert r["false"] <= 0.035, r  # and a confirmed answer is below the floor at most the gates' level


@pytest.mark.parametrize("n", [12, 48, 192])
def test_simulated_rule_keeps_its_level_and_replication_at_every_size(n):
    r = simulate(n, 2000, seed=n)
    assert r["false"] <= 0.035 and r["replication"] >= 0.88, r


def test_simulated_rule_decides_more_as_data_grows():
    answered = [simulate(n, 1500, seed=1)["answered"] for n in (6, 12, 48, 192)]
    assert answered == sorted(answered) and answered[-1] >= 0.95, answered


def test_drift_windows_spread_over_documents_and_the_held_out_text_shares_none():
    from pipeline.measure import drift

    docs = ["a"] * 1000 + ["b"] * 300 + ["c"] * 2000
    spans = drift.spread_spans(docs, len(docs), 5, 256, per_doc=4)
    assert spans == [(1044, 1300), (2276, 2532), (2532, 2788), (2788, 3044), (3044, 3300)]  # 4 from c, 1 from b
    assert all(len({docs[i] for i in range(a, b)}) == 1 for a, b in spans)  # each within one document
    assert drift.held_out_end(docs, spans, len(docs)) == 1000  # the text before b: no window's document
    with pytest.raises(ValueError, match="room for 8 windows"):
        drift.spread_spans(docs, len(docs), 9, 256, per_doc=4)  # a: 3, b: 1, c: 4
    assert drift.spread_spans(None, 3300, 2, 256) == [(2788, 3044), (3044, 3300)]  # no documents: consecutive


# --- what serving buys: KV-cache precision in the space ----------------------------------------------------

def test_capacity_takes_the_fp8_kv_twin_where_memory_cannot_tell_them_apart():
    auto = row("k3", 118, "PASS", "PASS", kv=9000, kv_cache="auto")
    twin = row("k3-kvfp8", 118, "PASS", "PASS", kv=18000, kv_cache="fp8")
    wider = row("k5", 122, "PASS", "PASS", kv=8800, kv_cache="auto")
    for r in (auto, twin, wider):
        r["search_pass"] = True
    assert sealed.confirm([auto, twin, wider], "memory")[0]["name"] == "k3"  # same weights: the plain KV cache
    assert sealed.confirm([auto, twin, wider], "capacity")[0]["name"] == "k3-kvfp8"  # twice the tokens
    assert choose([auto, twin, wider], "capacity")["name"] == "k3-kvfp8"
    assert choose([auto, twin, wider], "memory")["name"] == "k3"
    # the twin did not hold on its sealed half: capacity falls back along the sequence
    twin["sealed"]["verdict"] = "FAIL"
    answer, order, stopped = sealed.confirm([auto, twin, wider], "capacity")
    assert order == ["k5", "k3", "k3-kvfp8"] and answer["name"] == "k3" and stopped == "k3-kvfp8"


def test_a_capacity_search_that_could_not_serve_fp8_says_why():
    from pipeline.recipe.search_section import SearchSpec
    from pipeline.search.points import kv_space

    why = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
    rows = [row("k3", 118, "PASS", "PASS", kv_cache="auto"),
            {**row("k3-kvfp8", 118, "SKIPPED", "SKIPPED", kv_cache="fp8"), "reason": why}]
    space = kv_space(rows, SearchSpec(kv_cache=("auto", "fp8"), objective="capacity"))
    assert space["fp8"] == {"served": 0, "skipped": 1, "why": why} and "as memory does" in space["note"]
    assert "note" not in kv_space(rows, SearchSpec(kv_cache=("auto", "fp8"), objective="memory"))
    with pytest.raises(ValueError, match="kv_cache must include auto"):
        SearchSpec(kv_cache=("fp8",))


def test_an_fp8_kv_cache_served_by_the_engine_shares_its_schemes_checkpoint():
    from pipeline.recipe.schema import VariantSpec
    from pipeline.store import keys

    r = minirun.recipe()
    v = VariantSpec(name="a", scheme="rtn_w4a16")
    key = {kv: keys.quantize_key(r, v.model_copy(update={"kv_cache": kv}), "m") for kv in
           ("auto", "fp8", "fp8_calibrated")}
    assert key["fp8"] == key["auto"] != key["fp8_calibrated"]  # calibrated scales are in the files


def test_the_margin_reads_the_gates_own_bound_and_never_narrows():
    def r(op, value, lo, hi, severity="fail"):
        return {"verdict": "PASS", "gates": [{"gate": "g", "value": value, "ci_low": lo, "ci_high": hi, "op": op,
                                              "threshold": 1.10 if op == "<=" else 0.85, "severity": severity}]}
    assert sealed.passes_search(r(">=", 0.90, 0.88, 0.92))  # 0.90 - 1.84 x 0.02 = 0.863
    assert not sealed.passes_search(r(">=", 0.865, 0.855, 0.875))  # 0.865 - 0.018 < 0.85 though its bound clears
    assert not sealed.passes_search(r("<=", 1.06, 1.04, 1.085))  # 1.06 + 1.84 x 0.025 = 1.106 > 1.10
    assert sealed.passes_search(r("<=", 1.06, None, 1.07))  # a <= gate reads the upper bound only
    assert sealed.passes_search(r(">=", 0.865, 0.855, 0.875, "warn"))  # warn gates carry no margin
    # a percentile interval that misses its own point: the distance still counts, it never makes passing easier
    assert not sealed.passes_search(r(">=", 0.86, 0.87, 0.90))


def test_a_failing_kv_twin_never_stops_a_memory_search():
    auto = row("k3", 118, "PASS", "PASS", kv_cache="auto")
    twin = row("k3-kvfp8", 118, "PASS", "FAIL", kv_cache="fp8")
    wider = row("k5", 122, "PASS", "PASS", kv_cache="auto")
    answer, order, stopped = sealed.confirm([auto, twin, wider], "memory")
    assert answer["name"] == "k3" and "k3-kvfp8" not in order and stopped is None


def test_drift_intervals_resample_whole_documents():
    from pipeline.measure import drift

    def windows(docs, agree):
        n = np.full(len(docs), 100.0)
        return {"kl_sum": np.full(len(docs), 1.0), "agree": np.array(agree, dtype=float), "n": n,
                "nll_base": n * 2, "nll_var": n * 2.1, "kl_positions": np.zeros(1), "doc": docs}

    # two essays of three windows each, the windows of one essay alike: 2 units to resample, not 6
    two = drift.summarize(windows(["a"] * 3 + ["b"] * 3, [90] * 3 + [70] * 3), samples=2000)
    six = drift.summarize(windows(list("abcdef"), [90] * 3 + [70] * 3), samples=2000)
    assert two["documents"] == 2 and two["windows"] == 6 and two["top1_agreement"] == six["top1_agreement"]
    assert two["top1_ci_low"] < six["top1_ci_low"]  # fewer independent units: a wider interval
    one = drift.summarize(windows(["a", "a"], [90, 90]))
    assert (one["top1_ci_low"], one["top1_ci_high"]) == (0.0, 1.0)  # one essay bounds nothing


def test_validate_wants_drift_windows_over_two_essays_and_four_for_a_search(tmp_path):
    from pipeline.recipe.schema import Recipe
    from pipeline.run.preflight import PreflightError, check_drift
    from tests import tinymodel

    model = tinymodel.build(tmp_path / "tiny")

    def recipe(windows: int, search: bool) -> Recipe:
        d = {"schema_version": 1, "name": "d", "model": {"path": str(model)}, "engine": {"max_model_len": 512},
             "variants": [{"name": "v", "scheme": "rtn_w4a16"}],
             "quality": {"suites": ["drift"], "drift": {"windows": windows, "window_tokens": 256}},
             "gates": [{"metric": "top1_agreement", "op": ">=", "threshold": 0.9}]}
        return Recipe.model_validate({**d, **({"search": {}} if search else {})})

    with pytest.raises(PreflightError, match=r"span 1 essay\(s\), 2 needed \(its intervals resample whole essays"):
        check_drift(recipe(2, False), tmp_path / "d.yaml", model)  # both windows from the last essay
    check_drift(recipe(4, False), tmp_path / "d.yaml", model)  # two essays
    with pytest.raises(PreflightError, match=r"span 2 essay\(s\), 4 needed \(a search"):
        check_drift(recipe(4, True), tmp_path / "d.yaml", model)
    check_drift(recipe(8, True), tmp_path / "d.yaml", model)


def test_an_anchor_is_compared_never_the_answer():
    """An anchor's bits were matched to the search data's pick: even cheaper and passing both halves, it is on the
    frontier and never confirmed as the answer, nor does a sealed failure of it stop the sequence."""
    pick = row("k3", 118, "PASS", "PASS")
    anchor = row("anchor-autoround", 117, "PASS", "PASS", kind="anchor", sealed={"top1_agreement": 0.9})
    failing = row("anchor-autoround", 119, "PASS", "FAIL", kind="anchor")
    assert choose([pick, anchor], "memory")["name"] == "k3"
    answer, order, stopped = sealed.confirm([pick, anchor], "memory")
    assert answer["name"] == "k3" and order == ["k3"] and not anchor["confirmed"]
    assert sealed.confirm([pick, failing], "memory")[2] is None
    pick["sealed"]["top1_agreement"] = 0.85
    sealed.frontier([pick, anchor])
    assert anchor["pareto"] and not pick["pareto"]  # the frontier shows what beat the search's own choice


def test_latency_ranks_on_the_conservative_end_of_each_interval():
    """The latency objective reads p95 TPOT as a latency gate does, at the upper end of its interval over repeats:
    a lucky point estimate with a wide interval is not called faster; a candidate never timed cannot answer."""
    lucky = row("lucky", 118, "PASS", "PASS", tpot_p95_ms=30.0, tpot_p95_ci=[24.0, 45.0])
    steady = row("steady", 120, "PASS", "PASS", tpot_p95_ms=33.0, tpot_p95_ci=[32.0, 34.0])
    untimed = row("untimed", 100, "PASS", "PASS", tpot_p95_ms=None)
    assert choose([lucky, steady, untimed], "latency")["name"] == "steady"
    answer, order, _ = sealed.confirm([lucky, steady, untimed], "latency")
    assert answer["name"] == "steady" and order == ["lucky", "steady"]
    one_run = row("one-run", 118, "PASS", "PASS", tpot_p95_ms=31.0)  # no repeats: the point is all there is
    assert sealed.cost(one_run, "latency") == (31.0, 118)
    twin = row("steady-kvfp8", 120, "PASS", "PASS", kv_cache="fp8", tpot_p95_ms=30.0, tpot_p95_ci=[29.0, 31.0])
    assert choose([steady, twin], "latency")["name"] == "steady-kvfp8"  # a twin can buy latency


def test_a_points_p95_tpot_carries_its_interval_over_repeats(tmp_path):
    """The row a latency search ranks: p95 TPOT from the repeats (their geometric mean and 95% t interval, as a
    latency gate reads it); without repeats, the figure over all requests and no interval."""
    from pipeline.search.points import _tpot_p95

    r = minirun.recipe()
    root = minirun.make_run(tmp_path / "run", r, {"piqa": [1, 0] * 50}, {"piqa": [1, 0] * 50})
    s = minirun.load_results(root)["v4"]["systems"]
    assert _tpot_p95(s)["tpot_p95_ci"] is None and _tpot_p95(s)["tpot_p95_ms"] == s.latency.tpot_ms.p95
    s.latency.repeats = [{"tpot_p50": 30.0, "tpot_p95": x, "tpot_p99": 50.0} for x in (40.0, 42.0, 44.0)]
    got = _tpot_p95(s)
    assert got["tpot_p95_ms"] == pytest.approx(41.97, abs=0.01) and got["tpot_p95_ci"][0] < 40 < 44 < got["tpot_p95_ci"][1]
    assert _tpot_p95(None) == {"tpot_p95_ms": None, "tpot_p95_ci": None}


def _latency_pick_rate(repeats: int, sims: int = 400, seed: int = 0) -> float:
    """How often a latency search picks the truly faster of two candidates (p95 TPOT 30 vs 31.5 ms, repeat-to-
    repeat spread 6% and 3%: the faster one is the noisier), each ranked at its interval's upper end."""
    from pipeline.measure import stats

    rng = np.random.default_rng(seed)
    right = 0
    for _ in range(sims):
        rows = []
        for name, true, cv in (("fast", 30.0, 0.06), ("slow", 31.5, 0.03)):
            gm, lo, hi = stats.mean_ci_log(true * np.exp(rng.normal(0, cv, repeats)))
            rows.append(row(name, 100, "PASS", "PASS", tpot_p95_ms=gm, tpot_p95_ci=[lo, hi]))
        right += choose(rows, "latency")["name"] == "fast"
    return right / sims


def test_simulated_latency_ranking_picks_the_faster_more_often_as_repeats_grow():
    """Ranking at the upper end penalises a noisy candidate while its repeats are few, and stops doing so as they
    grow: the rule decides more, not less, with data."""
    rates = [_latency_pick_rate(n) for n in (3, 10, 30)]
    assert rates[0] < rates[1] < rates[2] and rates[2] > 0.95, rates
    # on 3 repeats the faster one's 5% lead is within its own noise: the rule keeps the one whose p95 can be
    # promised (ranking on the point estimate would take the noisy one most of the time)
    assert rates[0] < 0.6, rates
