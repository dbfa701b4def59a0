"""Content-addressed cache of evaluation results, shared across runs and recipes.

A quality or systems result is keyed by its input hash (weights, tokenizer, config, engine
arguments, dtype, engine environment, hardware, suite data or workload). A second recipe
on the same model therefore does not evaluate the baseline again, and adding a variant to
a finished run costs only that variant. A reused result says where it was measured
(`origin.json` beside it, copied into the variant folder as `<stage>.origin.json`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from pipeline.runstore import atomic_dir, read_result, write_json
from pipeline.setup import envs

T = TypeVar("T", bound=BaseModel)


def _slot(stage: str, input_hash: str) -> Path:
    return envs.home() / "results" / stage / input_hash[:32]


def store(stage: str, result: BaseModel, vdir: Path, run_root: Path) -> None:
    if getattr(result, "status", None) != "ok":
        return
    slot = _slot(stage, result.input_hash)
    if slot.exists():
        return
    try:  # best effort: a result already measured must not fail its variant for the cache's sake
        with atomic_dir(slot, replace=False) as tmp:  # a run that stored it first wins: same content
            write_json(tmp / f"{stage}.json", result)
            if stage == "quality" and (vdir / "samples").is_dir():
                shutil.copytree(vdir / "samples", tmp / "samples")
            write_json(tmp / "origin.json", {"run": str(run_root), "variant": result.variant,
                                             "stored_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    except OSError as exc:
        print(f"result cache: not stored ({type(exc).__name__}: {exc})", flush=True)


def fetch(stage: str, input_hash: str, model: type[T], vdir: Path, variant: str) -> T | None:
    slot = _slot(stage, input_hash)
    result = read_result(slot / f"{stage}.json", model, input_hash)
    if result is None or getattr(result, "status", None) != "ok":
        return None
    if stage == "quality" and (slot / "samples").is_dir():
        shutil.rmtree(vdir / "samples", ignore_errors=True)
        shutil.copytree(slot / "samples", vdir / "samples")
    result = result.model_copy(update={"variant": variant})
    origin = json.loads((slot / "origin.json").read_text()) if (slot / "origin.json").exists() else {}
    write_json(vdir / f"{stage}.origin.json", origin)
    write_json(vdir / f"{stage}.json", result)
    return result
