"""Suite scoring (evalsuites/qe_utils.py), data extraction, rendering, slicing, and the KL maths."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import yaml

from pipeline import suites
from pipeline.measure import drift
from pipeline.recipe.schema import Recipe, RecipeError, load
from pipeline.setup import assets, models

U = suites.utils_module()


# --- generative scoring ----------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("The answer is 15.", 15.0), ("9 + 6 = 15\nThe answer is 15.\n\nThe answer", 15.0),
    ("She has 1,200 apples", 1200.0), ("x = -3.5 so", -3.5), ("no digits here", None),
    ("First 3 then 4 then 12", 12.0), ("It costs $4.50.", 4.5),
    ("3 + 4 = 7, then 7 * 2 = 14. The answer is 14.", 14.0),
    ("The answer is 7. No wait, the answer is 9.", 9.0)])
def test_extract_number(text, want):
    assert U.extract_number(text) == want


TRUTH = {"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}


@pytest.mark.parametrize("text,ok", [
    ('{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}', True),
    ('Sure: {"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5, "unit": "units"}}', True),
    ("calculate_triangle_area(base=10, height=5)", True),
    ('{"calculate_triangle_area": {"base": "10", "height": 5.0}}', True),
    ('{"name": "calculate_triangle_area", "arguments": {"base": 10}}', False),  # required height missing
    ('{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 6}}', False),
    ('{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5, "color": "red"}}', False),
    ('{"name": "triangle_area", "arguments": {"base": 10, "height": 5}}', False),
    ("calculate_triangle_area(base=10, height=5", False),  # unbalanced: no call
])
def test_bfcl_call_check(text, ok):
    assert U.bfcl_correct({"ground_truth": TRUTH}, text) is ok


@pytest.mark.parametrize("text,want", [
    ("(see the docs) then: area(base=3)", ("area", {"base": 3})),
    ('{"name": "say", "arguments": {"s": "a \\"quoted\\" word"}}', ("say", {"s": 'a "quoted" word'})),
    ("f(x={[1]: 2})", None),  # unhashable literal: no call, no crash
    ("nothing callable here", None)])
def test_parse_call_edge_cases(text, want):
    assert U.parse_call(text) == want


def test_bfcl_dict_arguments_follow_bfcl_allowed_lists():
    truth = {"book": {"room": [{"type": ["suite"], "view": ["", "sea"]}], "nights": [2]}}
    assert U.bfcl_correct({"ground_truth": truth}, 'book(room={"type": "suite"}, nights=2)')
    assert U.bfcl_correct({"ground_truth": truth}, 'book(room={"type": "suite", "view": "sea"}, nights=2)')
    assert not U.bfcl_correct({"ground_truth": truth}, 'book(room={"type": "suite", "view": "city"}, nights=2)')
    assert not U.bfcl_correct({"ground_truth": truth}, 'book(room={"view": "sea"}, nights=2)')


def test_bfcl_irrelevance_right_only_without_a_call():
    doc = {"ground_truth": None}
    assert U.bfcl_correct(doc, "NONE")
    assert U.bfcl_correct(doc, "I cannot do that with these tools.")
    assert not U.bfcl_correct(doc, '{"name": "bmi", "arguments": {"weight": 1}}')
    assert not U.bfcl_correct(doc, "   ")


@pytest.mark.parametrize("suite,doc,text,correct,n,cat", [
    ("asdiv", {"answer": "9"}, "The answer is 9.", True, 5, "correct"),
    ("asdiv", {"answer": "9"}, "   \n", False, 1, "empty"),
    ("asdiv", {"answer": "9"}, "I'm sorry, I cannot help with that.", False, 9, "refusal"),
    ("asdiv", {"answer": "9"}, "Let us think step by step about the apples and", False, 64, "truncated"),
    ("asdiv", {"answer": "9"}, "Apples are red.", False, 4, "malformed"),
    ("asdiv", {"answer": "9"}, "The answer is 8.", False, 5, "wrong"),
    ("bfcl", {"ground_truth": TRUTH}, "I would compute it by hand.", False, 6, "malformed"),
    ("bfcl", {"ground_truth": TRUTH}, "calculate_triangle_area(base=1, height=5)", False, 9, "wrong"),
    ("needle", {"needle_answer": "velvet"}, "marigold", False, 2, "wrong"),
])
def test_failure_categories(suite, doc, text, correct, n, cat):
    assert U.failure_category(suite, doc, text, correct, n, 64) == cat


# --- data and rendering ----------------------------------------------------------------------

def test_packaged_data_extracts_with_gold_labels():
    for name, want in (("openbookqa", 500), ("commonsenseqa", 1220)):
        rows = [json.loads(x) for x in assets.suite_data(name).read_text().splitlines()]
        assert len(rows) == want
        assert all(0 <= r["label"] < len(r["choices"]) for r in rows)
    bf = [json.loads(x) for x in assets.suite_data("bfcl").read_text().splitlines()]
    assert {r["slices"]["category"] for r in bf[:3]} == {"simple", "multiple", "irrelevance"}
    assert all((not r["ground_truth_json"]) == (r["slices"]["category"] == "irrelevance") for r in bf)
    assert U.bfcl_correct(bf[0], "nonsense") is False and U.ground_truth(bf[0])  # strings decode
    asd = [json.loads(x) for x in assets.suite_data("asdiv").read_text().splitlines()]
    assert asd[0]["answer"] == "9" and all(U.extract_number(r["answer"]) is not None for r in asd)


def test_bucket_edges():
    assert suites.bucket(0) == "0-31 tok" and suites.bucket(31) == "0-31 tok"
    assert suites.bucket(32) == "32-63 tok" and suites.bucket(4096) == ">=4096 tok"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.builtin_model("smollm2-135m-instruct"))


def test_needle_items_have_exact_haystacks_and_the_needle(tok):
    rows = suites.needle_rows(tok, (128, 256), (0.0, 0.5, 1.0), 2)
    assert len(rows) == 12
    for r in rows:
        assert f"is {r['needle_answer']}." in r["prompt"] and r["prompt"].startswith("<|im_start|>")
        n = len(tok(r["prompt"], add_special_tokens=False)["input_ids"])
        assert r["context_tokens"] + 20 < n < r["context_tokens"] + 90  # haystack + needle + question + template
    deep = next(r for r in rows if r["depth"] == 1.0 and r["context_tokens"] == 256)
    assert deep["prompt"].index("secret code word for") > len(deep["prompt"]) * 0.6
    assert {r["slices"]["depth"] for r in rows} == {"0%", "50%", "100%"}
    first = {(r["context_tokens"], r["depth"]) for r in rows[:6]}
    assert len(first) == 6  # cell by cell: a limit of 6 keeps every length x depth


def test_render_cuts_data_and_fills_path(tmp_path, tok):
    r = Recipe.model_validate({"schema_version": 1, "name": "x", "model": {"builtin": "smollm2-135m-instruct"},
                               "variants": [{"name": "v", "scheme": "w8a8_int8"}],
                               "quality": {"suites": ["asdiv", "piqa"], "limits": {"asdiv": 7}}})
    s = suites.resolve(["asdiv"])[0]
    y = suites.render(s, tmp_path, tok, r.quality, r.quality.limit_of("asdiv"))
    cfg = suites.read_task_yaml(y)
    data = cfg["dataset_kwargs"]["data_files"]["test"]
    rows = [json.loads(x) for x in open(data)]
    assert len(rows) == 7 and all(x["prompt"].startswith("<|im_start|>") for x in rows)
    assert cfg["process_results"] == "!function qe_utils.process_asdiv" and (tmp_path / "qe_utils.py").exists()
    assert r.quality.limit_of("piqa") == 200


def base_recipe(**quality):
    return {"schema_version": 1, "name": "x", "model": {"builtin": "smollm2-135m-instruct"},
            "variants": [{"name": "v", "scheme": "w8a8_int8"}], "quality": quality}


@pytest.mark.parametrize("quality,gates,expect", [
    ({"suites": ["piqa", "piqa"]}, [], "listed twice"),
    ({"suites": ["piqa"], "limits": {"siqa": 3}}, [], "limits: 'siqa' is not one of"),
    ({"suites": ["needle"], "needle": {"context_tokens": [4000]}}, [], "quality.needle.context_tokens"),
    ({"suites": ["needle"], "needle": {"depths": [1.5]}}, [], "quality.needle.depths"),
    ({"suites": ["piqa"]}, [{"metric": "kl_divergence", "op": "<=", "threshold": 0.1}], "needs the drift suite"),
    ({"suites": ["drift"]}, [{"metric": "accuracy_delta", "op": ">=", "threshold": -0.1}], "needs a scored suite"),
    ({"suites": ["piqa"]}, [{"metric": "accuracy_delta", "scope": "bfcl/category=simple", "op": ">=",
                             "threshold": -0.1}], "gates.0.scope"),
    ({"suites": ["missing-task.yaml"]}, [], "quality.suites.0: missing-task.yaml: task YAML not found"),
    # a suite whose data PyPI no longer serves is named as retired, not looked for as a task YAML
    ({"suites": ["piqa", "bigbench"]}, [], "quality.suites.1: suite 'bigbench' is retired: its data"),
])
def test_bad_quality_settings_name_the_field(tmp_path, quality, gates, expect):
    d = base_recipe(**quality)
    d["gates"] = gates
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(RecipeError) as exc:
        load(p)
    assert expect in str(exc.value) and "\n" not in str(exc.value)


def test_user_task_yaml_is_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "group.yaml").write_text("group: mine\ntask: [a, b]\n")
    (tmp_path / "inc.yaml").write_text("task: mine\ninclude: base.yaml\n")
    (tmp_path / "ok.yaml").write_text("task: mine\noutput_type: multiple_choice\n"
                                      "process_results: !function utils.f\n")
    for f, msg in (("group.yaml", "no `task:` name"), ("inc.yaml", "`include:`")):
        p = tmp_path / "r.yaml"
        p.write_text(yaml.safe_dump(base_recipe(suites=[f])))
        with pytest.raises(RecipeError, match=msg):
            load(p)
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({**base_recipe(suites=["piqa", "ok.yaml"]),
                                 "gates": [{"metric": "accuracy", "scope": "mine", "op": ">=", "threshold": 0}]}))
    assert load(p).quality.suites == ("piqa", "ok.yaml")


# --- KL from top-k logprobs ------------------------------------------------------------------

def _logsoftmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _full_kl(p, q):
    return float((np.exp(p) * (p - q)).sum())


def _top(lp, k):
    idx = np.argsort(-lp)[:k]
    return [[int(i), float(lp[i])] for i in idx]


def test_kl_exact_with_full_vocabulary_and_a_lower_bound_with_top_k():
    rng = np.random.default_rng(0)
    V = 64
    for _ in range(50):
        base = _logsoftmax(rng.normal(0, 3, V))
        var = _logsoftmax(np.log(np.exp(base)) + rng.normal(0, 0.3, V))
        actual = int(rng.integers(V))
        ref = _full_kl(base, var)
        full = drift.kl_position(_top(base, V), _top(var, V), (actual, base[actual]), (actual, var[actual]))
        assert full == pytest.approx(ref, rel=1e-6, abs=1e-9)
        for k in (1, 5, 20):
            part = drift.kl_position(_top(base, k), _top(var, k), (actual, base[actual]), (actual, var[actual]))
            assert 0 <= part <= ref + 1e-9


def test_drift_compare_joins_positions_and_summarizes():
    rng = np.random.default_rng(1)
    V, n = 32, 17

    def window(lps, ids):
        return {"ids": ids, "actual": [float(lps[i][ids[i + 1]]) for i in range(n - 1)],
                "top": [_top(lps[i], V) for i in range(n - 1)]}

    bw, vw, refs, agree = [], [], [], 0
    for _ in range(3):
        ids = [int(x) for x in rng.integers(0, V, n)]
        b = [_logsoftmax(rng.normal(0, 2, V)) for _ in range(n - 1)]
        v = [_logsoftmax(x + rng.normal(0, 0.5, V)) for x in b]
        bw.append(window(b, ids))
        vw.append(window(v, ids))
        refs += [_full_kl(x, y) for x, y in zip(b, v, strict=True)]
        agree += sum(int(np.argmax(x) == np.argmax(y)) for x, y in zip(b, v, strict=True))
    s = drift.summarize(drift.compare(bw, vw), samples=200)
    assert s["kl_mean"] == pytest.approx(np.mean(refs), rel=1e-6)
    assert s["top1_agreement"] == pytest.approx(agree / len(refs))
    assert s["kl_ci_low"] <= s["kl_mean"] <= s["kl_ci_high"] and s["tokens"] == 48
    nll_b = -sum(sum(w["actual"]) for w in bw) / 48
    assert s["ppl_base"] == pytest.approx(math.exp(nll_b))
    same = drift.summarize(drift.compare(bw, bw), samples=200)
    assert same["kl_mean"] == pytest.approx(0, abs=1e-9) and same["top1_agreement"] == 1 and same["ppl_ratio"] == 1
    vw[1]["ids"] = vw[1]["ids"][::-1]
    with pytest.raises(ValueError, match="window"):
        drift.compare(bw, vw)


def test_drift_windows_from_the_end():
    ids = list(range(100))
    w = drift.windows_from_ids(ids, 3, 30)
    assert w == [ids[10:40], ids[40:70], ids[70:100]]
    with pytest.raises(ValueError, match="too few"):
        drift.windows_from_ids(ids, 4, 30)
    # a model whose tokenizer starts every text with <bos> is scored so: the same windows, <bos> first
    assert drift.windows_from_ids(ids, 3, 30, bos=-1) == [[-1, *ids[11:40]], [-1, *ids[41:70]], [-1, *ids[71:100]]]


def test_admission_counts_whole_sequences_and_the_null_block():
    from pipeline.measure.capacity import admitted

    # 8 blocks of 128, one of them vLLM's null block (measured: tests/test_systems_engine.py)
    assert admitted(8, 128, 256) == 3 and admitted(8, 128, 128) == 7 and admitted(8, 128, 129) == 3
    assert admitted(182, 128, 320, 16) == 16 and admitted(182, 128, 1536, 16) == 15


def test_only_the_two_benign_lm_eval_warnings_are_dropped(caplog):
    import logging

    from pipeline.stages.quality import quiet_lm_eval_warnings

    quiet_lm_eval_warnings()
    quiet_lm_eval_warnings()  # idempotent: one filter per logger
    api, ev = logging.getLogger("lm_eval.models.api_models"), logging.getLogger("lm_eval.evaluator")
    assert len(api.filters) == len(ev.filters) == 1
    with caplog.at_level(logging.WARNING):
        api.warning("Batch size > 1 detected. Ensure your API supports batched requests with varying ...")
        ev.warning("pretrained=/a/long/path appears to be an instruct or chat variant but chat\n  template is not applied.")
        api.warning("Automatic batch size is not supported for API models.")
    assert [r.getMessage() for r in caplog.records] == ["Automatic batch size is not supported for API models."]


def test_lm_eval_asks_no_git_outside_a_repository(tmp_path, monkeypatch, capfd):
    """lm-eval records the working folder's git commit; outside a repository git printed 'fatal: not a git
    repository' through --quiet. The quality stage turns that lookup off."""
    import lm_eval.evaluator

    from pipeline.stages.quality import run_lm_eval

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(lm_eval.evaluator, "get_git_commit_hash", lm_eval.evaluator.get_git_commit_hash)
    run_lm_eval(None, tmp_path, None, {}, tmp_path, "x")  # nothing to score: returns after its set-up
    assert lm_eval.evaluator.get_git_commit_hash() is None
    assert "not a git repository" not in capfd.readouterr().err


def test_a_user_tasks_slices_are_checked_against_its_own_data(tmp_path, monkeypatch):
    """validate reads the slices a user task's local items carry: a gate on a slice no item has
    fails before any engine starts; one the data has, and prompt_len under max_model_len, load."""
    monkeypatch.chdir(tmp_path)
    rows = [{"q": "a", "slices": {"domain": "law"}}, {"q": "b", "slices": {"domain": "medicine"}}]
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mine.yaml").write_text("task: mine\noutput_type: multiple_choice\ndataset_path: json\n"
                                        "dataset_kwargs: {data_files: {test: items.jsonl}}\ntest_split: test\n")

    def recipe_with(scope):
        p = tmp_path / "r.yaml"
        p.write_text(yaml.safe_dump({**base_recipe(suites=["mine.yaml"]), "gates": [
            {"metric": "accuracy_delta", "scope": scope, "op": ">=", "threshold": -0.1}]}))
        return p

    assert load(recipe_with("mine/domain=law")).gates[0].scope == "mine/domain=law"
    assert load(recipe_with("mine/prompt_len=64-127 tok"))
    for scope, msg in (("mine/domain=finance", "no item of mine has domain=finance (its data has law, medicine)"),
                       ("mine/topic=x", "mine's items carry the slices domain"),
                       ("mine/prompt_len=>=4096 tok", "can never hold an item")):
        with pytest.raises(RecipeError, match=re.escape(msg)) as exc:
            load(recipe_with(scope))
        assert "gates.0.scope" in str(exc.value)
    # docs rewritten by process_docs: not knowable before the run, so not refused
    (tmp_path / "mine.yaml").write_text((tmp_path / "mine.yaml").read_text() + "process_docs: !function u.f\n")
    assert load(recipe_with("mine/domain=finance"))
