"""First-use setup on a fresh home: both environments built at once, as `tests/run` and
`./quantize-eval` build them, with every cache (pip's, uv's, the installer itself) empty.

    python3 benchmarks/setup.py [--runs 3] [--installer uv|pip|both]

Each run gets a new temporary home (QUANTIZE_EVAL_HOME, HOME's caches, PIP_CACHE_DIR, UV_CACHE_DIR),
so nothing downloaded by an earlier run helps a later one; the wheels this machine keeps on disk
(/opt/wheels, pip's find-links here) are what any fresh machine of this kind has too. Prints each
run's wall time to both environments ready, then the median and spread (max - min), also into
benchmarks/results/setup.md. With `both` the installers alternate run by run, so drift in the
machine's speed falls on both alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def one_run(installer: str) -> tuple[float, dict[str, float], str]:
    fresh = Path(tempfile.mkdtemp(prefix="qe-setup-bench."))
    env = {**os.environ, "QUANTIZE_EVAL_HOME": str(fresh / "qe"), "PIP_CACHE_DIR": str(fresh / "pip"),
           "UV_CACHE_DIR": str(fresh / "uv"), "XDG_CACHE_HOME": str(fresh / "cache"),
           "QUANTIZE_EVAL_INSTALLER": installer}
    t0 = time.perf_counter()
    procs = {kind: subprocess.Popen([sys.executable, str(ROOT / "pipeline" / "setup" / "envs.py"), kind], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for kind in ("quantize", "engine")}
    ready: dict[str, float] = {}
    by: dict[str, str] = {}
    errors = []
    while len(ready) < len(procs):
        for kind, proc in procs.items():
            if kind not in ready and proc.poll() is not None:
                ready[kind] = time.perf_counter() - t0
                err = proc.stderr.read()
                if proc.returncode != 0:
                    errors.append(f"{kind}: {err.strip()[-400:]}")
                said = [ln for ln in err.splitlines() if "ready (" in ln]
                by[kind] = said[-1].rsplit("(", 1)[1].rstrip(")") if said else "?"
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    shutil.rmtree(fresh, ignore_errors=True)
    if errors:
        raise SystemExit("setup failed: " + " | ".join(errors))
    return wall, ready, f"engine by {by['engine']}, quantize by {by['quantize']}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--installer", choices=("uv", "pip", "both"), default="uv")
    a = ap.parse_args()
    installers = ["uv", "pip"] if a.installer == "both" else [a.installer]
    print(f"{cpu_name()}, {os.cpu_count()} cpus; {a.runs} run(s) each of {', '.join(installers)}", flush=True)
    walls: dict[str, list[float]] = {i: [] for i in installers}
    for r in range(a.runs):
        for inst in (installers if r % 2 == 0 else installers[::-1]):
            wall, ready, by = one_run(inst)
            walls[inst].append(wall)
            print(f"run {r + 1} {inst:>3}: both ready in {wall:6.1f} s (engine {ready['engine']:.1f} s, "
                  f"quantize {ready['quantize']:.1f} s; {by})", flush=True)
    for inst, w in walls.items():
        print(f"setup with {inst}: median {statistics.median(w):6.1f} s, spread {max(w) - min(w):5.1f} s "
              f"({', '.join(f'{x:.1f}' for x in w)})  target <= 180 s")
        path = results.append("setup", "First-use setup: both environments built on an empty home",
                              ["installer", "runs", "both ready (s)"], [inst, str(len(w)), results.spread(w)])
        print(f"figures: {path}")


if __name__ == "__main__":
    main()
