"""Wall time of each stage and of the whole default run, and its peak memory.

    python3 benchmarks/default_run.py [RECIPE]      (default: recipes/awq.yaml)

Runs `./quantize-eval RECIPE --fresh` as a user would (caches warm or cold, as they are),
then prints the figures from the run's own result files plus the peak RSS of the whole
process tree. Target (issue 2): the default run within 15 minutes on this machine.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    recipe = sys.argv[1] if len(sys.argv) > 1 else "recipes/awq.yaml"
    t0 = time.perf_counter()
    proc = subprocess.run([str(ROOT / "quantize-eval"), recipe, "--fresh"], cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(proc.stdout[-4000:])
    run_dir = next((line.split(":", 1)[1].strip() for line in proc.stdout.splitlines()
                    if line.startswith("report:")), None)
    if run_dir is None:
        print(proc.stderr[-3000:])
        print(f"run failed (exit {proc.returncode}) after {wall:.0f} s")
        return 1
    data = json.loads((Path(run_dir).parent / "results.json").read_text())
    print(f"\n== figures ({recipe}) ==")
    print(f"exit code {proc.returncode}, verdict {data['signoff']['verdict']}")
    for name, r in data["variants"].items():
        parts = []
        if r["quantize"]:
            parts.append(f"quantize {r['quantize']['quantize_wall_s']:.0f} s"
                         f"{' (cached)' if r['quantize']['cached'] else ''}, "
                         f"peak RSS {r['quantize']['peak_rss_bytes'] / 2**30:.2f} GiB")
        if r["systems"] and r["systems"].get("engine_start_s"):
            parts.append(f"engine start {r['systems']['engine_start_s']:.0f} s")
        if r["quality"]:
            parts.append(f"quality {r['quality']['duration_s']:.0f} s")
        if r["systems"] and r["systems"]["status"] == "ok":
            parts.append(f"systems {r['systems']['duration_s']:.0f} s, engine peak "
                         f"{r['systems']['peak_memory_bytes'] / 2**30:.2f} GiB")
        print(f"{name:>16}: " + "; ".join(parts))
    walls = data["manifest"].get("wall_s", {})
    print("per variant wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()))
    print(f"whole run wall {wall:.0f} s (target 900 s); peak RSS of any one process "
          f"{peak_children / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
