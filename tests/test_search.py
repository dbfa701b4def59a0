"""The search's decisions without an engine: the ladder (bisection under a cap), the answer, the mixed
llm-compressor recipe, bad `search:` input, and the report's answer banner. The real thing (sensitivity
in the quantize environment, candidates built and served) is tests/test_search_engine.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.recipe.schema import RecipeError, load
from pipeline.recipe.search_section import SearchSpec
from pipeline.search import mixed, sealed
from pipeline.search.ladder import choose, first_guess, ladder, next_k
from reports.render import render_run
from tests import minirun

ROOT = Path(__file__).resolve().parent.parent


def ranked(n: int) -> list[dict]:
    """n blocks, most sensitive first, disagreement falling off geometrically."""
    return [{"part": f"model.layers.{i}", "kl_mean": 0.05 * 0.8 ** i, "top1_agreement": 1 - 0.04 * 0.8 ** i,
             "modules": [f"model.layers.{i}.mlp.down_proj"]} for i in range(n)]


def oracle(threshold: int, calls: list):
    """A candidate passes when it keeps at least `threshold` blocks (monotone, as quality is in k)."""
    def build(fallback: str, k: int) -> dict:
        calls.append((fallback, k))
        ok = k >= threshold
        return {"name": f"k{k}", "verdict": "PASS" if ok else "FAIL", "top1_agreement": 0.77 if k == 0 else 0.9,
                "native_weight_bytes": 100 + k, "kv_tokens": 1000 - k}
    return build


@pytest.mark.parametrize("threshold", [0, 1, 2, 5, 11, 29, 30])
def test_ladder_finds_the_smallest_passing_k(threshold):
    calls: list = []
    rows = ladder(SearchSpec(max_builds=64), ranked(30), 0.85, oracle(threshold, calls))
    assert calls[0] == ("w8a16", 0)  # the uniform scheme first
    best = choose(rows, "memory")
    assert best["name"] == f"k{threshold}"  # exact: bisection closes on the boundary
    assert len({k for _, k in calls}) == len(calls)  # never builds the same k twice
    assert len(calls) <= 12  # uniform + guess + doubling + bisection over 30 blocks


def test_ladder_stops_at_the_cap_with_the_best_it_found():
    calls: list = []
    rows = ladder(SearchSpec(max_builds=4), ranked(30), 0.85, oracle(7, calls))
    assert [k for _, k in calls] == [0, 3, 6, 12]  # uniform, the curve's guess, doubling; then the cap
    assert choose(rows, "memory")["name"] == "k12"  # the best that passed, though k = 7..11 were not tried
    calls = []
    rows = ladder(SearchSpec(max_builds=2), ranked(30), 0.85, oracle(31, calls))  # nothing can pass
    assert len(rows) == 2 and choose(rows, "memory") is None


def test_ladder_moves_to_the_next_fallback_only_when_the_first_cannot_pass():
    calls: list = []

    def build(fallback, k):
        calls.append((fallback, k))
        ok = fallback == "unquantized" and k >= 3
        return {"name": f"{fallback}{k}", "verdict": "PASS" if ok else "FAIL", "top1_agreement": 0.8,
                "native_weight_bytes": k}

    rows = ladder(SearchSpec(fallbacks=("w8a16", "unquantized"), max_builds=20), ranked(6), 0.85, build)
    assert [c for c in calls if c[0] == "w8a16"][-1] == ("w8a16", 6)  # w8a16 tried up to every block
    assert ("unquantized", 0) not in calls  # the uniform candidate is not built twice
    assert choose(rows, "memory")["name"] == "unquantized3"


def test_a_candidate_that_fails_to_run_stops_the_ladder():
    calls: list = []

    def build(fallback, k):
        calls.append(k)
        return {"name": f"k{k}", "verdict": "FAILED-TO-RUN" if k else "FAIL", "top1_agreement": 0.7}

    rows = ladder(SearchSpec(max_builds=6), ranked(30), 0.85, build)
    assert calls == [0, 4] and choose(rows, "memory") is None  # not 6 builds spent on a broken recipe


def test_first_guess_reads_the_curve():
    r = ranked(30)
    # uniform top-1 0.77 against a 0.85 floor: the kept blocks must remove ~2/3 of the disagreement
    k = first_guess(r, 0.77, 0.85)
    d = [1 - x["top1_agreement"] for x in r]
    assert 1 - 0.23 * sum(d[k:]) / sum(d) >= 0.86 > 1 - 0.23 * sum(d[k - 1:]) / sum(d)
    assert first_guess(r, 0.99, 0.85) == 1
    kl = [x["kl_mean"] for x in r]  # no top-1 gate: half the summed KL
    k = first_guess(r, None, None)
    assert sum(kl[:k]) >= sum(kl) / 2 > sum(kl[:k - 1])


def test_next_k_bisects_between_largest_fail_and_smallest_pass():
    assert next_k({}, 30, 5) == 0
    assert next_k({0: True}, 30, 5) is None  # the uniform scheme passes: nothing cheaper to find
    assert next_k({0: False}, 30, 5) == 5
    assert next_k({0: False, 5: False}, 30, 5) == 10
    assert next_k({0: False, 5: False, 10: True}, 30, 5) == 7
    assert next_k({0: False, 7: False, 8: True}, 30, 5) is None
    assert next_k({0: False, 30: False}, 30, 5) is None  # every block kept and still failing


def test_choose_by_objective():
    rows = [{"name": "a", "verdict": "PASS", "native_weight_bytes": 120, "kv_tokens": 900},
            {"name": "b", "verdict": "WARN", "native_weight_bytes": 110, "kv_tokens": 950},
            {"name": "c", "verdict": "FAIL", "native_weight_bytes": 90, "kv_tokens": 990},
            {"name": "d", "verdict": "UNVERIFIED", "native_weight_bytes": 95, "kv_tokens": 980}]
    assert choose(rows, "memory")["name"] == "b"
    assert choose(rows, "capacity")["name"] == "b"
    assert choose(rows[2:], "memory") is None


def test_mixed_recipe_puts_each_linear_in_exactly_one_group():
    names = [f"model.layers.{i}.{m}" for i in range(12) for m in ("self_attn.q_proj", "mlp.down_proj")]
    kept = [n for n in names if ".layers.1." in n or ".layers.11." in n]
    rest = [n for n in names if n not in kept]
    r = mixed.candidate_recipe("gptq_w4a16", 64, "w8a16", rest, kept, ["lm_head"])
    mod = r["quant_stage"]["quant_modifiers"]["GPTQModifier"]
    g0, g1 = (re.compile(mod["config_groups"][g]["targets"][0][3:]) for g in ("group_0", "group_1"))
    assert [n for n in names if g0.match(n)] == rest and [n for n in names if g1.match(n)] == kept
    assert not g0.match("model.layers.1.self_attn.q_proj.extra") and not g1.match("model.layers.1")
    assert mod["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    assert mod["config_groups"]["group_1"]["weights"] == {"num_bits": 8, "type": "int", "symmetric": True,
                                                          "dynamic": False, "strategy": "channel"}
    un = mixed.candidate_recipe("awq_w4a16", 64, "unquantized", rest, kept, ["lm_head"])
    q = un["quant_stage"]["quant_modifiers"]["QuantizationModifier"]
    assert "AWQModifier" in un["quant_stage"]["quant_modifiers"] and set(q["ignore"]) == {"lm_head", *kept}
    assert list(q["config_groups"]) == ["group_0"] and q["config_groups"]["group_0"]["weights"]["symmetric"] is False


def _search_recipe(tmp_path: Path, **search) -> Path:
    d = yaml.safe_load((ROOT / "recipes" / "search.yaml").read_text())
    d["search"].update(search)
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


@pytest.mark.parametrize("search,field", [
    ({"fallbacks": ["w8a8_int8"]}, "search.fallbacks: w8a8_int8 is not offered per block"),
    ({"fallbacks": ["int3"]}, "search.fallbacks: unknown fallback 'int3'"),
    ({"base_scheme": "fp8_block"}, "search.base_scheme"),
    ({"max_builds": 0}, "search.max_builds"),
    ({"group_size": 48}, "search.group_size"),
    ({"objective": "speed"}, "search.objective"),
    ({"sensitivty": {}}, "search.sensitivty"),
])
def test_bad_search_input_names_the_field(tmp_path, search, field):
    with pytest.raises(RecipeError, match=re.escape(field)):
        load(_search_recipe(tmp_path, **search))


def test_search_needs_a_fail_gate(tmp_path):
    d = yaml.safe_load((ROOT / "recipes" / "search.yaml").read_text())
    d["gates"] = [{**g, "severity": "warn"} for g in d["gates"]]
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(RecipeError, match="search: needs at least one gate of severity fail"):
        load(p)


def test_cli_exits_2_naming_the_field(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "QUANTIZE_EVAL_HOME": str(tmp_path / "home")}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=120)

    bad = _search_recipe(tmp_path, max_builds=-1)
    for cmd in ("search", "validate"):
        proc = cli(cmd, str(bad))
        assert proc.returncode == 2 and "search.max_builds" in proc.stderr and proc.stderr.count("\n") == 1
    d = yaml.safe_load((ROOT / "recipes" / "search.yaml").read_text())
    d["search"]["anchors"] = ["nvfp4"]
    (tmp_path / "mo.yaml").write_text(yaml.safe_dump(d))
    proc = cli("validate", str(tmp_path / "mo.yaml"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "search.anchors" in proc.stderr and "'auto_round' or 'modelopt'" in proc.stderr
    proc = cli("search", str(ROOT / "recipes" / "awq.yaml"))
    assert proc.returncode == 2 and "search: this recipe has no search section" in proc.stderr
    d = yaml.safe_load((ROOT / "recipes" / "search.yaml").read_text())
    d["variants"] = []
    only = tmp_path / "only.yaml"
    only.write_text(yaml.safe_dump(d))
    proc = cli("run", str(only))
    assert proc.returncode == 2 and "quantize-eval search" in proc.stderr
    assert not (tmp_path / "runs").exists()


def _search_json(answer: str | None, sealed_verdict: str = "PASS") -> dict:
    """A search.json as ladder._search writes it: the rows' search-half figures, their sealed half, and the
    confirmation and frontier by pipeline/search/sealed.py itself."""
    row = {"name": "search-w8a16-k03", "kind": "candidate", "fallback": "w8a16", "k": 3,
           "kept": ["model.layers.11", "model.layers.12", "model.layers.2"], "verdict": "PASS", "reason": "",
           "gates": [], "checkpoint_bytes": 120 * 2**20, "native_weight_bytes": 118 * 2**20, "kv_tokens": 9000,
           "kv_projected": True, "top1_agreement": 0.87, "top1_ci": [0.86, 0.88], "kl_mean": 0.03,
           "accuracy_delta": -0.01, "accuracy_delta_ci": [-0.03, 0.01], "built_now": True, "quantize_wall_s": 50,
           "tpot_p95_ms": None,
           "sealed": {"verdict": sealed_verdict, "top1_agreement": 0.861, "top1_ci": [0.852, 0.870],
                      "code_top1_agreement": 0.905, "code_top1_ci": [0.89, 0.92], "code_windows": 8, "windows": 12,
                      "accuracy_delta": -0.02, "accuracy_delta_ci": [-0.05, 0.01], "items": 300}}
    uniform = {**row, "name": "search-uniform", "k": 0, "kept": [], "verdict": "FAIL", "top1_agreement": 0.78,
               "native_weight_bytes": 110 * 2**20, "sealed": {**row["sealed"], "verdict": "FAIL"}}
    rows = [uniform, row] if answer else [uniform]
    for r in rows:
        r["search_pass"], r["gap"] = sealed.passes_search(r), sealed.gap(r)
    confirmed, order, stopped = sealed.confirm(rows, "memory")
    picked = choose(rows, "memory")
    return {"base_scheme": "gptq_w4a16", "group_size": 64, "fallbacks": ["w8a16"], "objective": "memory",
            "max_builds": 6, "candidates": len(rows), "built_now": len(rows),
            "answer": confirmed["name"] if confirmed else None, "search_answer": picked["name"] if picked else None,
            "confirmation_rule": sealed.RULE, "margin_rule": sealed.MARGIN_RULE, "confirmation_order": order,
            "stopped_at": stopped, "frontier": sealed.frontier(rows), "split_seed": 0,
            "winners_curse": picked["gap"] if picked else None,
            "reproduce_recipe": "/runs/x/search/chosen-recipe.yaml" if confirmed else None,
            "sensitivity_grid": "int4 sym g64, round to nearest", "sensitivity_tokens": 2044,
            "ranking": ["model.layers.11"], "rows": rows, "references": [],
            "sensitivity": [{"kind": "block", "part": f"model.layers.{i}", "kl_mean": 0.01 * (i + 1),
                             "top1_agreement": 0.95, "modules": [], "params": 1} for i in range(3)]}


@pytest.mark.parametrize("answer,sealed_verdict", [("search-w8a16-k03", "PASS"), (None, "PASS"),
                                                   ("search-w8a16-k03", "INCONCLUSIVE")])
def test_report_leads_with_the_answer_not_the_candidates_verdict(tmp_path, answer, sealed_verdict):
    import json

    r = minirun.recipe()
    root = minirun.make_run(tmp_path / "run", r, {"piqa": [1, 0] * 50}, {"piqa": [1, 0] * 50})
    (root / "signoff.json").write_text(json.dumps({
        "recipe": "awq", "recipe_hash": "h", "verdict": "FAIL", "exit_code": 1, "variants": [
            {"variant": "v4", "verdict": "FAIL", "reason": "top1_agreement[overall] FAIL"}]}))
    (root / "search").mkdir()
    s = _search_json(answer, sealed_verdict)
    (root / "search" / "search.json").write_text(json.dumps(s))
    html = render_run(root).read_text()
    assert "VERDICT: FAIL" not in html  # the candidates' verdict is a table here, not the banner
    assert "Sign-off of every candidate and reference on the sealed half" in html
    if answer and sealed_verdict == "PASS":
        assert 'class="banner PASS">SEARCH ANSWER: search-w8a16-k03 — 118.0 MiB' in html
        assert "keeps blocks 11, 12, 2 at w8a16" in html and "confirmed on sealed data" in html
        assert "chosen-recipe.yaml" in html and "Search frontier: search data and sealed data" in html
        # search and sealed side by side, the gap between them, and the rule the answer was signed off by
        assert "0.870 [0.860, 0.880]" in html and "0.861 [0.852, 0.870]" in html and "+0.009" in html
        assert "0.905 [0.890, 0.920]" in html and "fixed sequence" in html and "Winner's curse" in html
        assert s["answer"] == answer
    elif answer:  # passed on the search data, not on the sealed data: nothing is signed off
        assert 'class="banner FAIL">SEARCH: NOT CONFIRMED — search-w8a16-k03 passed on the search data' in html
        assert s["answer"] is None and s["search_answer"] == answer
    else:
        assert 'class="banner FAIL">SEARCH: NONE PASSED' in html
    assert json.loads((root / "results.json").read_text())["search"]["answer"] == s["answer"]


def test_a_search_that_fails_after_the_baseline_signs_off_what_it_measured(tmp_path, monkeypatch):
    """The baseline and references ran: a sensitivity (or ladder) failure ends in a concluded run whose report
    says the search failed and why, never in a traceback that leaves no report."""
    import json
    from types import SimpleNamespace

    from pipeline.run import runner
    from pipeline.runstore import RunDir
    from pipeline.search import ladder as lad

    r = minirun.recipe()
    root = minirun.make_run(tmp_path / "run", r, {"piqa": [1, 0] * 50}, {"piqa": [1, 0] * 50})
    ctx = SimpleNamespace(run_dir=RunDir(root), recipe=r)
    concluded = {}
    monkeypatch.setattr(runner, "prepare_environment", lambda: None)
    monkeypatch.setattr(runner, "start", lambda *a: (ctx, {}))
    monkeypatch.setattr(runner, "plan", lambda *a: None)
    monkeypatch.setattr(runner, "run_local", lambda c: {})
    monkeypatch.setattr(runner, "conclude", lambda *a, **kw: concluded.update(kw))

    def broken(*a):
        raise FileNotFoundError("pipeline/engines/sensitivity_worker.py")
    monkeypatch.setattr(lad.sensitivity, "measure", broken)
    assert lad._search(r, tmp_path / "x.yaml", False) == 1
    assert "the search failed: FileNotFoundError" in concluded["headline"]
    assert json.loads((root / "search" / "search.json").read_text())["error"].startswith("FileNotFoundError")
    html = render_run(root).read_text()
    assert "SEARCH: NO ANSWER — the search failed: FileNotFoundError" in html and "Search frontier" not in html


def test_parts_rank_by_sensitivity_per_weight_and_overlaps_count_once():
    from pipeline.search.ladder import kept_modules, ladder_length
    from pipeline.stages.sensitivity import linear_modules, ranked_parts

    def row(kind, part, modules, params, kl):
        return {"kind": kind, "part": part, "modules": modules, "params": params, "kl_mean": kl,
                "top1_agreement": 0.9}
    result = {"rows": [row("block", "model.layers.0", ["model.layers.0.a", "model.layers.0.v"], 100, 0.02),
                       row("block", "model.layers.1", ["model.layers.1.a", "model.layers.1.v"], 100, 0.03),
                       row("kind", "v", ["model.layers.0.v", "model.layers.1.v"], 20, 0.015)]}
    ranked = ranked_parts(result, "blocks_and_kinds")  # the small kind matters most per weight kept
    assert [r["part"] for r in ranked] == ["v", "model.layers.1", "model.layers.0"]
    assert [r["part"] for r in ranked_parts(result)] == ["model.layers.1", "model.layers.0"]
    assert kept_modules(ranked, 2) == ["model.layers.0.v", "model.layers.1.v", "model.layers.1.a"]
    modules = linear_modules(result)
    assert modules == ["model.layers.0.a", "model.layers.0.v", "model.layers.1.a", "model.layers.1.v"]
    assert ladder_length(ranked, modules, "w8a16") == 3  # the third part completes the set
    assert ladder_length(ranked, modules, "unquantized") == 2  # every module unquantized is the baseline
    r = mixed.candidate_recipe("rtn_w4a16", 64, "w8a16", [], modules, ["lm_head"])
    assert list(r["quant_stage"]["quant_modifiers"]["QuantizationModifier"]["config_groups"]) == ["group_0"]
    with pytest.raises(ValueError, match="base model"):
        mixed.candidate_recipe("rtn_w4a16", 64, "unquantized", [], modules, ["lm_head"])


def test_block_kinds_rank_each_input_sharing_group_within_each_block():
    """units: block_kinds: the worker cuts each block into its input-sharing groups, the search ranks only
    those (not whole blocks or kinds across blocks), and people read them grouped by kind."""
    from pipeline.engines.workers.sensitivity_parts import parts_of
    from pipeline.stages.sensitivity import linear_modules, ranked_parts

    names = [f"model.layers.{b}.{k}" for b in range(2) for k in ("q_proj", "k_proj", "v_proj", "down_proj")]
    groups = [["q_proj", "k_proj", "v_proj"], ["down_proj"]]
    parts = parts_of(names, None, groups)
    assert [(kind, p) for kind, p, _ in parts] == [
        ("block", "model.layers.0"), ("block", "model.layers.1"),
        ("block_kind", "model.layers.0:q_proj+k_proj+v_proj"), ("block_kind", "model.layers.0:down_proj"),
        ("block_kind", "model.layers.1:q_proj+k_proj+v_proj"), ("block_kind", "model.layers.1:down_proj")]
    assert parts[2][2] == ["model.layers.0.q_proj", "model.layers.0.k_proj", "model.layers.0.v_proj"]
    assert [p for kind, p, _ in parts_of(names, groups, groups) if kind == "kind"] == ["q_proj+k_proj+v_proj",
                                                                                       "down_proj"]
    kl = {"model.layers.0:down_proj": 0.01, "model.layers.1:q_proj+k_proj+v_proj": 0.06}
    result = {"rows": [{"kind": kind, "part": p, "modules": ms, "params": 10 * len(ms), "top1_agreement": 0.9,
                        "kl_mean": kl.get(p, 0.02 if kind == "block" else 0.001)} for kind, p, ms in parts]}
    ranked = ranked_parts(result, "block_kinds")
    assert [r["part"] for r in ranked][:2] == ["model.layers.1:q_proj+k_proj+v_proj", "model.layers.0:down_proj"]
    assert all(r["kind"] == "block_kind" for r in ranked) and len(ranked) == 4
    assert linear_modules(result) == names  # every Linear, once, in model order
    assert mixed.describe_parts([r["part"] for r in ranked] + ["model.layers.7", "down_proj"]) == (
        "block 7; every down_proj; q_proj+k_proj+v_proj in blocks 1, 0; down_proj in blocks 0, 1")


def test_report_draws_the_kinds_within_blocks_and_marks_the_kept_ones(tmp_path):
    from reports.search import sensitivity_chart

    s = _search_json("search-w8a16-k03")
    s["sensitivity"] += [{"kind": "block_kind", "part": f"model.layers.{b}:{g}", "kl_mean": 0.01 * (b + 1),
                          "top1_agreement": 0.9, "modules": [], "params": 100}
                         for b in range(3) for g in ("q_proj+k_proj+v_proj", "down_proj")]
    s["rows"][1]["kept"] = ["model.layers.2:down_proj"]
    svg = sensitivity_chart(s)
    assert "Sensitivity per Linear kind in each block" in svg
    assert svg.count("<rect") == 3 + 6  # three blocks, then two groups in each of the three
    kept = [t for t in svg.split("<rect")[1:] if ", kept</title>" in t]
    assert len(kept) == 1 and 'fill="#bf8700"' in kept[0] and "down_proj in block 2" in kept[0]


def test_curve_points_are_where_the_ranked_parts_hold_each_fraction_of_the_weights():
    from pipeline.engines.workers.sensitivity_parts import curve_ks

    ranked = [{"part": p, "params": n} for p, n in (("x", 50), ("y", 30), ("z", 20))]
    # the smallest k whose parts hold each fraction of the weights: 50% -> x; 80% -> x+y; 100% -> all
    assert curve_ks(ranked, [0.1, 0.5, 0.8, 0.9, 1.0]) == [1, 2, 3]


def test_the_curve_guesses_k_calibrated_on_the_last_measured_candidate():
    from pipeline.search.ladder import curve_guess

    sens = {"uniform": {"top1_agreement": 0.75},
            "curve": [{"k": 10, "top1_agreement": 0.80}, {"k": 20, "top1_agreement": 0.85},
                      {"k": 40, "top1_agreement": 0.90}]}
    uniform = {"top1_agreement": 0.77, "top1_ci": [0.76, 0.78]}  # measured 0.02 above the emulation
    # the widened lower bound must clear 0.85: point >= 0.85 + 0.01 x 1.84 (its CI's half-width, widened to the
    # replication margin) + 0.005, i.e. an emulated 0.8534 -> k = 22 on the segment from (20, 0.85) to (40, 0.90)
    assert round(sealed.WIDEN, 2) == 1.84
    assert curve_guess(sens, {0: uniform}, 0.85, 60) == 22
    # the guess at 19 failed, measured 0.01 below the curve: the curve is shifted down for the next guess
    measured = {0: uniform, 19: {"top1_agreement": 0.835, "top1_ci": [0.82, 0.85]}}
    assert curve_guess(sens, measured, 0.85, 60) == 38  # emulated 0.8926 needed: (20, .85) .. (40, .90)
    assert curve_guess(sens, {0: uniform}, 0.99, 60) is None  # the curve never gets there
    assert curve_guess({}, {0: uniform}, 0.85, 60) is None  # an rtn sensitivity has no curve


def test_the_ladder_builds_the_curves_guess_then_bisects():
    calls: list = []

    def build(fallback, k):
        calls.append(k)
        ok = k >= 24
        top1 = 0.77 if k == 0 else 0.85 + (k - 20) * 0.004
        return {"name": f"k{k}", "verdict": "PASS" if ok else "FAIL", "top1_agreement": top1,
                "top1_ci": [top1 - 0.01, top1 + 0.01], "native_weight_bytes": 100 + k}

    sens = {"uniform": {"top1_agreement": 0.75},
            "curve": [{"k": 10, "top1_agreement": 0.80}, {"k": 20, "top1_agreement": 0.85},
                      {"k": 40, "top1_agreement": 0.90}]}
    rows = ladder(SearchSpec(max_builds=8), ranked(60), 0.85, build, sens=sens)
    assert calls[:2] == [0, 22]  # uniform, then the curve's guess (not the proportional one)
    assert calls[2] != 22 and choose(rows, "memory")["name"] == "k24"
    assert len(calls) <= 6


def test_report_says_how_the_parts_were_ranked():
    from reports.search import search_section

    s = _search_json("search-w8a16-k03")

    class Run:
        search = s
    assert "rounded to the nearest point of the base grid" in search_section(Run())
    s["sensitivity_method"] = "calibrated"
    assert "own calibration (run in memory)" in search_section(Run())


def test_inside_the_bracket_the_curve_picks_where_the_boundary_is():
    """Between a failing and a passing candidate the curve (shifted to both measured ends) names the
    cheapest k it predicts to pass; the ladder builds it, and the boundary stays exact."""
    from pipeline.search.ladder import bracket_guess

    sens = {"uniform": {"top1_agreement": 0.78},
            "curve": [{"k": 50, "top1_agreement": 0.855}, {"k": 60, "top1_agreement": 0.865}]}
    lo = {"top1_agreement": 0.776, "top1_ci": [0.773, 0.779]}  # k = 0: 0.004 below the curve
    hi = {"top1_agreement": 0.858, "top1_ci": [0.855, 0.861]}  # k = 57: 0.004 below it (0.862)
    k = bracket_guess(sens, {0: lo, 57: hi}, 0.85, 0, 57)
    assert k == 55  # emulated 0.860 - 0.004 shift - 0.003 x 1.84 (widened half-width) = 0.8505; at 54: 0.8495
    assert bracket_guess(sens, {0: lo, 57: hi}, 0.80, 0, 57) < 30  # a low floor: far below the passing k
    assert bracket_guess(sens, {0: lo, 57: hi}, 0.99, 0, 57) == 56  # none predicted: the neighbour settles it
    assert bracket_guess({}, {0: lo, 57: hi}, 0.85, 0, 57) is None

    calls: list = []

    def build(fallback, k):
        calls.append(k)
        top1 = 0.776 + 0.0015 * k
        ok = k >= 55
        return {"name": f"k{k}", "verdict": "PASS" if ok else "FAIL", "top1_agreement": top1,
                "top1_ci": [top1 - 0.003, top1 + 0.003], "native_weight_bytes": 100 + k}

    sens = {"uniform": {"top1_agreement": 0.776},
            "curve": [{"k": 40, "top1_agreement": 0.836}, {"k": 60, "top1_agreement": 0.866}]}
    rows = ladder(SearchSpec(max_builds=6), ranked(90), 0.85, build, sens=sens)
    assert choose(rows, "memory")["name"] == "k55" and len(calls) <= 5, calls  # not 0, g, g/2, 3g/4, ...


def test_a_summary_that_fails_leaves_the_answer_banner_saying_so(tmp_path, monkeypatch):
    """Every candidate was measured, then the summary failed: search.json said nothing (and the rerun's
    start had removed the last one), so the page had no search banner at all."""
    import json
    from types import SimpleNamespace

    from pipeline.run import runner
    from pipeline.runstore import RunDir
    from pipeline.search import ladder as lad

    r = minirun.recipe()
    root = minirun.make_run(tmp_path / "run", r, {"piqa": [1, 0] * 50}, {"piqa": [1, 0] * 50})
    ctx = SimpleNamespace(run_dir=RunDir(root), recipe=r)
    monkeypatch.setattr(runner, "prepare_environment", lambda: None)
    monkeypatch.setattr(runner, "start", lambda *a: (ctx, {}))
    monkeypatch.setattr(runner, "plan", lambda *a: None)
    monkeypatch.setattr(runner, "run_local", lambda c: {})
    monkeypatch.setattr(runner, "conclude", lambda *a, **kw: None)
    monkeypatch.setattr(lad, "_measure_and_climb", lambda *a: ({}, [], []))

    def broken(*a):
        raise KeyError("native_weight_bytes")
    monkeypatch.setattr(lad, "choose", broken)
    assert lad._search(r, tmp_path / "x.yaml", False) == 1
    assert json.loads((root / "search" / "search.json").read_text())["error"].startswith("KeyError")
    assert "SEARCH: NO ANSWER — the search failed: KeyError" in render_run(root).read_text()


def test_a_search_says_it_is_preparing_and_ticks_like_a_run(monkeypatch, tmp_path):
    """A search on a new machine fetches the model and the data before its folder exists, as a run does:
    it goes through the same preparation step, which says what it does and ticks while it does it."""
    from pipeline.run import runner
    from pipeline.search import ladder as ladder_module

    said = []
    monkeypatch.setattr(runner, "say", lambda who, msg: said.append((who, msg)))

    def stop_here():
        raise RuntimeError("prepared")

    monkeypatch.setattr(runner, "prepare_environment", stop_here)
    recipe = load(Path("recipes/search.yaml"))
    with pytest.raises(RuntimeError, match="prepared"):
        ladder_module._search(recipe.model_copy(update={"runs_dir": str(tmp_path)}), Path("recipes/search.yaml"), True)
    assert ("run", "preparing: environments, model, data and checks") in said


def test_anchors_are_validated_before_any_work():
    """An anchor the pipeline does not know is named; an anchor needs 8-bit weights among the fallbacks."""
    from pydantic import ValidationError

    from pipeline.recipe.search_section import SearchSpec

    assert SearchSpec(anchors=["auto_round", "modelopt"], fallbacks=["unquantized", "w8a16"]).anchors == (
        "auto_round", "modelopt")
    with pytest.raises(ValidationError, match="'auto_round' or 'modelopt'"):
        SearchSpec(anchors=["nvfp4"], fallbacks=["w8a16"])
    with pytest.raises(ValidationError, match="need w8a16 among the fallbacks"):
        SearchSpec(anchors=["auto_round"], fallbacks=["unquantized"])
    with pytest.raises(ValidationError, match="listed twice"):
        SearchSpec(anchors=["auto_round", "auto_round"], fallbacks=["w8a16"])


def test_an_anchor_matches_only_a_mixed_pick_at_8_bits():
    from pipeline.search.anchors import target_of

    pick = {"name": "search-w8a16-k03", "kind": "candidate", "k": 3, "fallback": "w8a16"}
    assert target_of(pick) is None
    assert "nothing passed" in target_of(None)
    assert "not a mixed candidate" in target_of({**pick, "k": 0})
    assert "not a mixed candidate" in target_of({**pick, "kind": "reference", "k": None})
    assert "unquantized" in target_of({**pick, "fallback": "unquantized"})


def test_report_shows_the_anchor_beside_the_search_and_why_one_was_not_compared(tmp_path):
    import json

    r = minirun.recipe()
    root = minirun.make_run(tmp_path / "run", r, {"piqa": [1, 0] * 50}, {"piqa": [1, 0] * 50})
    (root / "search").mkdir()
    s = _search_json("search-w8a16-k03")
    anchor = {**s["rows"][1], "name": "anchor-autoround", "kind": "anchor", "k": None, "confirmed": False,
              "kept": ["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj",
                       "model.layers.29.mlp.down_proj"],
              "sealed": {**s["rows"][1]["sealed"], "top1_agreement": 0.843, "top1_ci": [0.83, 0.85]}}
    anchor["anchor"] = {"tool": "auto_round", "label": "auto-round AutoScheme", "matched": "search-w8a16-k03",
                        "version": "0.15.1", "avg_bits_target": 5.4988, "avg_bits_achieved": 5.4931}
    s["anchors"] = [anchor]
    s["anchor_runs"] = [anchor["anchor"], {"tool": "other", "label": "Other tool", "skipped": "no bits to match"}]
    (root / "search" / "search.json").write_text(json.dumps(s))
    html = render_run(root).read_text()
    assert "q_proj in block 3; k_proj in block 3; down_proj in block 29 at w8a16" in html
    assert "compared, not chosen" in html and "0.843 [0.830, 0.850]" in html
    assert "Head-to-head" in html and "chose its 8-bit layers at 5.499 bits (achieved 5.493)" in html
    assert "Other tool: not compared (no bits to match)" in html
    assert 'SEARCH ANSWER: search-w8a16-k03' in html  # the anchor is never the answer


def test_a_latency_search_stops_where_no_candidate_can_be_timed_and_says_so(tmp_path):
    """Served as dense weights (no native kernel here), a candidate has no p95 TPOT: a latency search cannot be
    answered by any build, so it stops after the uniform candidate and says UNVERIFIED, not NONE PASSED; where
    candidates are timed it climbs as any search does."""
    import json

    from pipeline.search.ladder import unmeasured

    calls: list = []
    untimed = oracle(7, calls)
    rows = ladder(SearchSpec(max_builds=6, objective="latency"), ranked(30), 0.85,
                  lambda f, k: {**untimed(f, k), "tpot_p95_ms": None})
    assert calls == [("w8a16", 0)] and len(rows) == 1
    sp = SearchSpec(objective="latency")
    assert unmeasured(rows, sp).startswith("SEARCH: UNVERIFIED — objective latency needs p95 TPOT")
    assert unmeasured(rows, SearchSpec(objective="memory")) is None
    timed = oracle(7, calls := [])
    rows = ladder(SearchSpec(max_builds=6, objective="latency"), ranked(30), 0.85,
                  lambda f, k: {**timed(f, k), "tpot_p95_ms": 40.0 - k / 10})
    assert len(calls) > 1 and unmeasured(rows, sp) is None
    r = minirun.recipe()
    root = minirun.make_run(tmp_path / "run", r, {"piqa": [1, 0] * 50}, {"piqa": [1, 0] * 50})
    (root / "search").mkdir()
    s = {**_search_json(None), "objective": "latency", "unmeasured": unmeasured([{"tpot_p95_ms": None}], sp)}
    (root / "search" / "search.json").write_text(json.dumps(s))
    assert 'class="banner UNVERIFIED">SEARCH: UNVERIFIED — objective latency' in render_run(root).read_text()
