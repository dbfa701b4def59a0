"""The run folder and atomic writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.runstore import atomic_dir, open_run


def test_run_folder_is_absolute_whatever_the_cwd(tmp_path, monkeypatch):
    """A relative runs_dir is resolved where the user started the run: the quantize worker runs from
    the repository's root and once got a relative path that did not exist there."""
    monkeypatch.chdir(tmp_path)
    run, resumed = open_run(Path("runs"), "r", "h")
    assert run.root.is_absolute() and run.root.parent == tmp_path / "runs" and not resumed


def test_atomic_dir_publishes_whole_or_not_at_all(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
        assert not target.exists()  # nothing visible while it is written
    assert (target / "a").read_text() == "1"
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("killed mid-write")
    assert (target / "a").read_text() == "1" and not list(tmp_path.glob("ckpt.tmp*"))
    with atomic_dir(tmp_path / "empty"):
        pass  # a producer with nothing to write publishes nothing
    assert not (tmp_path / "empty").exists()
    with atomic_dir(target, replace=False) as tmp:
        (tmp / "a").write_text("3")
    assert (target / "a").read_text() == "1"  # kept: another writer published it first


def test_a_dead_writers_half_folder_is_swept_but_not_another_hosts(tmp_path):
    import socket

    dead = tmp_path / "ckpt.tmp999999999"
    dead_here = tmp_path / f"ckpt.tmp999999998@{socket.gethostname()}"
    elsewhere = tmp_path / "ckpt.tmp1@another-node"  # a live writer on another node of a shared cache
    for d in (dead, dead_here, elsewhere):
        d.mkdir()
    with atomic_dir(tmp_path / "ckpt") as tmp:
        (tmp / "a").write_text("1")
    assert not dead.exists() and not dead_here.exists() and elsewhere.exists()


def test_a_folder_that_cannot_be_published_is_an_error_not_silence(tmp_path, monkeypatch):
    import os

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError), atomic_dir(tmp_path / "ckpt") as tmp:
        (tmp / "a").write_text("1")
    assert not list(tmp_path.iterdir())  # and nothing half-made is left


def _finished_run(tmp_path):
    """A finished run (verdict WARN, a search answer beside it) and the recipe that resumes it."""
    import json

    import yaml

    from pipeline.recipe.schema import Recipe
    from pipeline.run import runner
    from pipeline.runstore import write_json
    from pipeline.stages.signoff import signoff
    from reports.render import render_run
    from tests import minirun, tinymodel

    model = tinymodel.build(tmp_path / "tiny")
    d = minirun.recipe([]).model_dump(mode="json")
    d.update(model={"path": str(model)}, runs_dir=str(tmp_path / "runs"))
    d["engine"]["max_model_len"] = 512
    r = Recipe.model_validate(d)
    old = minirun.make_run(tmp_path / "runs" / f"{r.name}-20260101T000000Z", r, {"piqa": [1, 0]}, {"piqa": [1, 0]})
    m = json.loads((old / "manifest.json").read_text())
    write_json(old / "manifest.json", {**m, "identity": runner.identity_of(r, tmp_path / "r.yaml")})  # its own run
    write_json(old / "signoff.json", signoff(r, "h", old, minirun.load_results(old)))
    write_json(old / "search" / "search.json", {"error": "the last run's search banner", "answer": None})
    render_run(old)
    assert json.loads((old / "results.json").read_text())["signoff"]["verdict"] == "WARN"
    assert "the last run&#x27;s search banner" in (old / "report.html").read_text()
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(d))
    return r, path, old


def _shows_no_verdict(old) -> None:
    import json

    assert not (old / "signoff.json").exists() and not (old / "search" / "search.json").exists()
    res = json.loads((old / "results.json").read_text())
    assert res["signoff"] is None and "search" not in res
    html = (old / "report.html").read_text()
    assert "INCOMPLETE" in html and "VERDICT: WARN" not in html and "search banner" not in html
    assert (old / "results.csv").read_text().count("\n") == 1  # the header alone: no earlier rows


def test_a_rerun_that_dies_leaves_no_earlier_verdict_behind(tmp_path, monkeypatch):
    """The moment a rerun starts, the folder's page, JSON and CSV say INCOMPLETE and the search's answer is
    gone: a rerun killed after that point (here: it never gets further) cannot leave the previous verdict
    on show."""
    from pipeline.run import runner

    r, path, old = _finished_run(tmp_path)
    monkeypatch.setattr(runner, "preflight", lambda *a: None)  # no data is needed to start
    ctx, _ = runner.start(r, path, fresh=False)
    assert ctx.run_dir.root == old  # resumed
    _shows_no_verdict(old)


def test_a_resumed_run_keeps_its_first_start_and_names_each_invocation(tmp_path, monkeypatch):
    """The sign-off run on the AVX2 kind was cut after 3 h and resumed for its last 10 minutes; the
    report's provenance then said it started at the resume, as if those 10 minutes had measured it all."""
    import json

    from pipeline.run import runner
    from reports.render import render_run

    r, path, old = _finished_run(tmp_path)
    monkeypatch.setattr(runner, "preflight", lambda *a: None)
    for _ in range(2):
        runner.start(r, path, fresh=False)
    m = json.loads((old / "manifest.json").read_text())
    assert m["started_utc"] == "2026-11-30T00:00:00Z"  # the first invocation's, kept
    assert len(m["invocations_utc"]) == 3 and m["invocations_utc"][0] == m["started_utc"]
    render_run(old)
    assert "2026-11-30T00:00:00Z / –; resumed 2 time(s), at " in (old / "report.html").read_text()
    (old / "manifest.json").write_text("{ cut short")  # a manifest that cannot be read: this start is the first
    assert runner.invocations(old / "manifest.json", "now") == {"started_utc": "now", "invocations_utc": ["now"]}


def test_a_rerun_killed_while_it_hashes_the_weights_shows_no_verdict(tmp_path, monkeypatch):
    """Killed in the gap between opening the folder and drawing its page (the weights are hashed there:
    seconds on a real model), the old page and JSON showed the last verdict, reproduced through the CLI."""
    from pipeline.run import runner

    r, path, old = _finished_run(tmp_path)
    monkeypatch.setattr(runner, "preflight", lambda *a: None)

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.provenance, "model_hashes", killed)
    with pytest.raises(KeyboardInterrupt):
        runner.start(r, path, fresh=False)
    _shows_no_verdict(old)


def test_a_page_that_cannot_be_drawn_at_the_start_stops_the_run(tmp_path, monkeypatch):
    """A render failure at the start was swallowed, and the run went on to an end it could not draw."""
    import reports.render
    from pipeline.run import runner
    from pipeline.run.preflight import PreflightError

    r, path, old = _finished_run(tmp_path)
    monkeypatch.setattr(runner, "preflight", lambda *a: None)

    def broken(*a, **k):
        raise ValueError("a bad systems.json")

    monkeypatch.setattr(reports.render, "render_html", broken)
    with pytest.raises(PreflightError, match="the report cannot be rendered .*a bad systems.json"):
        runner.start(r, path, fresh=False)
    _shows_no_verdict(old)


def test_a_stage_measured_again_keeps_no_earlier_origin(tmp_path, monkeypatch):
    """A result fetched from the cache leaves <stage>.origin.json beside it; measured again later (its
    key changed), that file stayed, and the report said 'reused from the result cache' of a fresh result."""
    import pipeline.stages.evaluate as evaluate_stage
    from pipeline.run import runner
    from pipeline.runstore import write_json
    from pipeline.stages.evaluate import ServeJob
    from pipeline.store.outcome import Spent

    r, path, old = _finished_run(tmp_path)
    monkeypatch.setattr(runner, "preflight", lambda *a: None)
    ctx, _ = runner.start(r, path, fresh=False)
    for stage in ("quality", "systems"):
        write_json(old / "baseline" / f"{stage}.origin.json", {"run": "an earlier run", "variant": "baseline"})
    measured = []
    monkeypatch.setattr(evaluate_stage, "evaluate", lambda job, *a, **k: measured.append(job.name) or (None, None))
    runner.evaluate_variant(ctx, ServeJob("baseline", ctx.model_dir, "weights-of-another-key"), Spent())
    assert measured == ["baseline"]  # its keys changed: both stages measured again
    assert not (old / "baseline" / "quality.origin.json").exists()
    assert not (old / "baseline" / "systems.origin.json").exists()


def test_a_second_run_of_a_recipe_exits_2_naming_the_first(tmp_path):
    import subprocess
    import sys
    import time

    import yaml

    from tests import minirun

    d = minirun.recipe([]).model_dump(mode="json")
    d["runs_dir"] = str(tmp_path / "runs")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(d))
    root = Path(__file__).resolve().parent.parent
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from pipeline.runstore import run_lock\n"
                               f"with run_lock(Path({str(tmp_path / 'runs')!r}), {d['name']!r}, "
                               f"Path({str(tmp_path / 'home' / 'locks')!r})):\n"
                               "    print('held', flush=True); time.sleep(60)"],
                              cwd=root, stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(root)})
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "pipeline.cli", str(tmp_path / "r.yaml")], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin",
                                   "QUANTIZE_EVAL_HOME": str(tmp_path / "home")})
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"is already running (pid {holder.pid} on" in proc.stderr and time.time() - t0 < 60
    finally:
        holder.kill()
        holder.wait()


def test_an_unreachable_ray_cluster_fails_at_once_in_one_line(tmp_path):
    import subprocess
    import sys
    import time

    import yaml

    from tests import minirun

    d = minirun.recipe([]).model_dump(mode="json")
    d["runs_dir"] = str(tmp_path / "runs")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(d))
    root = Path(__file__).resolve().parent.parent
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", str(tmp_path / "r.yaml"), "--ray", "127.0.0.1:9"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "executor.address: the Ray cluster at 127.0.0.1:9 does not answer" in proc.stderr
    assert time.time() - t0 < 60 and not list((tmp_path / "runs").glob("*-*"))  # no run folder


def test_a_port_that_is_not_ray_fails_at_once_in_one_line(tmp_path):
    """A port that accepts TCP but is not Ray (here an HTTP server) passed the check and ended, after the
    run folder was reset, in Ray's traceback."""
    import http.server
    import subprocess
    import sys
    import threading

    import yaml

    from tests import minirun

    srv = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    d = minirun.recipe([]).model_dump(mode="json")
    d["runs_dir"] = str(tmp_path / "runs")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(d))
    root = Path(__file__).resolve().parent.parent
    try:
        proc = subprocess.run([sys.executable, "-m", "pipeline.cli", str(tmp_path / "r.yaml"), "--ray",
                               f"127.0.0.1:{srv.server_port}"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    finally:
        srv.shutdown()
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"127.0.0.1:{srv.server_port} answers, but not as a Ray cluster does" in proc.stderr
    assert not list((tmp_path / "runs").glob("*-*"))


def test_ray_auto_without_a_cluster_fails_in_one_line(tmp_path, monkeypatch):
    import psutil

    from pipeline.recipe.schema import Recipe
    from pipeline.run import preflight
    from tests import minirun

    d = minirun.recipe([]).model_dump(mode="json")
    d["executor"] = {"kind": "ray", "address": "auto"}
    r = Recipe.model_validate(d)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # no cluster recorded by `ray start`
    monkeypatch.setattr(psutil, "process_iter", lambda *a, **k: iter(()))  # and no GCS server running
    with pytest.raises(preflight.PreflightError, match="executor.address: auto found no Ray cluster"):
        preflight.check_ray_address(r)
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:9\n")  # recorded, but gone
    with pytest.raises(preflight.PreflightError, match="the Ray cluster at 127.0.0.1:9 does not answer"):
        preflight.check_ray_address(r)


def test_a_recipe_resumes_only_its_own_folder(tmp_path):
    """Same name, another recipe file: never resumes into the folder; the same file edited (a variant
    added) does."""
    import json

    from pipeline.run import runner
    from pipeline.runstore import write_json
    from tests import minirun

    r, mine, other = minirun.recipe([]), tmp_path / "recipes" / "awq.yaml", tmp_path / "elsewhere" / "awq.yaml"
    first, _ = open_run(tmp_path / "runs", r.name, runner.identity_of(r, mine))
    write_json(first.manifest, {"recipe_name": r.name, "identity": runner.identity_of(r, mine)})
    more = r.model_copy(update={"variants": (*r.variants, r.variants[0].model_copy(update={"name": "v8"}))})
    again, resumed = open_run(tmp_path / "runs", r.name, runner.identity_of(more, mine))
    assert resumed and again.root == first.root
    new, resumed = open_run(tmp_path / "runs", r.name, runner.identity_of(r, other))
    assert not resumed and new.root != first.root
    assert json.loads(first.manifest.read_text())["identity"] == runner.identity_of(r, mine)  # untouched
