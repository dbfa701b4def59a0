"""The sensitivity stage: how much quantizing each part alone (a decoder block, a Linear kind, a kind within
a block) moves the model's next-token predictions, measured in the quantize environment without an engine
(pipeline/engines/workers/sensitivity_worker.py).

With `search.sensitivity.method: calibrated` (the default) the base scheme's own llm-compressor recipe runs
in memory first, so what is measured is what AWQ or GPTQ would leave in each part; `rtn` rounds each part to
nearest instead (faster, but blind to what the algorithm fixes). The windows come from the drift corpus (the
packaged essays), held out from the windows the drift suite scores: the search ranks parts on text that the
candidates' drift gates are not judged on. Cached by model, method, grid, calibration, windows and code under
$QUANTIZE_EVAL_HOME/results/sensitivity.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from pipeline import schemes, suites
from pipeline.engines.workers import sensitivity_parts
from pipeline.engines.workers.quantize_worker import build_recipe
from pipeline.measure import drift
from pipeline.progress import say
from pipeline.recipe.search_section import FALLBACK_BITS
from pipeline.runstore import hash_obj, sha256_file, write_json
from pipeline.setup import assets, envs
from pipeline.store import keys

WORKER = keys.PIPELINE / "engines" / "workers" / "sensitivity_worker.py"
CODE = (WORKER, Path(sensitivity_parts.__file__), keys.QUANTIZE_WORKER)
KEY_VERSION = 2
# the emulated curve: the all-quantized model with the top parts kept, at these fractions of their weights
CURVE = [0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.8]


def windows(recipe, model_dir: Path) -> list[list[int]]:
    """Sensitivity windows: drift-corpus text before the first essay the drift suite's own windows come from
    (they are cut from the last essays): no document is both ranked on and judged on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids, docs = suites.corpus(tok, "essays")
    d, s = recipe.quality.drift, recipe.search.sensitivity
    try:
        spans = drift.spread_spans(docs, len(ids), d.windows, d.window_tokens)
    except ValueError as exc:
        raise ValueError(f"quality.drift: {exc}") from None
    held_out = ids[:drift.held_out_end(docs, spans, len(ids))]
    try:
        return drift.windows_from_ids(held_out, s.windows, s.window_tokens, suites.bos_prefix(tok))
    except ValueError as exc:
        raise ValueError(f"search.sensitivity: {exc} (after the drift suite's {d.windows} windows)") from None


def worker_spec(recipe, model_dir: Path, threads: int = 0) -> dict:
    """What the sensitivity worker is asked to measure (sensitivity-spec.json)."""
    sp = recipe.search
    base = schemes.SCHEMES[sp.base_scheme]
    spec = {"model_dir": str(model_dir), "windows": windows(recipe, model_dir), "bits": base.weight_bits,
            "group_size": sp.group_size, "symmetric": base.symmetric, "kinds": sp.sensitivity.kinds,
            "block_kinds": sp.units == "block_kinds", "threads": threads, "method": sp.sensitivity.method}
    if sp.sensitivity.method == "calibrated":
        c = recipe.calibration
        spec.update(
            recipe=yaml.safe_dump(build_recipe({"scheme": sp.base_scheme, "ignore": ["lm_head"],
                                                "group_size": sp.group_size}), sort_keys=False),
            calibration={"calibration_file": str(assets.calibration_text(c.dataset)), "num_samples": c.num_samples,
                         "max_seq_len": c.max_seq_len},
            seed=recipe.engine.seed, fallback_bits=FALLBACK_BITS[sp.fallbacks[0]], curve=CURVE,
            units=sp.units)
    return spec


def cache_key(spec: dict, model_id: str, recipe) -> str:
    """Everything that changes the measurement (paths and threads do not)."""
    what = {k: v for k, v in spec.items() if k not in ("model_dir", "threads", "calibration")}
    if "calibration" in spec:
        what["calibration"] = {**recipe.calibration.model_dump(exclude={"timeout_s"}),
                               "sha256": sha256_file(Path(spec["calibration"]["calibration_file"]))}
    return hash_obj({"version": KEY_VERSION, "model": model_id, **what, "code": keys.source_hash(*CODE),
                     "quantize_env": envs.requirements_file("quantize").read_text()})


def measure(ctx, spent, threads: int = 0) -> dict:
    """Per-part sensitivity for the recipe's search (one row per block, per Linear kind, per kind in a block),
    from the cache when measured before; also written to RUN/search/sensitivity.json."""
    recipe, out_dir = ctx.recipe, ctx.run_dir.root / "search"
    out_dir.mkdir(parents=True, exist_ok=True)
    sp = recipe.search
    spec = worker_spec(recipe, ctx.model_dir, threads)
    key = cache_key(spec, ctx.model_id, recipe)
    cache = envs.home() / "results" / "sensitivity" / f"{key[:32]}.json"
    if cache.exists():
        say("search", f"sensitivity: measured earlier ({cache})")
    else:
        (out_dir / "sensitivity-spec.json").write_text(json.dumps(spec))
        how = (f"{sp.base_scheme} calibrated in memory, then one part at a time"
               if sp.sensitivity.method == "calibrated" else "one part at a time, rounded to nearest")
        say("search", f"sensitivity: {len(spec['windows'])} windows x {sp.sensitivity.window_tokens} tokens, "
                      f"{how}, {spec['bits']}-bit g{sp.group_size or 'channel'} grid")
        tmp = out_dir / "sensitivity-worker.json"
        tmp.unlink(missing_ok=True)
        envs.run_quantize_env("pipeline.engines.workers.sensitivity_worker", [str(out_dir / "sensitivity-spec.json"), str(tmp)],
                              out_dir / "sensitivity.log", recipe.calibration.timeout_s, "sensitivity", spent,
                              label="search", count_pattern=r"sensitivity (\d+)/(\d+) ", unit="parts")
        result = json.loads(tmp.read_text())
        write_json(cache, {**result, "key": key})
        tmp.unlink()
    shutil.copyfile(cache, out_dir / "sensitivity.json")
    return json.loads(cache.read_text())


def ranked_parts(result: dict, units: str = "blocks") -> list[dict]:
    """The parts a candidate may keep (recipe.search_section.SearchSpec.units), most sensitive per weight kept first
    (pipeline/engines/workers/sensitivity_parts.rank)."""
    return sensitivity_parts.rank(result["rows"], units)


def linear_modules(result: dict) -> list[str]:
    """Every decoder Linear the sensitivity saw, in model order (the blocks hold them all)."""
    return [m for r in result["rows"] if r["kind"] == "block" for m in r["modules"]]
