"""The engine-agreement check's comparison and rule (stages/agreement.py), without engines; the check on
real engines, and a planted disagreement, are in test_integration."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.results import SuiteAgreement
from pipeline.stages import agreement


def rows(lls: list[list[float]], preds: list[int]) -> list[dict]:
    return [{"doc_id": i, "loglikelihoods": ll, "pred": p} for i, (ll, p) in enumerate(zip(lls, preds, strict=True))]


def test_rounding_is_agreement_and_a_moved_number_is_not():
    served = {r["doc_id"]: r for r in rows([[-10.0, -12.0], [-3.0, -3.0000001]], [0, 0])}
    # float32 rounding, and a near-tie that swapped: not a disagreement
    ok = agreement.compare(served, rows([[-10.000001, -12.000002], [-3.0000001, -3.0]], [0, 1]))
    assert ok.n == 2 and ok.same_answer == 1 and ok.max_rel_diff < 1e-6
    flagged, why = agreement.verdict({"piqa": ok}, agreement.TOLERANCE["float32"], "float32")
    assert not flagged and "within" in why
    # one choice's log-likelihood moved by 2 %: the engines do not compute the same model
    bad = agreement.compare(served, rows([[-10.0, -12.24], [-3.0, -3.0000001]], [0, 0]))
    assert bad.worst_doc_id == 0 and abs(bad.max_rel_diff - 0.02) < 1e-9
    flagged, why = agreement.verdict({"piqa": ok, "siqa": bad}, agreement.TOLERANCE["float32"], "float32")
    assert flagged and "siqa" in why
    # the same difference is within what bfloat16 rounding explains
    assert not agreement.verdict({"siqa": bad}, agreement.TOLERANCE["bfloat16"], "bfloat16")[0]


def test_small_log_likelihoods_are_compared_in_absolute_terms():
    """|LL| below 1 would make a relative difference explode on rounding noise."""
    served = {0: {"doc_id": 0, "loglikelihoods": [-1e-6], "pred": 0}}
    s = agreement.compare(served, rows([[-2e-6]], [0]))
    assert s.max_rel_diff < 1e-5


def test_generated_text_is_compared_whole():
    served = {0: {"doc_id": 0, "output": "42"}, 1: {"doc_id": 1, "output": "7"}}
    s = agreement.compare(served, [{"doc_id": 0, "output": "42"}, {"doc_id": 1, "output": "8"}])
    assert s.same_answer == 1 and s.max_rel_diff is None
    assert agreement.verdict({"asdiv": s}, 1e-3, "float32") == (False, "no log-likelihoods compared")


def test_an_item_only_the_reference_scored_is_an_error():
    try:
        agreement.compare({}, rows([[-1.0]], [0]))
    except ValueError as exc:
        assert "item 0" in str(exc)
    else:
        raise AssertionError("a missing item passed")


def test_what_the_reference_cannot_compute_is_skipped_with_the_reason(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    assert "gptq" in agreement.unsupported(tmp_path, "auto", None)
    assert "FP8" in agreement.unsupported(tmp_path, "fp8", None)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "compressed-tensors"}}))
    assert agreement.unsupported(tmp_path, "auto", None) is None
    assert "bitsandbytes" in agreement.unsupported(tmp_path, "auto", "bitsandbytes")
    (tmp_path / "config.json").write_text("{}")
    assert agreement.unsupported(tmp_path, "auto", None) is None


def test_a_result_reads_back():
    r = SuiteAgreement(n=3, same_answer=3, max_rel_diff=1e-7, median_rel_diff=1e-8, worst_doc_id=2)
    assert SuiteAgreement.model_validate_json(r.model_dump_json()) == r


def test_the_gpu_check_fails_on_a_failed_or_disagreeing_variant(monkeypatch):
    """benchmarks/gpu_check.sh runs hardware_matrix.py --strict: it exits 0 only when every variant ran or was
    SKIPPED with its reason, and the reference engine agrees with every one it checked."""
    import importlib
    import sys

    monkeypatch.setenv("QE_IN_ENGINE_ENV", "1")  # already in the engine environment: no re-exec
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    hm = importlib.import_module("hardware_matrix")
    sys.modules.pop("hardware_matrix", None)
    row = lambda name, served, agrees: [name, "native", "W8A8", served, agrees, "1", "2", "0.7", ""]  # noqa: E731
    ok = [row("baseline", "yes", "yes (within 1e-07)"), row("fp8", "no", "–"), row("awq", "quality only", "yes (x)")]
    assert hm.failures(ok) == []
    assert hm.failures([*ok, row("w8a8", "yes", "NO (log-likelihoods differ)")]) == ["w8a8"]
    assert hm.failures([*ok, row("gptq", "FAILED: engine exited", "–")]) == ["gptq"]
    assert hm.failures([*ok, row("int8", "yes", "failed: EngineError")]) == ["int8"]


def test_the_reference_scores_each_suite_in_the_lm_eval_call_quality_made():
    """One grouping for both passes: a user task's own limit (keyed by its recipe entry, a path) caps the
    reference's sample as it capped the serving pass, so no item is scored by one engine only."""
    from types import SimpleNamespace

    from pipeline.stages import quality

    q = SimpleNamespace(suites=("piqa", "tasks/mine.yaml", "drift"),
                        limit_of=lambda entry: {"tasks/mine.yaml": 7}.get(entry, 200))
    refs = [SimpleNamespace(name="piqa", kind="mc"), SimpleNamespace(name="mine", kind="user"),
            SimpleNamespace(name="drift", kind="drift")]
    groups = quality.lm_eval_groups(q, refs)
    assert {k: [r.name for r in v] for k, v in groups.items()} == {None: ["piqa"], 7: ["mine"]}
