"""The A/A pass: the first items of each suite scored again under another batching, and every item of a suite
only when one of its numbers moved (pipeline/stages/quality.py, noise_floor)."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.stages import quality

SUITES = [SimpleNamespace(name="piqa", task="qe_piqa"), SimpleNamespace(name="asdiv", task="qe_asdiv")]
RECIPE = SimpleNamespace(quality=SimpleNamespace(num_concurrent=2, batch_size=8))


def first_pass() -> dict:
    piqa = {i: {"doc_id": i, "correct": i % 2, "loglikelihoods": [-1.0 - i, -2.0]} for i in range(120)}
    asdiv = {i: {"doc_id": i, "correct": 1, "output": f"{i}"} for i in range(80)}
    return {"piqa": piqa, "asdiv": asdiv}


def run_noise_floor(monkeypatch, moved: dict) -> tuple[dict, list]:
    """noise_floor against a stand-in for lm-eval whose second pass returns the first pass's rows, with
    `moved` (suite -> {doc_id: row changes}) applied."""
    first, calls = first_pass(), []

    def fake_lm_eval(server, model_dir, recipe, by_limit, tasks_dir, label, batching=None, limit=None):
        asked = [r for group in by_limit.values() for r in group]
        calls.append((label, batching, limit, [r.name for r in asked]))
        return {r.task: r.name for r in asked}, {}, {}

    def fake_score(suite, samples, config, tok, utils):
        limit = calls[-1][2]
        rows = [{**row, **moved.get(suite.name, {}).get(i, {})} for i, row in first[suite.name].items()]
        return rows[:limit], "acc_norm"

    monkeypatch.setattr(quality, "run_lm_eval", fake_lm_eval)
    monkeypatch.setattr(quality, "score_items", fake_score)
    out = quality.noise_floor(None, None, RECIPE, {None: SUITES}, None, SUITES, first, None, None, {})
    return out, calls


def test_an_engine_that_gives_the_same_numbers_back_is_not_scored_twice(monkeypatch):
    """float32 on CPU: the probe's numbers come back bit for bit, so no item can flip and the other
    items are not scored again; what was scored is the n the report shows."""
    out, calls = run_noise_floor(monkeypatch, {})
    assert calls == [("baseline A/A", (4, 3), quality.AA_PROBE, ["piqa", "asdiv"])]
    assert {k: (v.n, v.flips, v.identical) for k, v in out.items()} == {"piqa": (50, 0, True), "asdiv": (50, 0, True)}
    assert "bit-identical" in out["piqa"].how and "not scored again" in out["piqa"].how


def test_one_number_that_moved_scores_every_item_of_its_suite_again(monkeypatch):
    """One log-likelihood (or one generated text) that differs in the probe, even without a flip, and every
    item of that suite is scored again, its flips counted on every item; a suite whose probe came back bit for
    bit is not scored again (one suite's movement says nothing of another's)."""
    moved = {"piqa": {3: {"loglikelihoods": [-4.0000001, -2.0]}, 101: {"correct": 0, "loglikelihoods": [-9.0, -2.0]}}}
    out, calls = run_noise_floor(monkeypatch, moved)
    assert [(c[2], c[3]) for c in calls] == [(quality.AA_PROBE, ["piqa", "asdiv"]), (None, ["piqa"])]
    assert (out["piqa"].n, out["piqa"].flips_correct_to_wrong, out["piqa"].identical) == (120, 1, False)
    assert (out["asdiv"].n, out["asdiv"].identical) == (50, True) and "not scored again" in out["asdiv"].how
    assert out["piqa"].how.startswith("every item")
    out, calls = run_noise_floor(monkeypatch, {"asdiv": {7: {"output": "8"}}})
    assert calls[1][3] == ["asdiv"] and out["asdiv"].identical is False and out["asdiv"].n == 80
    assert out["piqa"].n == 50 and out["piqa"].identical


def test_a_probe_that_held_every_item_is_the_whole_pass(monkeypatch):
    monkeypatch.setattr(quality, "AA_PROBE", 500)
    out, calls = run_noise_floor(monkeypatch, {"piqa": {3: {"loglikelihoods": [-4.5, -2.0]}}})
    assert len(calls) == 1 and (out["piqa"].n, out["piqa"].identical) == (120, False)
    assert out["piqa"].how.startswith("every item")
