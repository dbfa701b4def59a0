"""How long an engine start takes, where it goes, and what the warm launcher and the forked core save.

    python3 benchmarks/engine_start.py [--runs 5] [--models tiny,default] [--compare-cold] [--compare-spawn]

Starts the product's own engine (pipeline/engines/vllm/server.py, as a variant's engine is started:
the same launcher, environment and hooks; a fixed 0.25 GiB KV pool, so memory sizing is not in the
figure) RUNS times per model, one after another, and stops each once it answers /health. By default
each start is warm (forked from the launcher, as in a run): the launcher is started first and the
seconds it takes to import vLLM are printed beside the row, not counted in the starts (a run starts it
in the background at its beginning). `--compare-cold` also starts each model RUNS times cold (a new
interpreter, QE_ENGINE_LAUNCH=cold). Per start:
seconds to ready, and when the engine log first showed each phase (polled every 50 ms): the API
server's first line (Python importing vLLM and torch), the engine core's first line (its start: forked,
or spawned and importing vLLM again), weights loaded, KV pool allocated, engine core ready.
`--compare-spawn` also starts each model RUNS times with vLLM's own spawned engine core.
Models: `tiny` (the tests' config-built 4-layer Llama), `default` (SmolLM2-135M-Instruct).
Median and spread per figure go to benchmarks/results/engine_start.md.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_env import reexec_under_engine_env  # noqa: E402

reexec_under_engine_env(__file__)

import results  # noqa: E402

PHASES = (("API server up", "(APIServer"), ("engine core up", "Initializing a V1 LLM engine"),
          ("weights loaded", "Loading weights took"), ("KV allocated", "KV cache size"),
          ("engine core ready", "init engine"))


def _watch(log: Path, t0: float, seen: dict, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            text = log.read_text(errors="replace")
        except OSError:
            text = ""
        for name, marker in PHASES:
            if name not in seen and marker in text:
                seen[name] = time.perf_counter() - t0
        stop.wait(0.05)


def launcher_up() -> float:
    """Start the warm launcher (as a run does at its start) and wait until it has imported vLLM: seconds."""
    from pipeline.engines import interface

    up = interface.kind("vllm").prestart(wait=True)
    if up is None:
        raise SystemExit("the warm launcher is off here (QE_ENGINE_LAUNCH=cold, or a GPU machine)")
    return up


def one_start(model: Path, tmp: Path, fork: bool, i: int, warm: bool = True) -> dict:
    import os

    from pipeline.engines import interface
    from pipeline.recipe.schema import EngineSpec
    from pipeline.setup.host import resolve_dtype

    # spawn: vLLM's own start method on CPU, the engine core importing vLLM again
    os.environ["QE_ENGINE_CORE_START"] = "fork" if fork else "spawn"
    os.environ["QE_ENGINE_LAUNCH"] = "warm" if warm else "cold"
    log = tmp / f"{model.name}-{'fork' if fork else 'spawn'}-{'warm' if warm else 'cold'}-{i}.log"
    spec = interface.Launch(model_dir=model, settings=EngineSpec(kv_cache_gib=0.25), dtype=resolve_dtype("auto"), log_path=log)
    seen: dict[str, float] = {}
    stop = threading.Event()
    t0 = time.perf_counter()
    watcher = threading.Thread(target=_watch, args=(log, t0, seen, stop), daemon=True)
    watcher.start()
    try:
        with interface.kind("vllm").launch(spec):
            ready = time.perf_counter() - t0
            text = log.read_text(errors="replace")
            forked = "QE-ENGINE-CORE-START fork" in text
            launched_warm = "QE-LAUNCH warm" in text
    finally:
        stop.set()
        watcher.join()
        os.environ.pop("QE_ENGINE_CORE_START")
    if forked != fork:
        raise SystemExit(f"asked for a {'forked' if fork else 'spawned'} engine core, the log says otherwise: {log}")
    if launched_warm != (warm and fork):  # a spawned core changes an import-time variable: always cold
        raise SystemExit(f"asked for a {'warm' if warm else 'cold'} launch, the log says otherwise: {log}")
    return {"ready": ready, **seen}


def models(names: list[str], tmp: Path) -> dict[str, Path]:
    from pipeline.setup import models
    from tests import tinymodel

    out = {}
    for n in names:
        out[n] = tinymodel.build(tmp / "tiny", seed=0) if n == "tiny" else models.builtin_model("smollm2-135m-instruct")
    return out


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--models", default="tiny,default")
    ap.add_argument("--compare-spawn", action="store_true")
    ap.add_argument("--compare-cold", action="store_true", help="also start each engine cold (a new interpreter)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for name, model in models(a.models.split(","), tmp).items():
            modes = [(True, True)] + ([(True, False)] if a.compare_cold else []) + \
                ([(False, False)] if a.compare_spawn else [])
            for fork, warm in modes:
                how = ("forked engine core" if fork else "spawned engine core (vLLM's default on CPU)") + \
                    (", warm launch" if warm else ", cold launch")
                if warm:
                    up = launcher_up()
                    how += (f" (the launcher imported vLLM in {up:.1f} s first, not counted here)" if up > 0.5
                            else " (from the launcher already up)")
                runs = []
                for i in range(a.runs):
                    runs.append(one_start(model, tmp, fork, i, warm))
                    print(f"{name}, {how}, start {i + 1}/{a.runs}: ready in {runs[-1]['ready']:.1f} s; "
                          + ", ".join(f"{p} {runs[-1][p]:.1f}" for p, _ in PHASES if p in runs[-1]), flush=True)
                ready = [r["ready"] for r in runs]
                phases = "; ".join(f"{p} at {results.spread([r[p] for r in runs if p in r])}"
                                   for p, _ in PHASES if all(p in r for r in runs))
                print(f"== {name}, {how}: ready {results.spread(ready)}; {phases}")
                path = results.append("engine_start", "Engine start: seconds from launch to ready",
                                      ["model", "engine core", "runs", "ready (s)", "phase reached, s after launch"],
                                      [name, how, str(a.runs), results.spread(ready),
                                       phases])
        print(f"figures: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
