"""The runtime reserve: what an engine holds besides its weights and its KV pool, measured once per run.

A budget run (pipeline/measure/membudget.py) starts each engine with budget - weights - reserve as its KV
pool. The reserve (interpreter, vLLM, the API server, activations, logits) must be one measured
figure for every variant, never a guess. One probe engine of the base model is started with a small
pool, driven as hard as serving will drive it (a max_model_len prompt, then the run's largest decode
batch of the workload's shape), and its process tree's kernel high-water mark read:
reserve = peak - parameters the engine reported loading - pool.

The figure is written to the run folder (every variant of the run, on any Ray node, reads that one)
and to the result cache under its key (the base model, engine settings but the pool, dtype, engine
environment, hardware, workload shape, and this code).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import socket
import time
from pathlib import Path

from pipeline import progress
from pipeline.engines import interface
from pipeline.engines.interface import Engine, Launch
from pipeline.measure import capacity, loadgen
from pipeline.measure.prompts import PromptStream
from pipeline.runstore import hash_obj, write_json
from pipeline.setup import envs, modelcfg
from pipeline.store import outcome, provenance
from pipeline.store.keys import source_hash
from pipeline.store.outcome import Spent

RESERVE_KEY_VERSION = 2  # 2: serving load only (no prompt log-probabilities)
POOL_FIELDS = {"memory_budget_gib", "kv_cache_gib", "gpu_memory_utilization", "startup_timeout_s"}


def reserve_key(recipe, model_hash: str, dtype: str) -> str:
    w = recipe.workload
    return hash_obj({
        "version": RESERVE_KEY_VERSION, "model": model_hash, "dtype": dtype,
        "engine": recipe.engine.model_dump(exclude=POOL_FIELDS),
        "shape": [w.prompt_tokens, w.output_tokens, batch(recipe)],
        "engine_env": envs.requirements_file("engine").read_text(), "hardware": provenance.hardware(),
        "code": source_hash(Path(__file__)),
    })


def _cached(path: Path, key: str) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if d.get("key") == key else None


def cached_reserve(recipe, model_dir: Path, dtype: str) -> dict | None:
    """The reserve this host measured before for this model and these settings, if any (validate)."""
    model_hash = hash_obj(provenance.model_hashes(model_dir))
    return _cached(envs.home() / "results" / "reserve" / f"{reserve_key(recipe, model_hash, dtype)}.json",
                   reserve_key(recipe, model_hash, dtype))


def reserve_for(recipe, run_root: Path, model_dir: Path, model_hash: str, dtype: str, log=print) -> dict:
    """The run's reserve: from its folder, else the result cache, else measured now (one process at a
    time: a lock in the run folder, which every Ray node shares)."""
    key = reserve_key(recipe, model_hash, dtype)
    here = run_root / "reserve.json"
    cached = envs.home() / "results" / "reserve" / f"{key}.json"
    if (d := _cached(here, key)) is not None:
        return d
    run_root.mkdir(parents=True, exist_ok=True)
    with open(run_root / "reserve.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (d := _cached(here, key)) is not None:
            return d
        if (d := _cached(cached, key)) is not None:
            log(f"runtime reserve: {d['reserve_bytes'] / 2**30:.2f} GiB, measured earlier ({d['measured_at']})")
        else:
            log("runtime reserve: measuring with a probe engine (once per model, engine settings and host)")
            t0, t_perf = time.time(), time.perf_counter()
            try:
                d = {"key": key, **measure(recipe, model_dir, dtype, run_root / "reserve-engine.log",
                                           say=None if progress.quiet() else log)}
            finally:  # the probe engine counts in the run's engine starts and busy seconds
                outcome.record(run_root, "baseline", "reserve", t0, Spent(1, time.perf_counter() - t_perf))
            with contextlib.suppress(OSError):
                cached.parent.mkdir(parents=True, exist_ok=True)
                write_json(cached, d)
            log(f"runtime reserve: {d['reserve_bytes'] / 2**30:.2f} GiB (peak {d['peak_bytes'] / 2**30:.2f} GiB "
                f"- weights {d['weights_bytes'] / 2**30:.2f} - pool {d['pool_bytes'] / 2**30:.2f})")
        write_json(here, d)
        return d


def probe_pool(recipe, cfg: dict, kv_elem_bytes: int) -> int:
    """A pool for one max_model_len sequence plus the largest decode batch of the workload's shape."""
    e, w = recipe.engine, recipe.workload
    lay = capacity.layout(cfg, kv_elem_bytes, tp=e.tensor_parallel_size)
    return lay.pool_for(e.max_model_len, 1) + lay.pool_for(w.prompt_tokens + w.output_tokens, batch(recipe))


def batch(recipe) -> int:
    """The largest decode batch the run will send: max_num_seqs when the admission probe ramps to it,
    else the workload's highest concurrency."""
    e, w = recipe.engine, recipe.workload
    if w.admission_probe:
        return e.max_num_seqs
    return min(e.max_num_seqs, max([w.concurrency, *(c.concurrency for c in w.matrix)]))


def drive(server: Engine, recipe, model_dir: Path) -> None:
    """The heaviest serving load the run puts on an engine: a max_model_len prompt (its prefill's
    activations), then its largest decode batch. Like vLLM's own memory profiling on GPUs, this is the
    worst case the engine can be sent while serving, so a run's serving peak sits at or below the
    budget; a variant's kernels may still need a little more (the capacity table shows each engine's
    peak beside the budget). Prompt log-probabilities, which only the quality stage asks for, are an
    evaluation artifact outside the budget."""
    from transformers import AutoTokenizer

    e, w = recipe.engine, recipe.workload
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=recipe.model.trust_remote_code)
    stream = PromptStream(tok)
    loadgen.run_closed_loop(server.port, server.served_name, stream.take(1, e.max_model_len - 8), 4, 1,
                            w.request_timeout_s * 4)
    conc = batch(recipe)
    prompts = stream.take(conc, w.prompt_tokens)
    loadgen.run_closed_loop(server.port, server.served_name, prompts, w.output_tokens, conc, w.request_timeout_s)


def measure(recipe, model_dir: Path, dtype: str, log_path: Path, say=None) -> dict:
    """Start the probe engine, drive it, and take the reserve from its peak memory (`say`: where the probe
    reports its steps)."""
    pool = probe_pool(recipe, modelcfg.read(model_dir), provenance.dtype_bytes(dtype))
    server = interface.kind(recipe.engine.kind).launch(Launch(
        model_dir, recipe.engine, dtype, log_path, recipe.model.trust_remote_code, kv_pool_bytes=pool, say=say))
    with server, server.blamed_for_errors():
        if say is not None:
            say(f"runtime reserve: probe engine ready in {server.start_s:.0f} s; serving its heaviest load")
        with progress.Heartbeat("runtime reserve: heaviest load", label="reserve"):
            drive(server, recipe, model_dir)
        time.sleep(0.5)  # one more memory sample after the last request
        server.stop()
    loaded = server.loaded_weights()
    if not loaded:
        raise RuntimeError(f"the probe engine did not report its loaded weights (log: {log_path}); "
                           "set engine.kv_cache_gib to run with a fixed pool instead")
    peak = server.memory.peak_tree_hwm or server.memory.peak_tree_rss
    return {"reserve_bytes": peak - loaded["parameters"] - pool, "peak_bytes": peak,
            "weights_bytes": loaded["parameters"], "pool_bytes": pool, "host": socket.gethostname(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "source": f"measured on {socket.gethostname()}: peak resident memory (kernel high-water mark) of a "
                      f"probe engine of the base model (pool {pool / 2**20:.0f} MiB, a max_model_len prompt + the largest "
                      "decode batch) - its weights - its pool"}
