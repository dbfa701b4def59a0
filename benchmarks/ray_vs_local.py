"""Wall time of a two-variant tiny-model matrix: local executor vs Ray with 2 workers.

    python3 benchmarks/ray_vs_local.py

Same recipe both times except the engine seed (so the result cache cannot serve the second
run from the first); the tiny config-built Llama of the tests, W8A8-INT8 and RTN W4A16,
PIQA 10 items, a 4-request latency cell. On a 2-core machine both executors share the
same 2 cores: Ray can only overlap what leaves cores idle (process start-up, I/O). The
gain it is built for is across GPUs and nodes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.engine_env import reexec_under_engine_env  # noqa: E402

reexec_under_engine_env(__file__)

from pipeline.setup import envs  # noqa: E402
from tests import tinymodel  # noqa: E402
from tests.test_ray import recipe  # noqa: E402  (the same two-variant matrix the test runs)


def main() -> int:
    envs.ensure_extra("ray")
    tmp = Path(tempfile.mkdtemp(prefix="qe-ray-bench-"))
    model = tinymodel.build(tmp / "tiny", seed=11)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    walls = {}
    for label, extra, seed in (("local", [], int.from_bytes(os.urandom(3), "little")),
                               ("ray", ["--ray", "local"], int.from_bytes(os.urandom(3), "little"))):
        path = recipe(tmp, model, f"bench-{label}", seed)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "pipeline.cli", str(path), *extra], cwd=tmp, env=env,
                           capture_output=True, text=True)
        walls[label] = time.perf_counter() - t0
        (tmp / f"{label}.log").write_text(p.stdout + p.stderr)
        print(f"{label:>5}: {walls[label]:6.0f} s  exit {p.returncode}  (log {tmp / f'{label}.log'})", flush=True)
    print(f"\ntiny two-variant matrix, {os.cpu_count()} CPUs: local {walls['local']:.0f} s, "
          f"ray 2 workers {walls['ray']:.0f} s, ratio {walls['ray'] / walls['local']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
