"""Runs the engine and takes its whole process group down if the pipeline dies.

vLLM's server spawns EngineCore and Worker processes. If the pipeline is SIGKILLed, the
kernel can tell a child (PR_SET_PDEATHSIG) but not grandchildren, so this small guard sits
between them: it asks for SIGUSR1 when its parent dies and answers it by SIGKILLing its
own process group, which holds the server and everything the server spawned.

    python -m pipeline.engines.engine_guard CMD ARGS...
Standard library only; exits with the engine's exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    parent = os.getppid()

    def kill_group(*_args) -> None:
        os.killpg(os.getpgid(0), signal.SIGKILL)  # the engine tree and this guard

    signal.signal(signal.SIGUSR1, kill_group)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGUSR1)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:  # the pipeline died before the request took effect
        kill_group()
    proc = subprocess.Popen(argv)
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            if os.getppid() != parent:  # belt and braces where prctl is unavailable
                kill_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
