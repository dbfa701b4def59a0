"""Runs the engine and takes its whole process group down if the pipeline dies.

vLLM's server spawns EngineCore and Worker processes. If the pipeline is SIGKILLed, the
kernel can tell a child (PR_SET_PDEATHSIG) but not grandchildren, so this small guard sits
between them: it asks for SIGUSR1 when its parent dies and answers it by SIGKILLing its
own process group, which holds the server and everything the server spawned.

    python -m pipeline.engines.engine_guard CMD ARGS...
    python -m pipeline.engines.engine_guard --pid PID --exit-file PATH --owner PIPELINE_PID

The second form guards an engine already running as its child: the warm launcher
(pipeline/engines/vllm/launcher.py) forks the engine from a process that has vLLM imported, then
replaces the fork's parent with this guard, which writes the engine's exit code to PATH (the
launcher's caller is not the engine's parent and cannot wait for it) and takes the group down when
PIPELINE_PID, the process that asked for the engine, is gone (polled: it is not this guard's parent).
Standard library only; exits with the engine's exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def kill_group(*_args) -> None:
    os.killpg(os.getpgid(0), signal.SIGKILL)  # the engine tree and this guard


def main(argv: list[str]) -> int:
    if argv[:1] == ["--pid"]:
        return _guard_child(int(argv[1]), argv[argv.index("--exit-file") + 1], int(argv[argv.index("--owner") + 1]))
    parent = os.getppid()
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


def _alive(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie its parent has yet to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _guard_child(pid: int, exit_file: str, owner: int) -> int:
    """Wait for the engine `pid` (this process's child since before the exec), leaving its exit code in
    `exit_file`; take the group down when `owner`, the pipeline process that asked for the engine, is gone.
    Not the launcher this guard was forked from: the launcher may be replaced while its engines serve."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            with open(exit_file + ".tmp", "w") as f:  # whole or not at all: the launcher's caller polls it
                f.write(str(code))
            os.replace(exit_file + ".tmp", exit_file)
            return code if code >= 0 else 128 - code
        if not _alive(owner):
            kill_group()
        time.sleep(0.5)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
