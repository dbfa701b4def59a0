"""Does a run's cost grow with its work and nothing else? Variants 1 -> 2 -> 4 and items 100 -> 400 -> 1600.

    python3 benchmarks/scaling.py [--runs N] [--only variants|items]

On a tiny config-built Llama (the tests' model: seconds to quantize and serve, so the pipeline's own
work is not hidden under model time), each configuration runs as `quantize-eval RECIPE --fresh` with
cold result and checkpoint caches (benchmarks/default_run.py's temporary home), N times (3):
  variants: the same recipe with 1, 2 and 4 W8A8-INT8 variants (one scheme, different SmoothQuant
            strengths: the same work each); prints the whole run's wall and the cost of each added
            variant, (T(n) - T(previous)) / added, which must stay about one variant's cost: no hidden
            quadratic work in sign-off, rendering or caching; and the same per kind of stage (quantize,
            engine start, quality, systems, summed over the run's variants) and for the time outside
            every stage (start-up, sign-off, rendering), to say where any excess goes;
  items:    one variant, PIQA limited to 100, 400 and 1600 items; prints the quality stages' seconds
            (baseline + variant) and seconds per item, which must stay about constant (linear).
Medians and spreads (max - min) over the runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.default_run import cold_home, stage_times  # noqa: E402

STRENGTHS = (0.8, 0.7, 0.6, 0.5)
KINDS = ("quantize", "engine start", "quality", "systems")


def tiny_model(out: Path) -> Path:
    py = subprocess.run([sys.executable, str(ROOT / "pipeline" / "setup" / "envs.py"), "engine"], capture_output=True,
                        text=True, check=True).stdout.strip().splitlines()[-1]
    subprocess.run([py, "-c", f"from tests import tinymodel; tinymodel.build(__import__('pathlib').Path({str(out)!r}))"],
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, capture_output=True)
    return out


def recipe(model: Path, runs_dir: Path, variants: int, items: int) -> dict:
    return {
        "schema_version": 1, "name": f"scale-v{variants}-n{items}", "model": {"path": str(model)},
        "engine": {"max_model_len": 512, "max_num_seqs": 8, "kv_cache_gib": 0.5},
        "calibration": {"num_samples": 4, "max_seq_len": 64},
        "variants": [{"name": f"w8a8-s{int(s * 10)}", "scheme": "w8a8_int8", "smoothing_strength": s}
                     for s in STRENGTHS[:variants]],
        "quality": {"suites": ["piqa"], "limit": items},
        "workload": {"prompt_tokens": 32, "output_tokens": 8, "concurrency": 2, "num_requests": 8,
                     "warmup_requests": 1},
        "gates": [{"metric": "accuracy_delta", "op": ">=", "threshold": -1.0}],
        "runs_dir": str(runs_dir),
    }


def one(model: Path, variants: int, items: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.yaml"
        path.write_text(yaml.safe_dump(recipe(model, Path(tmp) / "runs", variants, items)))
        env = {**os.environ, "QUANTIZE_EVAL_HOME": str(cold_home(Path(tmp)))}
        t0 = time.perf_counter()
        proc = subprocess.run([str(ROOT / "quantize-eval"), str(path), "--fresh", "--quiet"], cwd=tmp, env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        runs = sorted((Path(tmp) / "runs").glob("scale-*"))
        if proc.returncode not in (0, 1, 4, 5) or not runs or not (runs[-1] / "results.json").exists():
            print(proc.stdout[-2000:], proc.stderr[-2000:])
            raise SystemExit(f"run failed (exit {proc.returncode}) after {wall:.0f} s")
        times = stage_times(runs[-1], wall)
        for kind in KINDS:
            times[f"{kind} (all)"] = sum(v for k, v in times.items() if k.endswith(f" {kind}"))
        times["outside stages"] = wall - sum(times[f"{kind} (all)"] for kind in KINDS)
        return times


def summary(label: str, vals: list[float]) -> str:
    return (f"{label}: median {statistics.median(vals):6.1f}, spread {max(vals) - min(vals):5.1f} "
            f"({', '.join(f'{v:.1f}' for v in vals)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", choices=("variants", "items"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "tiny")
        if a.only in (None, "variants"):
            got: dict[int, list[dict[str, float]]] = {1: [], 2: [], 4: []}
            for i in range(a.runs):
                for n in got:
                    got[n].append(one(model, n, 100))
                    print(f"run {i + 1}: {n} variant(s): {got[n][-1]['whole run']:.0f} s", flush=True)
            print("\n== variants (tiny model, cold caches; seconds) ==")
            parts = ("whole run", *(f"{kind} (all)" for kind in KINDS), "outside stages")
            for n, runs in got.items():
                print(summary(f"whole run, {n} variant(s)", [t["whole run"] for t in runs]))
            for lo, hi in ((1, 2), (2, 4)):
                for part in parts:
                    per = [(b[part] - c[part]) / (hi - lo) for b, c in zip(got[hi], got[lo], strict=True)]
                    label = "each variant added" if part == "whole run" else f"  of which {part}"
                    print(summary(f"{label} {lo} -> {hi}", per))
        if a.only in (None, "items"):
            q: dict[int, list[float]] = {100: [], 400: [], 1600: []}
            for i in range(a.runs):
                for n in q:
                    q[n].append(one(model, 1, n)["quality (all)"])
                    print(f"run {i + 1}: {n} items: quality stages {q[n][-1]:.0f} s", flush=True)
            print("\n== items per suite (tiny model, one variant + baseline, cold caches) ==")
            for n, vals in q.items():
                print(summary(f"quality stages, {n} items (s)", vals))
                print(summary(f"  ms per item-variant, {n} items", [v / (2 * n) * 1000 for v in vals]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
