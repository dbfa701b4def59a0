"""Warm engine starts (pipeline/engines/vllm/launcher.py): an engine forked from a process that has vLLM
imported is the cold start's engine, answers alike, holds no extra copy of the launcher in its tree, and
goes down whole when it is stopped or when the process that started it dies."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from pipeline.engines import vllm
from pipeline.engines.interface import Launch
from pipeline.engines.vllm import launcher
from pipeline.recipe.schema import EngineSpec
from tests import tinymodel

ROOT = Path(__file__).resolve().parent.parent
ENGINE = EngineSpec(max_model_len=256, max_num_seqs=4, kv_cache_gib=0.05)


def _complete(srv) -> dict:
    body = json.dumps({"model": srv.served_name, "prompt": "The quick brown fox jumps over", "max_tokens": 8,
                       "temperature": 0, "logprobs": 3, "seed": 0}).encode()
    req = urllib.request.Request(srv.base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lp = json.loads(r.read())["choices"][0]["logprobs"]
    return {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"]}


def _group(pgid: int) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return out


def _gone(pids, within_s: float) -> list[int]:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.25)
    return alive


@pytest.mark.integration
def test_a_warm_start_is_the_cold_start_forked(tmp_path, monkeypatch):
    model = tinymodel.build(tmp_path / "tiny", seed=11)
    got = {}
    for how in ("cold", "warm", "warm again"):
        monkeypatch.setenv("QE_ENGINE_LAUNCH", how.split()[0])
        log = tmp_path / f"{how.replace(' ', '-')}.log"
        with vllm.launch(Launch(model, ENGINE, "float32", log)) as srv:
            pgid = srv.proc.pid
            members = _group(pgid)
            guard = psutil.Process(pgid)
            guard_cmd, guard_rss = " ".join(guard.cmdline()), guard.memory_info().rss
            # ps and pgrep see the engine as a cold start's (tests find leftovers that way), where it runs
            server = [p for p in members if p != pgid and  # the cold start's guard names the module too
                      "vllm.entrypoints.openai.api_server" in " ".join(psutil.Process(p).cmdline())]
            assert len(server) == 1 and f"--model {model}" in " ".join(psutil.Process(server[0]).cmdline()), how
            assert psutil.Process(server[0]).cwd() == os.getcwd(), how
            assert any("VLLM" in psutil.Process(p).name() for p in members), how  # vLLM's core titles itself
            answer = _complete(srv)
            assert srv.launch == "cold" if how == "cold" else srv.launch.startswith("warm"), (how, srv.launch)
            got[how] = {**answer, "log": log.read_text(errors="replace"), "launch": srv.launch,
                        "launcher": launcher._launcher.proc.pid if how != "cold" else None,
                        "rss": srv.memory.peak_tree_rss, "members": len(members), "guard": guard_cmd,
                        "guard_rss": guard_rss}
        assert not _gone(members, 10), f"{how}: the engine's group outlived its stop"
    assert "QE-LAUNCH warm" in got["warm"]["log"] and "QE-LAUNCH warm" not in got["cold"]["log"]
    assert "QE-ENGINE-CORE-START fork" in got["warm"]["log"]  # the same layout: its core forked from it
    for how in ("warm", "warm again"):
        assert got[how]["tokens"] == got["cold"]["tokens"]
        assert got[how]["logprobs"] == pytest.approx(got["cold"]["logprobs"], abs=1e-5)
        # the tree is a guard, the API server and its engine core, as a cold start's; the guard is a fresh
        # small interpreter, not a copy of the launcher holding its ~1 GiB of imports outside the engine's
        # measured tree (memory.py sums the tree below the guard)
        assert got[how]["members"] == got["cold"]["members"] == 3
        assert "pipeline.engines.engine_guard --pid" in got[how]["guard"], got[how]["guard"]
        assert got[how]["guard_rss"] < 2 * got["cold"]["guard_rss"], (got[how]["guard_rss"], got["cold"]["guard_rss"])
        assert got[how]["rss"] < 1.2 * got["cold"]["rss"], (got[how]["rss"], got["cold"]["rss"])
    # both warm engines were forked from one launcher that had imported vLLM: the second imported nothing
    # again (how much sooner it is ready is the benchmark's to say, not a test's)
    assert got["warm again"]["launcher"] == got["warm"]["launcher"] and launcher._launcher.ready()
    assert got["warm again"]["launch"] == "warm"  # no wait for an import: its start time says so


def test_an_exit_code_half_written_is_not_read_as_the_engines(tmp_path):
    """The guard writes the engine's exit code into a file the pipeline polls; read while it is being
    written (empty) with the guard alive, it is no code yet, not the -1 of an engine killed by a signal."""
    guard = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        exit_file = tmp_path / "engine.exit"
        proc = launcher.WarmProc(guard.pid, exit_file)
        assert proc.poll() is None
        exit_file.write_text("")
        assert proc.poll() is None
        exit_file.write_text("3")
        assert proc.poll() == 3
    finally:
        guard.kill()
        guard.wait()


def test_a_node_short_of_memory_for_an_engine_beside_the_launcher_gets_the_launchers_memory(tmp_path, monkeypatch):
    """The launcher holds its import of vLLM outside every engine. Where the node cannot hold the budget's
    engine beside it, it stands aside (for the rest of the run) and the node is read again; without a
    launcher to free, the start fails naming the budget."""
    from pipeline.engines.interface import EngineError
    from pipeline.engines.vllm import server as vserver

    reads, said = [], []
    running = {"launcher": True}

    def fraction(budget, outside, tp):
        reads.append(running["launcher"])
        if running["launcher"]:
            raise ValueError("their NUMA node has 1.00 of 8.00 GiB available now")
        return {"fraction": 0.5}

    def stand_aside():
        was, running["launcher"] = running["launcher"], False
        return was

    monkeypatch.setattr(vserver, "sized_fraction", fraction)
    monkeypatch.setattr(vserver, "launcher_stand_aside", stand_aside)
    srv = vserver.Server(Launch(tmp_path, ENGINE, "float32", tmp_path / "e.log", memory_budget_bytes=2 << 30,
                                outside_bytes=0, say=said.append))
    assert srv._sized() == {"fraction": 0.5} and reads == [True, False] and "stands aside" in said[0]
    running["launcher"] = True
    monkeypatch.setattr(vserver, "launcher_stand_aside", lambda: False)  # nothing to free
    with pytest.raises(EngineError, match="engine.memory_budget_gib: their NUMA node"):
        srv._sized()


@pytest.mark.integration
def test_an_engine_whose_launch_was_never_answered_goes_down_with_the_launcher(tmp_path, monkeypatch):
    """A launch given up at its deadline leaves the launcher's answer unread: the engine it forked is nobody's
    to stop, so closing the launcher stops it (here a stand-in server module, forked as an engine is)."""
    monkeypatch.setenv("QE_ENGINE_LAUNCH", "warm")
    warm = launcher.Launcher(vllm.server.launch_env())
    try:
        req = {"module": "http.server", "argv": ["--bind", "127.0.0.1", "0"], "env": warm.env, "cwd": str(tmp_path),
               "log": str(tmp_path / "e.log"), "exit_file": str(tmp_path / "e.exit"), "owner": os.getpid()}
        warm.sock.sendall((json.dumps(req) + "\n").encode())
        ready, _, _ = select.select([warm.sock], [], [], 300)
        assert ready, "the launcher did not answer"
        time.sleep(0.5)  # the whole line
        pgid = json.loads(warm.sock.recv(1 << 16, socket.MSG_PEEK).split(b"\n")[0])["pid"]
        members = _group(pgid)
        assert len(members) == 2  # the guard and the stand-in engine, serving
        folder = warm.dir
    finally:
        warm.close()
    assert not _gone(members, 10), "an engine nobody was told of outlived its launcher"
    assert not folder.exists()


@pytest.mark.integration
def test_a_launch_whose_import_time_environment_differs_gets_its_own_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("QE_ENGINE_LAUNCH", "warm")
    warm = launcher.get(vllm.server.launch_env())
    assert warm.serves(vllm.server.launch_env({"VLLM_CPU_INT4_W4A8": "1"}))  # read when used: may differ
    # lm_eval sets this in the pipeline's process when the first quality pass imports it, after the
    # launcher started: every later engine of a run started cold until it was let through
    assert warm.serves({**vllm.server.launch_env(), "HF_XET_HIGH_PERFORMANCE": "1"})
    changed = {**vllm.server.launch_env(), "QE_ENGINE_CORE_START": "spawn"}  # read when vLLM's platform loads
    assert warm.differs(changed) == ["QE_ENGINE_CORE_START"]
    assert warm.launch("x", [], changed, tmp_path / "x.log", time.perf_counter(), 60) is None
    other = launcher.get(changed)
    assert other is not warm and other.serves(changed) and warm.closed and warm.proc.wait(timeout=30) is not None


@pytest.mark.integration
def test_a_warm_engine_dies_with_the_process_that_started_it(tmp_path):
    model = tinymodel.build(tmp_path / "tiny", seed=12)
    script = tmp_path / "hold.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys, time
        from pathlib import Path
        os.environ["QE_ENGINE_LAUNCH"] = "warm"
        from pipeline.engines import vllm
        from pipeline.engines.interface import Launch
        from pipeline.engines.vllm import launcher
        from pipeline.recipe.schema import EngineSpec
        srv = vllm.launch(Launch(Path({str(model)!r}), EngineSpec(max_model_len=256, max_num_seqs=4, kv_cache_gib=0.05),
                                 "float32", Path({str(tmp_path / "engine.log")!r})))
        srv.__enter__()
        print(json.dumps({{"guard": srv.proc.pid, "launcher": launcher._launcher.proc.pid}}), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line, "the holding process died before its engine was ready"
        pids = json.loads(line)
        tree = _group(pids["guard"])
        assert len(tree) == 3 and "QE-LAUNCH warm" in (tmp_path / "engine.log").read_text()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = _gone([*tree, pids["launcher"]], 30)
    assert not left, f"outlived the process that started them: {left}"
