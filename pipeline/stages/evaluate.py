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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline import progress
from pipeline.engines import interface
from pipeline.engines.interface import Launch
from pipeline.measure import overhead
from pipeline.results import BudgetPlan, QualityResult, SystemsResult
from pipeline.runstore import write_json
from pipeline.stages import admission, quality, systems
from pipeline.store import provenance


@dataclass
class ServeJob:
    """One engine's work for a variant (or the baseline): the weights it serves and all that differs from
    the engine settings every variant shares."""
    name: str
    weights: Path  # the folder the engine loads
    weights_hash: str  # what keys its results
    kv_cache_dtype: str = "auto"  # what this variant changes on purpose: an FP8 KV cache,
    load_quantization: str | None = None  # weights quantized by the engine as it loads them,
    tokenizer: Path | None = None  # the base model's tokenizer where the weights carry none
    numerics: dict | None = None  # the engine environment its compute path needs (None: the default)
    plan: BudgetPlan | None = None  # the KV pool its engine is started with under the memory budget
    projected: BudgetPlan | None = None  # the capacity recorded instead when systems are skipped
    systems_skip: str | None = None  # why systems are not measured (weights served dense here)
    checkpoint_bytes: int | None = None
    reference: Path | None = None  # what the reference engine loads (stages/agreement.py); None: `weights`


    def launch(self, recipe, dtype: str, log_path: Path, say=None) -> Launch:
        """The engine start this job needs: the recipe's engine settings plus what the job changes (and where
        its start reports progress: `say`, not part of what it depends on)."""
        p = self.plan
        budget = p is not None and p.mode == "budget"
        return Launch(self.weights, recipe.engine, dtype, log_path, recipe.model.trust_remote_code,
                      kv_cache_dtype=self.kv_cache_dtype, load_quantization=self.load_quantization,
                      tokenizer=self.tokenizer, max_logprobs=max_logprobs(recipe),
                      kv_pool_bytes=p.pool_bytes if p is not None and p.mode == "fixed" else None,
                      memory_budget_bytes=p.budget_bytes if budget else None,
                      outside_bytes=p.outside_bytes or 0 if budget else 0, numerics=self.numerics, say=say)


def max_logprobs(recipe) -> int | None:
    """The drift suite's top-k log-probabilities (an engine may cap them lower): asked of every variant alike."""
    return recipe.quality.drift.top_k if "drift" in recipe.quality.suites else None


@dataclass
class Needs:
    """What one engine start must measure (the input hashes of the missing results), and where."""
    quality: str | None
    systems: str | None
    vdir: Path
    tasks_dir: Path
    before_systems: Callable[[], None] | None = None  # waits for work that must not run beside a measurement


def evaluate(job: ServeJob, recipe, dtype: str, needs: Needs, log=print,
             spent=None) -> tuple[QualityResult | None, SystemsResult | None]:
    """Start one engine; run whichever of quality/systems are missing. `spent` (an outcome.Spent) is
    charged the engine start and the engine's busy seconds."""
    with one_measuring_engine_per_host(bool(needs.systems), log):
        return _evaluate(job, recipe, dtype, needs, log, spent)


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


def _evaluate(job: ServeJob, recipe, dtype: str, needs: Needs, log, spent):
    q = s = None
    model_dir, variant, vdir, plan = job.weights, job.name, needs.vdir, job.plan
    need_quality, need_systems, tasks_dir = needs.quality, needs.systems, needs.tasks_dir
    act_bytes, kv_bytes = provenance.dtype_bytes(dtype), provenance.kv_elem_bytes(dtype, job.kv_cache_dtype)
    server = interface.kind(recipe.engine.kind).launch(
        job.launch(recipe, dtype, vdir / "engine.log", say=None if progress.quiet() else log))
    if spent is not None:
        spent.engine_starts += 1  # counted whether it then serves or fails
    try:
        with _refusal_recorded(server, recipe, dtype), server, server.blamed_for_errors():
            log(f"engine ready in {server.start_s:.0f} s (port {server.port})")
            server.memory.mark_loaded()
            if need_quality:
                q = quality.run_quality(server, model_dir, recipe, variant, vdir, need_quality, tasks_dir)
                write_json(vdir / "quality.json", q)
                log("quality: " + quality.summary(q))
            if need_systems:
                if needs.before_systems is not None:
                    needs.before_systems()
                server.memory.begin_serving()  # the budget's peak: loading and serving, not scoring
                probe = admission.admission_probe if recipe.workload.admission_probe else None
                s = systems.run_systems(server, model_dir, recipe, variant, need_systems, kv_bytes, act_bytes, log,
                                        probe=probe, plan=plan)
            server.stop()
            if s is not None:
                systems.record_memory(s, server.memory)
                systems.verify_plan(s, model_dir, recipe.engine, kv_bytes,
                                    recipe.workload.prompt_tokens + recipe.workload.output_tokens, server.pool_sizing())
                if s.kv is not None and s.kv.plan is not None and s.kv.plan.mode == "budget":
                    overhead.record(dtype, overhead.measured(s.kv.plan.sizing, s.kv.plan.peak_bytes,
                                                           s.kv.plan.engine_weights_bytes),
                                   s.kv.plan.tolerance_bytes, variant, overhead.model_label(recipe))
                if s.status == "ok":
                    _further_starts(job, recipe, dtype, s, vdir, log, spent)
                write_json(vdir / "systems.json", s)
                log("systems: " + systems.summary(s))
    finally:
        if spent is not None:
            spent.engine_s += server.busy_s
    return q, s


@contextlib.contextmanager
def _refusal_recorded(server, recipe, dtype: str):
    """An engine that refused its budget's pool (it held more, loaded, than the budget left it) leaves this
    model's runtime on the host's figures, so validate says so next time before any engine starts."""
    try:
        yield
    except Exception:
        r = getattr(server, "refused", None)
        if r and r.get("weights_bytes") is not None:
            overhead.record_refusal(dtype, overhead.model_label(recipe), r["non_kv_bytes"] - r["weights_bytes"])
        raise


def _further_starts(job: ServeJob, recipe, dtype: str, s: SystemsResult, vdir: Path, log, spent) -> None:
    """workload.engine_starts > 1: the same engine, started again as it was, measures the primary cell's
    repeats again, so latency gates can hold the start-to-start spread (memory and capacity stay the first
    start's)."""
    for start in range(1, recipe.workload.engine_starts):
        server = interface.kind(recipe.engine.kind).launch(
            job.launch(recipe, dtype, vdir / f"engine-start{start + 1}.log", say=None if progress.quiet() else log))
        if spent is not None:
            spent.engine_starts += 1
        try:
            with server, server.blamed_for_errors():
                log(f"engine start {start + 1}/{recipe.workload.engine_starts} ready in {server.start_s:.0f} s")
                systems.add_start(s, systems.restart_repeats(server, job.weights, recipe, job.name, start))
                server.stop()
        finally:
            if spent is not None:
                spent.engine_s += server.busy_s
