"""Benchmarks run under the engine environment (vLLM, lm-eval); this re-runs a script there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def reexec_under_engine_env(script: str) -> None:
    """Return at once inside the engine env; elsewhere run `script` there (building it on first
    use) and exit with its status."""
    if os.environ.get("QE_IN_ENGINE_ENV") == "1":
        sys.path.insert(0, str(ROOT))
        return
    py = subprocess.run([sys.executable, str(ROOT / "pipeline" / "setup" / "envs.py"), "engine"], capture_output=True,
                        text=True, check=True).stdout.strip()
    env = {**os.environ, "QE_IN_ENGINE_ENV": "1", "PYTHONPATH": str(ROOT)}
    sys.exit(subprocess.run([py, script, *sys.argv[1:]], env=env).returncode)
