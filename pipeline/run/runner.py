"""Orders the stages of a run, skips finished ones, and isolates each variant's failures.

    baseline:   evaluate (quality + systems, one engine start)            stages/evaluate.py
    variant:    quantize (quantize env subprocess, checkpoint cache)       stages/quantize.py
                -> evaluate
    run:        sign-off -> results.json, signoff.json, report.html        stages/signoff.py

A stage whose result file validates with a matching input hash (pipeline/store/keys.py) is not
rerun. A variant that fails records its error and the run goes on; the exit code says so at
the end. The local executor runs the variants here one after another; the Ray executor
(pipeline/run/ray_executor.py) runs the same `run_stage` in task processes. Either way the
outcome of every variant is then read back from the run folder (pipeline/store/outcome.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

from pipeline import schemes, suites
from pipeline.engines import formats, interface
from pipeline.engines.formats import Decision, Format
from pipeline.measure import membudget, overhead
from pipeline.progress import Heartbeat, say
from pipeline.recipe.schema import Recipe
from pipeline.results import VERDICT_MEANING, BudgetPlan, QualityResult, SystemsResult
from pipeline.run.preflight import PreflightError, check_ray_address, preflight
from pipeline.runstore import RunDir, RunLocked, hash_obj, open_run, read_result, run_lock, write_json
from pipeline.setup import assets, envs, host, modelcfg, models
from pipeline.stages import quantize as quantize_stage
from pipeline.stages.evaluate import ServeJob
from pipeline.store import keys, outcome, provenance, resultcache
from pipeline.store.outcome import Spent

__all__ = ["PreflightError", "RunLocked", "run", "run_stage", "stage_main", "support_table"]


def prepare_environment() -> None:
    """Keep every hub client offline and its caches inside ours."""
    home = envs.home()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(home / "hf-datasets"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")  # lm-eval's progress bars drown the stage lines


def resolve_model(recipe: Recipe) -> Path:
    if recipe.model.builtin:
        return models.builtin_model(recipe.model.builtin)
    return Path(recipe.model.path).resolve()


def _reuse(vdir: Path, name: str, qh: str, sh: str, systems_skip: str | None):
    """Results of these inputs measured before: in this folder, else in the result cache."""
    q = read_result(vdir / "quality.json", QualityResult, qh)
    s = read_result(vdir / "systems.json", SystemsResult, sh)
    q = q if q and q.status == "ok" else None  # a failed attempt is retried, never reused
    s = s if s and (s.status == "ok" or (systems_skip and s.status == "skipped")) else None
    for stage, r in (("quality", q), ("systems", s)):  # measured here by a run that died before storing it
        if r is not None:
            resultcache.store(stage, r, vdir, vdir.parent)
    if q is None and (q := resultcache.fetch("quality", qh, QualityResult, vdir, name)):
        say(name, "quality: measured earlier with identical inputs (result cache)")
    if s is None and not systems_skip and (s := resultcache.fetch("systems", sh, SystemsResult, vdir, name)):
        say(name, "systems: measured earlier with identical inputs (result cache)")
    return q, s


def pool_plan(ctx: RunContext, weights_dir: Path, kv_cache_dtype: str, name: str,
              projected_from: Path | None = None) -> BudgetPlan:
    """The KV pool one engine is predicted to get under the recipe's memory budget
    (pipeline/measure/membudget.py; the engine then sizes its own); what the engine's sizing does not count
    is fixed once per run. A predicted pool that cannot hold one sequence fails here, before any engine starts.
    None for an engine that has no pool to size (interface.EngineKind.systems_not_measured)."""
    if ctx.engine.systems_not_measured():
        return None
    gpu = envs.has_nvidia_gpu()
    act, kv = provenance.dtype_bytes(ctx.dtype), provenance.kv_elem_bytes(ctx.dtype, kv_cache_dtype)
    figures = None
    cfg = modelcfg.read(ctx.model_dir)
    if membudget.mode(ctx.recipe.engine, gpu) == "budget":
        figures = overhead.for_run(ctx.run_dir.root, ctx.dtype, log=lambda m: say(name, m),
                                   model=overhead.model_label(ctx.recipe))
        budget, source = membudget.run_budget(ctx.recipe.engine, cfg, ctx.model_dir, act, act, figures)
        figures = {**figures, "budget_bytes": budget, "budget_source": source}
    w = ctx.recipe.workload
    p = membudget.plan(ctx.recipe.engine, cfg, weights_dir, act, kv, gpu, figures, projected_from,
                       seq_len=w.prompt_tokens + w.output_tokens)
    membudget.check_fits(p, cfg, ctx.recipe.engine, kv, f"{name}'s weights")
    return p


def evaluate_variant(ctx: RunContext, job: ServeJob, spent: Spent) -> None:
    """Quality and systems for one set of weights (a stages.evaluate.ServeJob), each reused where it was
    measured before with identical inputs; a skipped systems stage is recorded with its reason."""
    from pipeline.stages.evaluate import Needs, evaluate

    recipe, dtype, run, name = ctx.recipe, ctx.dtype, ctx.run_dir, job.name
    vdir = run.variant(name)
    if why := ctx.engine.systems_not_measured():  # an engine that measures none: every variant's are N/A
        job = dataclasses.replace(job, systems_skip=why)
    qh, sh = keys.evaluate_keys(recipe, job.weights_hash, dtype, job.launch(recipe, dtype, vdir / "engine.log").options(),
                                 job.projected or job.plan, job.numerics)
    q, s = _reuse(vdir, name, qh, sh, job.systems_skip)
    if job.systems_skip and s is None:
        s = SystemsResult(variant=name, input_hash=sh, status="skipped", duration_s=0.0,
                          error=job.systems_skip, checkpoint_bytes=job.checkpoint_bytes,
                          kv=membudget.projected_capacity(job.projected) if job.projected else None)
        write_json(vdir / "systems.json", s)
        (vdir / "systems.origin.json").unlink(missing_ok=True)
        say(name, f"systems: not measured ({job.systems_skip})")
    if q and s:
        say(name, "evaluate: done earlier")
        check_agreement(ctx, job, qh, q)
        return
    say(name, "evaluate: starting engine (" + ", ".join(
        x for x, need in (("quality", q is None), ("systems", s is None)) if need) + ")")
    for stage, r in (("quality", q), ("systems", s)):  # measured now: no earlier result's origin may name it
        if r is None:
            (vdir / f"{stage}.origin.json").unlink(missing_ok=True)
    needs = Needs(None if q else qh, None if s else sh, vdir, run.root / "tasks",
                  before_systems=ctx.wait_probe if name == "baseline" else None)
    q2, s2 = evaluate(job, recipe, dtype, needs, log=lambda m: say(name, m), spent=spent)
    for stage, r in (("quality", q2), ("systems", s2)):
        if r is not None:
            resultcache.store(stage, r, vdir, run.root)
    check_agreement(ctx, job, qh, q or q2)


def check_agreement(ctx: RunContext, job: ServeJob, qh: str, q: QualityResult | None) -> None:
    """The engine-agreement check (stages/agreement.py) on the quality this job measured."""
    from pipeline.stages import agreement

    if q is None or q.status != "ok":
        return
    weights = job.reference or job.weights
    skip = ("the serving engine is the reference engine itself" if ctx.recipe.engine.kind == agreement.REFERENCE
            else agreement.unsupported(weights, job.kv_cache_dtype, job.load_quantization))
    agreement.check(ctx.recipe, job.name, ctx.run_dir.variant(job.name), ctx.run_dir.root / "tasks", weights,
                    job.tokenizer, ctx.dtype, qh, skip,
                    log=lambda m: say(job.name, m))


def serve_job(v, weights_dir: Path, model_dir: Path, weights_hash: str, numerics: dict, **kw) -> ServeJob:
    """One engine's job for a variant: what it changes on purpose (the rest is identical for all)."""
    own = any((weights_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    return ServeJob(v.name, weights_dir, weights_hash, kv_cache_dtype="fp8" if v.kv_cache != "auto" else "auto",
                    load_quantization=schemes.SCHEMES[v.scheme].load_quantization,  # e.g. bnb_nf4, at load
                    tokenizer=None if own else model_dir,  # imported checkpoints often carry none
                    numerics=numerics, **kw)


def variant_format(v, checkpoint: Path | None = None) -> Format | None:
    """What the engine will be asked to run; None for a custom recipe until its checkpoint exists
    (and for an example import before it is written)."""
    scheme = schemes.SCHEMES[v.scheme]
    if scheme.imports_checkpoint:
        if checkpoint is None:
            return None
        return checkpoint_format_of(v, checkpoint)
    if scheme.user_recipe:
        return None
    return formats.scheme_format(v.scheme, v.kv_cache)


def checkpoint_format_of(v, checkpoint: Path) -> Format:
    """A checkpoint's format as this variant serves it: an FP8 KV cache its files carry, or one the variant asks
    the engine for (kv_cache: fp8, an engine option: the files say nothing of it)."""
    fmt = formats.checkpoint_format(modelcfg.read(checkpoint))
    return Format(fmt.weights, fmt.kv_fp8 or v.kv_cache != "auto", fmt.detail, fmt.legacy)


def _judge(ctx: RunContext, v, vdir: Path, fmt: Format, model_cfg: dict) -> Decision:
    """The decision, with the compute path it names and the engine environment that realizes it."""
    decision = ctx.engine.decide(fmt, model_cfg, dtype=ctx.dtype, activations=v.activations)
    write_json(vdir / "support.json", {**decision.__dict__, "format": fmt.weights, "kv_fp8": fmt.kv_fp8,
                                       "read_from": fmt.detail, "engine_env": ctx.engine.numerics_env(decision.compute),
                                       "native_on": ctx.engine.native_on(fmt.weights)})
    if decision.mode == "unsupported":
        from pipeline.stages.agreement import REFERENCE

        other = ctx.recipe.engine.kind != REFERENCE and interface.kind(REFERENCE).decide(fmt, model_cfg).mode
        hint = f" (its quality alone: engine.kind {REFERENCE})" if other not in (False, "unsupported") else ""
        say(v.name, f"SKIPPED: {decision.reason}{hint}")
    return decision


def run_variant(ctx: RunContext, v, vdir: Path, spent: Spent, stop_after: str | None = None) -> None:
    """Support decision -> weights (quantized, imported, or the base for load-time schemes) ->
    evaluation; a variant this engine cannot run ends SKIPPED before anything is spent on it."""
    model_cfg = modelcfg.read(ctx.model_dir)
    scheme = schemes.SCHEMES[v.scheme]
    imported = quantize_stage.checkpoint_of(v, ctx.model_dir, ctx.model_id) if scheme.imports_checkpoint else None
    fmt = variant_format(v, imported)
    decision = _judge(ctx, v, vdir, fmt, model_cfg) if fmt else None
    if decision and decision.mode == "unsupported":
        return
    qr = None
    if imported:
        qr = quantize_stage.import_checkpoint(v, vdir, ctx.model_dir, imported)
    elif v.quantized_offline:
        qr = quantize_stage.quantize(ctx.recipe, v, ctx.model_dir, ctx.model_id, vdir, spent,
                                     also_dense=bool(decision and decision.mode == "emulated"
                                                     and not decision.engine_dequantizes))
    if stop_after == "quantize":  # the ray executor runs evaluation as its own task
        return
    if scheme.user_recipe:
        fmt = checkpoint_format_of(v, Path(qr.checkpoint_dir))
        decision = _judge(ctx, v, vdir, fmt, model_cfg)
        if decision.mode == "unsupported":
            return
    weights_dir = Path(qr.checkpoint_dir) if qr else ctx.model_dir
    numerics = ctx.engine.numerics_env(decision.compute)
    kv = "fp8" if v.kv_cache != "auto" else "auto"
    if decision.mode == "emulated":
        say(v.name, f"engine support: {decision.reason}")
    if decision.mode == "emulated" and not decision.engine_dequantizes:
        dense = quantize_stage.dense_copy(qr, vdir, spent)
        evaluate_variant(ctx, serve_job(
            v, dense, ctx.model_dir, keys.dense_key(qr.input_hash), numerics, systems_skip=decision.reason,
            checkpoint_bytes=qr.checkpoint_bytes, reference=weights_dir,
            plan=pool_plan(ctx, dense, kv, v.name),  # the dense weights' pool, for quality
            projected=pool_plan(ctx, dense, kv, v.name, projected_from=weights_dir)), spent)
    else:
        evaluate_variant(ctx, serve_job(
            v, weights_dir, ctx.model_dir, qr.input_hash if qr else ctx.model_id, numerics,
            checkpoint_bytes=qr.checkpoint_bytes if qr else None, plan=pool_plan(ctx, weights_dir, kv, v.name),
            systems_skip=decision.reason if decision.mode == "emulated" else None), spent)


def support_table(recipe: Recipe) -> list[tuple[str, Decision]]:
    """Each variant's decision on this machine, as far as it is known before quantizing
    (a custom recipe's format is only known once its checkpoint exists)."""
    model_cfg = modelcfg.read(resolve_model(recipe))
    dtype = host.resolve_dtype(recipe.engine.dtype)
    engine, rows = interface.kind(recipe.engine.kind), []
    for v in recipe.variants:
        imports = schemes.SCHEMES[v.scheme].imports_checkpoint
        example = imports and v.checkpoint.startswith("example:")
        fmt = Format("wna16", v.kv_cache != "auto", "example RTN 4-bit", legacy=True) if example else variant_format(
            v, Path(v.checkpoint) if imports else None)
        if fmt is None:
            platform = engine.capabilities().get("platform_name", recipe.engine.kind)
            rows.append((v.name, Decision("unknown", platform, "decided after your recipe writes its checkpoint")))
        else:
            rows.append((v.name, engine.decide(fmt, model_cfg, dtype=dtype, activations=v.activations)))
    return rows


class RunContext:
    """What every stage of one run needs, rebuilt the same way in a Ray worker's process."""

    def __init__(self, recipe: Recipe, model_dir: Path, model_id: str, dtype: str, run_dir: RunDir):
        self.recipe, self.model_dir, self.model_id = recipe, model_dir, model_id
        self.dtype, self.run_dir = dtype, run_dir
        self.engine = interface.kind(recipe.engine.kind)  # the engine every variant is served by
        self.probe: threading.Thread | None = None  # the engine's support answers, asked beside the baseline

    def probe_beside_baseline(self) -> None:
        """Ask the engine what it supports (a probe of its kernels, once per host and engine build; cached)
        in the background while the baseline's engine starts and scores quality, instead of after it: the
        variants need the answers, the baseline does not. Joined before the baseline measures systems, so
        it never runs beside a latency or memory measurement."""
        if not self.recipe.variants:
            return

        def ask() -> None:
            try:
                self.engine.capabilities()
            except Exception:  # noqa: BLE001 - the variant's own decision asks again and reports the error
                pass

        self.probe = threading.Thread(target=ask, name="support-probe", daemon=True)
        self.probe.start()

    def wait_probe(self) -> None:
        if self.probe is not None and self.probe.is_alive():
            say("baseline", "waiting for the engine support probe to finish before measuring systems")
            self.probe.join()


def run_stage(ctx: RunContext, name: str, stop_after: str | None = None, stage: str = "evaluate") -> None:
    """One variant's work (or the baseline's), failures isolated into its error.json; what it spent
    goes to the run's accounting file, as from a Ray task."""
    t_start, spent = time.time(), Spent()
    vdir = ctx.run_dir.variant(name)
    vdir.mkdir(parents=True, exist_ok=True)
    try:
        if name == "baseline":
            evaluate_variant(ctx, ServeJob(name, ctx.model_dir, ctx.model_id,
                                           plan=pool_plan(ctx, ctx.model_dir, "auto", name)), spent)
        else:
            v = next(x for x in ctx.recipe.variants if x.name == name)
            run_variant(ctx, v, vdir, spent, stop_after=stop_after)
        (vdir / "error.json").unlink(missing_ok=True)
    except Exception as exc:  # isolate: one broken variant must not sink the others
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        say(name, f"FAILED-TO-RUN: {msg}")
        outcome.record_failure(vdir, msg, traceback.format_exc())
    finally:
        outcome.record(ctx.run_dir.root, name, stage, t_start, spent)


def context(recipe: Recipe, run_root: Path) -> RunContext:
    model_dir = resolve_model(recipe)
    return RunContext(recipe, model_dir, hash_obj(provenance.model_hashes(model_dir)),
                      host.resolve_dtype(recipe.engine.dtype), RunDir(run_root))


def stage_main(recipe: Recipe, recipe_path: Path, run_root: Path, name: str, stage: str) -> int:
    """`quantize-eval _stage`: what one Ray task runs on its worker (same code as the local loop)."""
    prepare_environment()
    ctx = context(recipe, run_root)
    say(name, f"{stage}: on {os.uname().nodename} (pid {os.getpid()})")
    run_stage(ctx, name, stop_after="quantize" if stage == "quantize" else None, stage=stage)
    return 0


def run_local(ctx: RunContext) -> dict[str, float]:
    """The local executor: the baseline, then each variant, one after another; wall time of each."""
    timings: dict[str, float] = {}
    ctx.engine.prestart()  # the engines' shared import, beside the support probe and the first stages
    ctx.probe_beside_baseline()
    for name in ["baseline", *(v.name for v in ctx.recipe.variants)]:
        t0 = time.perf_counter()
        if name != "baseline" and outcome.read(ctx.run_dir.variant("baseline")).error:
            say(name, outcome.BASELINE_FAILED)
            outcome.record_failure(ctx.run_dir.variant(name), outcome.BASELINE_FAILED)
            continue
        run_stage(ctx, name)
        timings[name] = time.perf_counter() - t0
    return timings


def identity_of(recipe: Recipe, recipe_path: Path) -> str:
    """Which recipe a run folder belongs to: its name and its file. Another recipe file that shares the
    name never resumes into the folder; the same file, edited (a variant added, the workload changed),
    does, and the stages' input hashes decide what is measured again."""
    return hash_obj({"name": recipe.name, "file": str(Path(recipe_path).resolve())})


def invocations(previous: Path | None, now: str) -> dict:
    """When this run folder's work began and every invocation that wrote into it: a resumed run's results
    were measured across them, so its provenance must not read as if the last (often minutes of agreement
    after hours of scoring) did it all. A manifest that cannot be read counts as no earlier invocation."""
    try:
        earlier = json.loads(previous.read_text()) if previous is not None and previous.is_file() else {}
    except (OSError, ValueError):
        earlier = {}
    first = earlier.get("started_utc")
    seen = earlier.get("invocations_utc") or ([first] if first else [])
    return {"started_utc": first or now, "invocations_utc": [*seen, now]}


def start(recipe: Recipe, recipe_path: Path, fresh: bool) -> tuple[RunContext, dict]:
    """Model, preflight, run folder and manifest: everything before the first stage."""
    recipe_hash = hash_obj(recipe.model_dump(mode="json"))
    try:
        model_dir = resolve_model(recipe)
    except assets.AssetError as exc:
        raise PreflightError(f"{recipe_path}: model.builtin: {exc}") from None
    preflight(recipe, recipe_path, model_dir)
    identity = identity_of(recipe, recipe_path)
    run_dir, resumed = open_run(Path(recipe.runs_dir), recipe.name, identity, fresh)
    say("run", f"{'resuming' if resumed else 'new run'}: {run_dir.root}")
    from reports.render import mark_incomplete

    mark_incomplete(run_dir.root, f"a run started at {time.strftime('%Y-%m-%d %H:%M:%S')} has not finished")
    hashes = provenance.model_hashes(model_dir)
    dtype = host.resolve_dtype(recipe.engine.dtype)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest = {
        "schema_version": 1, "recipe_name": recipe.name, "recipe_hash": recipe_hash, "identity": identity,
        "recipe_file": str(recipe_path), "recipe": recipe.model_dump(mode="json"),
        "model_dir": str(model_dir), "model": hashes, "engine_dtype": dtype,
        "engine_kind": recipe.engine.kind,
        "engine_systems_not_measured": interface.kind(recipe.engine.kind).systems_not_measured(),
        # every engine's, unless a variant's support.json says otherwise
        "engine_numerics_env": interface.kind(recipe.engine.kind).numerics_env(),
        "model_note": models.NOTES.get(recipe.model.builtin or "", ""),
        "versions": provenance.versions(), "hardware": provenance.hardware(),
        "suites": {s.name: suites.settings(s) for s in suites.resolve(recipe.quality.suites)},
        **invocations(run_dir.manifest if resumed else None, now),
    }
    write_json(run_dir.manifest, manifest)
    shutil.copyfile(recipe_path, run_dir.root / "recipe.yaml")
    try:  # the folder's page, JSON and CSV say INCOMPLETE until this run signs off, with what it holds so far
        from reports.render import render_run

        render_run(run_dir.root)
    except Exception as exc:  # noqa: BLE001 - a page that cannot be drawn now will not be drawn at the end
        raise PreflightError(f"{run_dir.root}: the report cannot be rendered ({type(exc).__name__}: {exc}); "
                             f"fix the file it names or rerun with --fresh") from None
    # weights, tokenizer and config: any change invalidates results
    return RunContext(recipe, model_dir, hash_obj(hashes), dtype, run_dir), manifest


def plan(ctx: RunContext, recipe_path: Path) -> None:
    """The run's planning stage, before any variant: under a memory budget the figures kept outside each
    engine's own sizing are fixed for the run (pipeline/measure/overhead.py, the run folder's
    engine-overhead.json), so a budget that cannot hold the base model exits 2 here rather than failing
    every variant. (The Ray executor's tasks read them on their node instead.)"""
    if ctx.recipe.executor.kind == "ray":
        return
    try:
        pool_plan(ctx, ctx.model_dir, "auto", "baseline")
    except ValueError as exc:
        raise PreflightError(f"{recipe_path}: {exc}") from None


def run(recipe: Recipe, recipe_path: Path, fresh: bool = False) -> int:
    """The whole run, one at a time per recipe (a second exits 2 naming the first)."""
    with run_lock(Path(recipe.runs_dir), recipe.name, envs.home() / "locks"):
        return _run(recipe, recipe_path, fresh)


def prepared_start(recipe: Recipe, recipe_path: Path, fresh: bool) -> tuple[RunContext, dict, float, float]:
    """Environments, model, data and checks, then `start`: (ctx, manifest, perf_counter and epoch at the start).
    On a new machine this fetches the suites' data and the model before the run folder exists, which can
    take longer than the console may stay silent: it says what it does, and ticks while it does it."""
    say("run", "preparing: environments, model, data and checks")
    with Heartbeat("preparing", "run"):
        prepare_environment()
        check_ray_address(recipe)
        t_run, t_epoch = time.perf_counter(), time.time()
        ctx, manifest = start(recipe, recipe_path, fresh)
    return ctx, manifest, t_run, t_epoch


def _run(recipe: Recipe, recipe_path: Path, fresh: bool) -> int:
    # the lifecycle: start (folder, manifest, INCOMPLETE page) -> plan (the reserve) -> variants -> conclude
    ctx, manifest, t_run, t_epoch = prepared_start(recipe, recipe_path, fresh)
    plan(ctx, recipe_path)
    if recipe.executor.kind == "ray":
        from pipeline.run import ray_executor

        timings = ray_executor.run_all(ctx, recipe_path)
    else:
        timings = run_local(ctx)
    return conclude(ctx, manifest, timings, t_run, t_epoch).exit_code


def conclude(ctx: RunContext, manifest: dict, timings: dict[str, float], t_run: float, t_epoch: float,
             extra: dict | None = None, headline: str | None = None, split=None):
    """Sign off every variant of ctx.recipe (with `split`, a search's sealed half: on that half of the quality
    data only), finish the manifest (with `extra` merged in), render the page, print the verdict (or
    `headline`, a search's answer, above the run's verdict); the Signoff."""
    from pipeline.stages.signoff import signoff

    recipe = ctx.recipe
    results = {n: outcome.read(ctx.run_dir.variant(n)) for n in ["baseline", *(v.name for v in recipe.variants)]}
    spent = outcome.accounting(ctx.run_dir.root, t_epoch)
    so = signoff(recipe, manifest["recipe_hash"], ctx.run_dir.root, results, split)
    write_json(ctx.run_dir.root / "signoff.json", so)
    wall = time.perf_counter() - t_run
    manifest["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest["wall_s"] = {"total": wall, **timings}
    manifest["engine_starts"] = spent.engine_starts
    busy = spent.engine_s + spent.quantizer_s
    manifest["busy_s"] = {"engine": spent.engine_s, "quantizer": spent.quantizer_s,
                          "overhead_ratio": wall / busy if busy else None}
    manifest.update(extra or {})
    write_json(ctx.run_dir.manifest, manifest)
    _finish(ctx.run_dir, so, spent, t_run, headline)
    return so


def _render(run_dir: RunDir) -> str:
    """report.html, results.json and results.csv from the folder as it is; never raises."""
    from reports.render import render_run

    try:
        return str(render_run(run_dir.root))
    except Exception as exc:  # noqa: BLE001 - the verdict and results stand even if the page cannot be drawn
        return f"(not rendered: {type(exc).__name__}: {exc}; retry with `quantize-eval report`)"


def _finish(run_dir: RunDir, so, spent: Spent, t_run: float, headline: str | None = None) -> None:
    """Render the page and print the verdict; the verdict stands even if the page cannot be drawn."""
    report = _render(run_dir)
    for vs in so.variants:
        say(vs.variant, f"verdict {vs.verdict}" + (f" ({vs.reason})" if vs.reason else ""))
    if headline:
        print(f"\n{headline}")
        print(f"candidates' sign-off: {so.verdict} (a failing candidate is the search at work; the answer is above)")
    else:
        meaning = VERDICT_MEANING.get(so.verdict)
        print(f"\nVERDICT: {so.verdict}" + (f" ({meaning})" if meaning else "")
              + (f"  recommended: {so.recommended}" if so.recommended else ""))
    print(f"report:  {report}")
    print(f"results: {run_dir.root / 'results.json'}")
    print(f"wall:    {time.perf_counter() - t_run:.0f} s, {spent.engine_starts} engine start(s); engines busy "
          f"{spent.engine_s:.0f} s, quantizer busy {spent.quantizer_s:.0f} s")
    sys.stdout.flush()
