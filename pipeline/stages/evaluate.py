"""Evaluate one variant from a single engine start: quality, then systems (and the admission ramp).

Starting vLLM is the dearest step of a small evaluation; measuring quality and latency by hand
pays it twice. One server per variant serves lm-eval and the drift pass (stages/quality.py), then the latency
workload and memory/KV figures (stages/systems.py), then, if the recipe asks, the admission
ramp (stages/admission.py). Quality runs first so its requests warm nothing the latency cells
measure: latency prompts are distinct text. Each measured part is its own module; this one
only starts the engine and calls them.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from pipeline.store import provenance
from pipeline.engines.server import Server
from pipeline.results import QualityResult, SystemsResult
from pipeline.runstore import write_json
from pipeline.stages import admission, quality, systems


def logprob_args(recipe) -> list[str]:
    """The drift suite's top-k above vLLM's default cap of 20: raised for every variant alike."""
    k = recipe.quality.drift.top_k
    return ["--max-logprobs", str(k)] if "drift" in recipe.quality.suites and k > 20 else []


def evaluate(model_dir: Path, recipe, variant: str, vdir: Path, dtype: str,
             need_quality: str | None, need_systems: str | None, tasks_dir: Path,
             log=print, extra_args: list[str] | None = None,
             spent=None, plan=None, numerics: dict | None = None) -> tuple[QualityResult | None, SystemsResult | None]:
    """Start one engine; run whichever of quality/systems are missing (their input hashes).
    `spent` (an outcome.Spent) is charged the engine start and the engine's busy seconds; `plan`
    (a results.BudgetPlan) is the KV pool it is started with; `numerics` the engine environment that changes
    what it computes (server.numerics_env)."""
    extra_args = list(extra_args or []) + logprob_args(recipe)
    with one_measuring_engine_per_host(bool(need_systems), log):
        return _evaluate(model_dir, recipe, variant, vdir, dtype, need_quality, need_systems, tasks_dir, log,
                         extra_args, spent, plan, numerics)


@contextlib.contextmanager
def one_measuring_engine_per_host(measuring: bool, log):
    """Latency and memory measured while another engine runs on the same host measure the contention:
    an engine that will measure systems waits for the host (a lock in its local temp folder, so the Ray
    executor's tasks on one node take turns; nodes do not wait for each other)."""
    if not measuring:
        yield
        return
    import fcntl

    with open(Path(tempfile.gettempdir()) / "quantize-eval-measuring-engine.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("waiting: another engine is measuring on this host")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _evaluate(model_dir: Path, recipe, variant: str, vdir: Path, dtype: str, need_quality: str | None,
              need_systems: str | None, tasks_dir: Path, log, extra_args: list[str], spent, plan, numerics):
    q = s = None
    act_bytes, kv_bytes = provenance.dtype_bytes(dtype), provenance.kv_elem_bytes(dtype, extra_args)
    server = Server(model_dir, recipe.engine, dtype, vdir / "engine.log", recipe.model.trust_remote_code, extra_args,
                    kv_pool_bytes=plan.pool_bytes if plan is not None else None, numerics=numerics)
    if spent is not None:
        spent.engine_starts += 1  # counted whether it then serves or fails
    try:
        with server, server.blamed_for_errors():
            log(f"engine ready in {server.start_s:.0f} s (port {server.port})")
            server.memory.mark_loaded()
            if need_quality:
                q = quality.run_quality(server, model_dir, recipe, variant, vdir, need_quality, tasks_dir)
                write_json(vdir / "quality.json", q)
                log("quality: " + quality.summary(q))
            if need_systems:
                server.memory.begin_serving()  # the budget's peak: loading and serving, not scoring
                probe = admission.admission_probe if recipe.workload.admission_probe else None
                s = systems.run_systems(server, model_dir, recipe, variant, need_systems, kv_bytes, act_bytes, log,
                                        probe=probe, plan=plan)
            server.stop()
            if s is not None:
                systems.record_memory(s, server.memory)
                systems.verify_plan(s, model_dir, recipe.engine, kv_bytes,
                                    recipe.workload.prompt_tokens + recipe.workload.output_tokens)
                write_json(vdir / "systems.json", s)
                log("systems: " + systems.summary(s))
    finally:
        if spent is not None:
            spent.engine_s += server.busy_s
    return q, s
