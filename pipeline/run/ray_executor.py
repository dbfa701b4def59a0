"""Run a recipe's stages as Ray tasks: variants in parallel, across a cluster's GPUs/nodes.

Each variant becomes two chained tasks, quantize then evaluate, with resource requests
from the recipe's `executor` section (evaluate: engine.tensor_parallel_size GPUs by default;
quantize: its own). A task runs `python -m pipeline.cli _stage STAGE RECIPE RUN_DIR VARIANT`
on its worker: the same code and stage functions as the local executor, writing the same
result files into the same run folder, so the resume rules hold across workers: a task
retried after its worker or node was lost finds the stages that finished and does not
redo them. The driver then reads every variant's results from the run folder and signs
off exactly as the local executor does.

The run folder and the cache (QUANTIZE_EVAL_HOME) must be one shared filesystem, mounted
at the same paths on every node, with the repo and its engine/quantize environments at
the same paths too (README: "Scaling out on Ray").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from pipeline.progress import say
from pipeline.run.preflight import PreflightError
from pipeline.setup import envs
from pipeline.store import outcome

ROOT = Path(__file__).resolve().parents[2]
# One unit per node. An evaluate task (its engine measures latency and memory) takes the whole unit, so it
# holds its node alone; a quantize task takes a sliver, so quantize tasks share a node with each other but
# never run beside a measuring engine. A Ray resource, so it holds across processes, retries and nodes.
HOST = "quantize_eval_host"
EVALUATE_SHARE, QUANTIZE_SHARE = 1.0, 0.001


class StageCrashed(RuntimeError):
    """The stage process died (killed, out of memory): retried by Ray, unlike a stage error,
    which the stage itself records in error.json."""


def ensure_ray():
    try:
        import ray
    except ImportError:
        envs.ensure_extra("ray")
        import ray
    return ray


def _die_with_parent() -> None:  # Linux: the stage process must not outlive its Ray worker
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stage_task(cwd: str, recipe_path: str, run_root: str, name: str, stage: str, after=None) -> dict:
    """Body of a Ray task (runs on a worker): one stage of one variant in its own process, under
    this node's engine environment (engine-cuda on a GPU node, engine-cpu elsewhere)."""
    python = str(envs.ensure("engine"))
    vdir = Path(run_root) / name
    vdir.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    (vdir / f".ray-{stage}.pid").write_text(f"{os.getpid()} {host}")  # who runs it (ops, tests)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([python, "-m", "pipeline.cli", "_stage", stage, recipe_path, run_root, name],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_die_with_parent)
    for line in proc.stdout:  # Ray forwards it to the driver, prefixed with worker pid and node ip
        print(line, end="", flush=True)
    rc = proc.wait()
    if rc != 0:
        raise StageCrashed(f"{name} {stage}: stage process exited {rc} on {host}")
    return {"host": host, "pid": os.getpid(), "stage": stage, "name": name}


def run_all(ctx, recipe_path: Path) -> dict[str, float]:
    """Every variant's stages as Ray tasks; their outcomes are left in the run folder (a task that
    failed for good is recorded there as the variant's error). Returns wall seconds per variant."""
    ray = ensure_ray()
    ex = ctx.recipe.executor
    started_here = not ray.is_initialized()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # two variants' identical lines are both news
    if started_here:
        if ex.address is None:  # a private Ray instance on this machine, for this run only
            ray.init(num_cpus=max(2, os.cpu_count() or 2), resources={HOST: 1}, include_dashboard=False,
                     log_to_driver=True, configure_logging=False)
        else:
            ray.init(address=ex.address, log_to_driver=True, configure_logging=False)
    try:
        check_host_resource(ray.nodes())
        return _schedule(ray, ctx, recipe_path)
    finally:  # a private instance goes with this run, also when the run fails
        if started_here:
            ray.shutdown()


def check_host_resource(nodes: list[dict]) -> None:
    """Every node that can run a task declares one HOST unit, or an evaluate task could land beside a
    quantize task and measure the contention (or wait forever for a unit no node has)."""
    workers = [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    lacking = [n.get("NodeManagerAddress", "?") for n in workers if n.get("Resources", {}).get(HOST) != 1]
    if lacking or not workers:
        raise PreflightError(
            f"executor.address: node(s) {', '.join(lacking) or '(none with CPUs)'} do not declare the resource "
            f"{HOST}: 1 (start every node with `ray start ... --resources '{{\"{HOST}\": 1}}'`, so a measuring "
            "engine holds its node alone)")


def _schedule(ray, ctx, recipe_path: Path) -> dict[str, float]:
    ex, recipe = ctx.recipe.executor, ctx.recipe
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    say("run", f"ray: {len(nodes)} node(s), resources {ray.cluster_resources()}")
    gpus = ex.gpus_per_variant if ex.gpus_per_variant is not None else (
        recipe.engine.tensor_parallel_size if envs.has_nvidia_gpu() else 0)
    task = ray.remote(stage_task)
    retry = {"max_retries": ex.max_retries, "retry_exceptions": [StageCrashed]}
    evaluate = task.options(num_cpus=ex.cpus_per_variant, num_gpus=gpus, resources={HOST: EVALUATE_SHARE}, **retry)
    quantize = task.options(num_cpus=ex.quantize_cpus, num_gpus=ex.quantize_gpus, resources={HOST: QUANTIZE_SHARE},
                            **retry)
    common = (os.getcwd(), str(Path(recipe_path).resolve()), str(ctx.run_dir.root.resolve()))
    t0 = time.perf_counter()
    pending: dict = {}
    base = evaluate.remote(*common, "baseline", "evaluate")
    pending[base] = ("baseline", "evaluate")
    say("baseline", f"ray: evaluate submitted ({ex.cpus_per_variant} CPU, {gpus} GPU)")
    timings: dict[str, float] = {}
    failed: dict[str, str] = {}

    def drain(until_done: set | None = None) -> None:
        while pending and (until_done is None or until_done & set(pending)):
            done, _ = ray.wait(list(pending), num_returns=1)
            ref = done[0]
            name, stage = pending.pop(ref)
            try:
                info = ray.get(ref)
                say(name, f"ray: {stage} finished on {info['host']} (worker pid {info['pid']})")
            except Exception as exc:  # retries exhausted, or the evaluate task's quantize dependency failed
                failed[name] = f"ray: {stage} task failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                say(name, failed[name])
            if stage == "evaluate":
                timings[name] = time.perf_counter() - t0

    if ex.baseline_first:
        drain({base})
    variants_ok = not (ex.baseline_first and (failed.get("baseline") or
                                              outcome.read(ctx.run_dir.variant("baseline")).error))
    for v in recipe.variants if variants_ok else []:
        q = quantize.remote(*common, v.name, "quantize")
        e = evaluate.remote(*common, v.name, "evaluate", q)  # runs once its quantize task is done
        pending[q], pending[e] = (v.name, "quantize"), (v.name, "evaluate")
        say(v.name, "ray: quantize and evaluate submitted")
    drain()
    for name in ["baseline", *(v.name for v in recipe.variants)]:
        if name != "baseline" and not variants_ok:
            outcome.record_failure(ctx.run_dir.variant(name), outcome.BASELINE_FAILED)
        elif name in failed:
            outcome.record_failure(ctx.run_dir.variant(name), failed[name])
    return timings
