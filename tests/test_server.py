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
