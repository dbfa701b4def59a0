"""The sensitivity stage: how much quantizing each decoder block alone (and each Linear kind) moves the
model's next-token predictions, measured in the quantize environment without an engine
(pipeline/engines/sensitivity_worker.py).

The windows come from the drift corpus (the packaged essays), held out from the windows the drift
suite scores: the search ranks blocks on text that the candidates' drift gates are not judged on.
Cached by model, grid, windows and code under $QUANTIZE_EVAL_HOME/results/sensitivity.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline import drift, envs, keys, schemes, suites
from pipeline.console import say
from pipeline.runstore import hash_obj, write_json

WORKER = keys.PIPELINE / "engines" / "sensitivity_worker.py"
KEY_VERSION = 1


def windows(recipe, model_dir: Path) -> list[list[int]]:
    """Sensitivity windows: drift-corpus text before the drift suite's own windows (which are cut from
    the end of the corpus)."""
    from transformers import AutoTokenizer

    ids = suites.essay_ids(AutoTokenizer.from_pretrained(model_dir))
    d, s = recipe.quality.drift, recipe.search.sensitivity
    held_out = ids[:max(0, len(ids) - d.windows * d.window_tokens)]
    try:
        return drift.windows_from_ids(held_out, s.windows, s.window_tokens)
    except ValueError as exc:
        raise ValueError(f"search.sensitivity: {exc} (after the drift suite's {d.windows} windows)") from None


def measure(ctx, spent, threads: int = 0) -> dict:
    """Per-part sensitivity for the recipe's search (one row per block, per Linear kind, per kind in a block), from the
    cache when measured before; also written to RUN/search/sensitivity.json."""
    recipe, out_dir = ctx.recipe, ctx.run_dir.root / "search"
    out_dir.mkdir(parents=True, exist_ok=True)
    sp = recipe.search
    base = schemes.SCHEMES[sp.base_scheme]
    spec = {"model_dir": str(ctx.model_dir), "windows": windows(recipe, ctx.model_dir), "bits": base.weight_bits,
            "group_size": sp.group_size, "symmetric": base.symmetric, "kinds": sp.sensitivity.kinds,
            "block_kinds": sp.units == "block_kinds", "threads": threads}
    key = hash_obj({"version": KEY_VERSION, "model": ctx.model_id, **{k: v for k, v in spec.items()
                    if k not in ("model_dir", "threads")}, "worker": keys.source_hash(WORKER),
                    "quantize_env": envs.requirements_file("quantize").read_text()})
    cache = envs.home() / "results" / "sensitivity" / f"{key[:32]}.json"
    if cache.exists():
        say("search", f"sensitivity: measured earlier ({cache})")
    else:
        (out_dir / "sensitivity-spec.json").write_text(json.dumps(spec))
        say("search", f"sensitivity: {len(spec['windows'])} windows x {recipe.search.sensitivity.window_tokens} "
                      f"tokens, one part at a time, {base.weight_bits}-bit g{sp.group_size or 'channel'} grid")
        tmp = out_dir / "sensitivity-worker.json"
        tmp.unlink(missing_ok=True)
        envs.run_quantize_env("pipeline.engines.sensitivity_worker", [str(out_dir / "sensitivity-spec.json"), str(tmp)],
                              out_dir / "sensitivity.log", recipe.calibration.timeout_s, "sensitivity", spent,
                              label="search", count_pattern=r"sensitivity (\d+)/(\d+) ", unit="parts")
        result = json.loads(tmp.read_text())
        write_json(cache, {**result, "key": key})
        tmp.unlink()
    shutil.copyfile(cache, out_dir / "sensitivity.json")
    return json.loads(cache.read_text())


RANKED = {"blocks": ("block",), "blocks_and_kinds": ("block", "kind"), "block_kinds": ("block_kind",)}


def ranked_parts(result: dict, units: str = "blocks") -> list[dict]:
    """The parts a candidate may keep (recipe_search.SearchSpec.units), most sensitive per weight first:
    mean KL over the parameters the fallback would keep (blocks are alike in size, so among blocks this
    is KL order); top-1 disagreement, then model order break ties."""
    rows = [r for r in result["rows"] if r["kind"] in RANKED[units]]
    return sorted(rows, key=lambda r: (-r["kl_mean"] / max(1, r["params"]), r["top1_agreement"], rows.index(r)))


def linear_modules(result: dict) -> list[str]:
    """Every decoder Linear the sensitivity saw, in model order (the blocks hold them all)."""
    return [m for r in result["rows"] if r["kind"] == "block" for m in r["modules"]]
