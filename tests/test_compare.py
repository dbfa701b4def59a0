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
    assert "v4: accuracy 0.600 -> 0.200" in out and "REGRESSION (95% CIs do not overlap)" in out
    assert "tpot p50 40.0 -> 56.0 ms (+40%)  REGRESSION" in out


def test_different_hardware_is_said_loudly(tmp_path, capsys):
    a = finished(tmp_path / "a", {"piqa": [1] * 60 + [0] * 40})
    b = finished(tmp_path / "b", {"piqa": [1] * 60 + [0] * 40})
    m = json.loads((b / "manifest.json").read_text())
    m["hardware"] = {"cpus": 64}
    write_json(b / "manifest.json", m)
    render_run(b)
    assert cli.main(["compare", str(a), str(b)]) == 3
    assert "NOT LIKE FOR LIKE: the runs differ in hardware" in capsys.readouterr().out


def test_missing_run_is_exit_2(tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path / "x"), str(tmp_path / "y")]) == 2
    assert "results.json: not found" in capsys.readouterr().err
