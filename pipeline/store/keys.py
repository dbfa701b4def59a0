"""The result-cache keys: everything that changes a checkpoint, a quality or a systems result.

A stage's result (and a cached checkpoint) is reused only when its key matches. Each key is a
hash of what produced the result, plus a version constant: bump the constant when the meaning
of a result changes without any of its inputs changing (a new measurement method), so every
result measured the old way is recomputed, instead of dropping or renaming fields to keep
earlier keys alive.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline import suites
from pipeline.engines import interface
from pipeline.runstore import hash_obj, sha256_file
from pipeline.setup import assets, envs, host
from pipeline.store import provenance

ROOT = Path(__file__).resolve().parents[2]
QUANTIZE_WORKER = ROOT / "pipeline" / "engines" / "workers" / "quantize_worker.py"
DEQUANTIZE_WORKER = ROOT / "pipeline" / "engines" / "workers" / "dequantize_worker.py"
SCHEMES = ROOT / "pipeline" / "schemes.py"

# 1: the layout of the keys below (2026-11-30; earlier keys were shaped for compatibility)
QUANTIZE_KEY_VERSION = 1
# 2: the KV pool's fields left out (they key systems only)
QUALITY_KEY_VERSION = 2
# 1: the admission probe is a concurrency ramp whose output is sized from the token budget
# 2: the KV pool sized by a memory budget (pipeline/measure/membudget.py)
# 3: each engine sizes its own pool under the budget; the figure kept outside its sizing keys it
SYSTEMS_KEY_VERSION = 3

# the code that measures, fingerprinted into each key: a fix to a measurement recomputes exactly the
# results it measured. Each stage's entry modules, and every project module they import, found by reading
# their imports (a hand-kept list missed measure/stats.py, stages/evaluate.py and setup/modelcfg.py)
PIPELINE = ROOT / "pipeline"
PROJECT_PACKAGES = ("pipeline", "evalsuites")


def import_closure(*entries: Path, root: Path = ROOT, packages: tuple[str, ...] = PROJECT_PACKAGES) -> tuple[Path, ...]:
    """These files and every module of the project's packages they import, at any depth and wherever the
    import stands (a function's lazy import counts), sorted; read from the source, nothing is imported."""
    seen: set[Path] = set()
    todo = [p.resolve() for p in entries]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for name in names:
                if name.split(".")[0] not in packages:
                    continue
                base = root.joinpath(*name.split("."))
                for f in (base.with_suffix(".py"), base / "__init__.py"):
                    if f.is_file():
                        todo.append(f.resolve())
    return tuple(sorted(seen))


# the serving engines' code: the interface and every engine kind's folder (not the quantize workers,
# which key checkpoints instead); the engine-side hook runs inside vLLM, imported by no module here
# the serving engine's code (the reference engine keys only the agreement check: stages/agreement.py)
ENGINE_SIDE = tuple(sorted(p for p in (PIPELINE / "engines").rglob("*.py")
                           if "workers" not in p.parts and "transformers" not in p.parts))
QUALITY_CODE = import_closure(PIPELINE / "stages" / "evaluate.py", PIPELINE / "stages" / "quality.py",
                              PIPELINE / "suites.py", PIPELINE / "measure" / "drift.py",
                              ROOT / "evalsuites" / "qe_utils.py", *ENGINE_SIDE)
SYSTEMS_CODE = import_closure(PIPELINE / "stages" / "evaluate.py", PIPELINE / "stages" / "systems.py",
                              PIPELINE / "stages" / "admission.py", *ENGINE_SIDE)


POOL_FIELDS = ("memory_budget_gib", "kv_cache_gib", "gpu_memory_utilization")


def source_hash(*paths: Path) -> str:
    """One hash of these files' contents; a file that is not there is an error (a moved module must not
    silently drop out of every key)."""
    return hash_obj([sha256_file(p) for p in paths])


def quantize_key(recipe, v, model_hash: str) -> str:
    """Everything that changes a checkpoint; the cache folder is named by it."""
    return hash_obj({
        "version": QUANTIZE_KEY_VERSION, "model": model_hash, "scheme": v.scheme, "group_size": v.group_size,
        # kv_cache fp8 is an engine option over the same checkpoint; only calibrated scales change the files
        "ignore": v.ignore, "kv_cache": v.kv_cache if v.kv_cache == "fp8_calibrated" else "auto",
        "smoothing_strength": v.smoothing_strength if v.scheme == "w8a8_int8" else None,
        "recipe_file": sha256_file(Path(v.recipe)) if v.recipe else None,
        "calibration": recipe.calibration.model_dump(exclude={"timeout_s"}),
        "calibration_dtype": host.resolve_dtype(recipe.calibration.dtype),
        "calibration_sha256": sha256_file(assets.calibration_text(recipe.calibration.dataset)),
        "seed": recipe.engine.seed, "trust_remote_code": recipe.model.trust_remote_code,
        "quantize_env": envs.requirements_file("quantize").read_text(),
        "worker": source_hash(QUANTIZE_WORKER, SCHEMES),
    })


def dense_key(quantize_key_: str) -> str:
    """The weights an emulated variant is served with: its checkpoint, dequantized."""
    return hash_obj([quantize_key_, "dense", source_hash(DEQUANTIZE_WORKER)])


def _common(recipe, weights_hash: str, dtype: str, options: dict, numerics: dict | None) -> dict:
    kind = interface.kind(recipe.engine.kind)  # its placement may run nvidia-smi: only when keys are made
    engine = recipe.engine.model_dump(exclude={"startup_timeout_s", *POOL_FIELDS})
    engine["variant_options"] = options  # interface.Launch.options(): what a variant changes on purpose
    engine["placement"] = kind.placement()
    engine["numerics_env"] = numerics if numerics is not None else kind.numerics_env()
    if recipe.engine.kind == "transformers":  # the reference engine serving a run: its code made every number
        engine["code"] = source_hash(*sorted((PIPELINE / "engines" / "transformers").rglob("*.py")))
    return {"weights": weights_hash, "engine": engine, "dtype": dtype,
            "engine_env": envs.requirements_file("engine").read_text(), "hardware": provenance.hardware()}


def quality_key(recipe, common: dict) -> str:
    q = recipe.quality
    defs = {r.name: suites.definition_hash(r) for r in suites.resolve(q.suites)}
    # bootstrap settings only change sign-off, which is recomputed every run; the settings of
    # suites this recipe does not run cannot change its items
    spec = q.model_dump(exclude={"bootstrap_samples", "seed", "agreement_sample"})  # agreement: its own key
    for suite in ("needle", "drift"):
        if suite not in q.suites:
            del spec[suite]
    return hash_obj({"version": QUALITY_KEY_VERSION, **common, "quality": spec, "suites": defs,
                     "code": source_hash(*QUALITY_CODE)})


def systems_key(recipe, common: dict) -> str:
    return hash_obj({"version": SYSTEMS_KEY_VERSION, **common, "workload": recipe.workload.model_dump(),
                     "code": source_hash(*SYSTEMS_CODE)})


def evaluate_keys(recipe, weights_hash: str, dtype: str, options: dict, plan=None,
                  numerics: dict | None = None) -> tuple[str, str]:
    """(quality key, systems key) of one set of weights served with these engine options. The KV pool
    (the budget, a fixed size, and the pool the plan gives this engine) keys systems only: answers do not
    depend on the pool's size, capacity and memory do. numerics: the engine environment that changes what
    it computes (the engine kind's numerics_env; None: the default every engine gets)."""
    common = _common(recipe, weights_hash, dtype, options, numerics)
    pool = recipe.engine.model_dump(include=set(POOL_FIELDS))
    # what the engine is started with; a budget-sized engine's pool is its own doing, so only a projected
    # plan's predicted pool (which is its result) and a fixed pool key it
    fields = {"mode", "budget_bytes", "outside_bytes", "projected"}
    if plan is not None and (plan.projected or plan.mode == "fixed"):
        fields |= {"pool_bytes", "runtime_bytes"}
    pool["plan"] = plan.model_dump(include=fields) if plan is not None else None
    return quality_key(recipe, common), systems_key(recipe, {**common, "pool": pool})
