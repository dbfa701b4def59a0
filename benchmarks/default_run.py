"""Wall time of the default run and of each of its stages, as the median and spread of several runs.

    python3 benchmarks/default_run.py [RECIPE] [--cold | --first-use] [--runs N] [--keep DIR]   (recipes/awq.yaml, 3 runs)

Runs `./quantize-eval RECIPE --fresh` N times as a user would. --cold gives every run a temporary
cache home whose environments, converted models, data and support answers are this machine's (linked,
warm) while its result and checkpoint caches are empty: each run quantizes and measures everything.
--first-use gives every run a fresh clone of this repository's HEAD and an empty home (the pipeline's
cache, pip's, uv's, XDG's): the run builds both environments, converts the model and fetches the data
first, as a new user's first `./quantize-eval` does.
Prints each run's figures and, per figure, the median and the spread (max - min) over the runs.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as bench_results  # noqa: E402

WARM = ("envs", "models", "data", "wheels", "support", "imports")  # kept; checkpoints and results start empty


def home() -> Path:
    return Path(os.environ.get("QUANTIZE_EVAL_HOME", Path.home() / ".cache" / "quantize-eval"))


def cold_home(tmp: Path) -> Path:
    h = tmp / "home"
    h.mkdir()
    for name in WARM:
        if (home() / name).exists():
            (h / name).symlink_to(home() / name)
    return h


def stage_times(run_dir: Path, wall: float) -> dict[str, float]:
    """Seconds per stage, from the run's own result files."""
    data = json.loads((run_dir / "results.json").read_text())
    out = {"whole run": wall}
    for name, r in data["variants"].items():
        if r.get("quantize") and not r["quantize"].get("cached"):
            out[f"{name} quantize"] = r["quantize"]["quantize_wall_s"]
        s, q = r.get("systems") or {}, r.get("quality") or {}
        if s.get("engine_start_s"):
            out[f"{name} engine start"] = s["engine_start_s"]
        if q.get("duration_s"):
            out[f"{name} quality"] = q["duration_s"]
        if s.get("status") == "ok":
            out[f"{name} systems"] = s["duration_s"]
    return out


def one_run(recipe: str, cold: bool, first_use: bool = False, keep: Path | None = None) -> tuple[dict[str, float], int]:
    with tempfile.TemporaryDirectory() as tmp:
        env, repo = dict(os.environ), ROOT
        if cold:
            env["QUANTIZE_EVAL_HOME"] = str(cold_home(Path(tmp)))
        if first_use:
            repo = Path(tmp) / "clone"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
            env.update({k: str(Path(tmp) / k.lower()) for k in ("QUANTIZE_EVAL_HOME", "PIP_CACHE_DIR",
                                                                 "UV_CACHE_DIR", "XDG_CACHE_HOME")})
        t0 = time.perf_counter()
        proc = subprocess.run([str(repo / "quantize-eval"), recipe, "--fresh", "--quiet"], cwd=repo, env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        report = next((ln.split(":", 1)[1].strip() for ln in proc.stdout.splitlines() if ln.startswith("report:")),
                      None)
        if report is None or not Path(report).exists():
            print(proc.stdout[-2000:], proc.stderr[-2000:])
            raise SystemExit(f"run failed (exit {proc.returncode}) after {wall:.0f} s")
        if keep is not None:  # the run folder outlives the temporary clone and home
            shutil.copytree(Path(report).parent, keep / Path(report).parent.name, symlinks=True)
        return stage_times(Path(report).parent, wall), proc.returncode


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", nargs="?", default="recipes/awq.yaml")
    ap.add_argument("--cold", action="store_true", help="empty result and checkpoint caches for every run")
    ap.add_argument("--first-use", action="store_true", help="a fresh clone and an empty home for every run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="copy each run's folder (report, results, samples) into this folder")
    a = ap.parse_args()
    recipe, runs, cold = a.recipe, a.runs, a.cold
    if cold and a.first_use:
        ap.error("--cold and --first-use are two different starting points: choose one")
    results, exits = [], []
    for i in range(runs):
        times, rc = one_run(recipe, cold, a.first_use, a.keep)
        results.append(times)
        exits.append(rc)
        print(f"run {i + 1}/{runs} (exit {rc}): " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()), flush=True)
    caches = ("first use: fresh clone, empty home" if a.first_use else
              "cold result and checkpoint caches" if cold else "caches as they are")
    print(f"\n== {recipe}, {runs} runs, {caches} ==")
    medians = {}
    for key in results[0]:
        vals = [r[key] for r in results if key in r]
        medians[key] = statistics.median(vals)
        print(f"{key:>32}: median {medians[key]:6.0f} s, spread {max(vals) - min(vals):5.0f} s "
              f"({', '.join(f'{v:.0f}' for v in vals)})")
    stages = "; ".join(f"{k} {m:.0f}" for k, m in medians.items() if k != "whole run")
    path = bench_results.append("default_run", "The default run: wall time, whole and per stage",
                                ["recipe", "caches", "runs", "whole run (s)", "stages, median s", "exit codes"],
                                [recipe, caches, str(runs), bench_results.spread([r["whole run"] for r in results],
                                                                                digits=0),
                                 stages, ", ".join(map(str, exits))])
    print(f"figures: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
