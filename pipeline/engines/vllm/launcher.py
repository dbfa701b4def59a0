"""Warm engine starts: each engine forked from one process that has imported vLLM already.

Most of a CPU engine start is Python importing vLLM and torch: the phases benchmarks/engine_start.py
times show the API server's first line long after launch, and loading weights, sizing the pool and warming
up as a small part of the rest (benchmarks/results/engine_start.md has the figures per CPU kind). A run
starts one engine per variant, all with the same environment and command line but the model, so the
import is the same work each time. The launcher starts zygote.py once, in
the background (`prestart`, at the start of a local run, so the import overlaps with the run's own
preparation), and each engine is then forked from it: same Python, same vLLM, same command line, same
environment, run as `python -m` runs it; the engine tree's shape (a guard, the API server, its forked
engine core) and its process group are a cold start's, so stopping, reaping and memory sampling do not
change. Its log's first line says `QE-LAUNCH warm`.

The launcher is off with QE_ENGINE_LAUNCH=cold in the environment and on GPU machines (vLLM's own process
layout is kept there): each engine then starts cold, in a new interpreter. A launch whose environment
differs from the launcher's in a variable its imports may read (all but the few vLLM reads when it uses
them, and the hub client's download settings) gets a new launcher started with its environment; a
launch the launcher could not answer starts cold. Where the answers could differ,
they do not: the forked engine runs the same code on the same arguments.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

# variables a launch may set differently from the launcher's environment: vllm.envs reads them when they
# are used (its cache is enabled in the engine, after the fork), never at import
READ_WHEN_USED = frozenset({"VLLM_CPU_INT4_W4A8"})
# read by nothing an engine imports (pytest's per-test name, the launcher's own switch): the engine still
# gets the launch's own value
NOT_READ = frozenset({"PYTEST_CURRENT_TEST", "QE_ENGINE_LAUNCH"})
# the hub client's download settings, which the pipeline's own imports set after the launcher started
# (lm_eval sets HF_XET_HIGH_PERFORMANCE): an engine runs offline (HF_HUB_OFFLINE=1) and downloads nothing
NOT_READ_PREFIXES = ("HF_XET_", "HF_HUB_ENABLE_HF_TRANSFER")
HEARTBEAT_S = 10.0


class WarmProc:
    """The part of subprocess.Popen the engine's server uses, for an engine that is not this process's child:
    its guard writes the engine's exit code to `exit_file`."""

    def __init__(self, pid: int, exit_file: Path):
        self.pid, self.exit_file, self.returncode = pid, exit_file, None
        try:
            self._created = psutil.Process(pid).create_time()
        except psutil.Error:
            self._created = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            p = psutil.Process(self.pid)
            # the same process, not a reused pid: start times within 2 s, not equal, since psutil derives them
            # from the kernel's boot time, which a VM's clock adjustments move (a poll every 0.25 s for the
            # engine's whole life must never read a jitter as the engine's exit)
            same = self._created is None or abs(p.create_time() - self._created) < 2.0
            alive = same and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            alive = False
        try:
            code = int(self.exit_file.read_text())
        except (OSError, ValueError):  # not written yet, or the guard was killed with its group
            code = None
        if code is None and alive:
            return None
        self.returncode = -1 if code is None else code  # -1: a signal leaves no code to read
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired("engine", timeout)
            time.sleep(0.1)
        return self.returncode


class Launcher:
    """One zygote.py process and the socket to it."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.lock = threading.Lock()
        ours, theirs = socket.socketpair()
        self.dir = Path(tempfile.mkdtemp(prefix="qe-launcher-"))
        with open(self.dir / "launcher.log", "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.engines.vllm.zygote", str(theirs.fileno()),
                                          str(self.dir)],
                                         env=self.env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        self.sock = ours
        self.buf = b""
        self.closed = False

    def ready(self) -> bool:
        """Whether it has imported vLLM (its log's last word; benchmarks/engine_start.py times it)."""
        try:
            return "QE-ZYGOTE ready" in (self.dir / "launcher.log").read_text(errors="replace")
        except OSError:
            return False

    def differs(self, env: dict[str, str]) -> list[str]:
        """The variables that keep an engine with this environment from being forked from here (module
        docstring): those the engine's imports may read that differ from the launcher's."""
        keys = (set(env) | set(self.env)) - READ_WHEN_USED - NOT_READ
        return sorted(k for k in keys if env.get(k) != self.env.get(k) and not k.startswith(NOT_READ_PREFIXES))

    def serves(self, env: dict[str, str]) -> bool:
        return not self.closed and self.proc.poll() is None and not self.differs(env)

    def launch(self, module: str, argv: list[str], env: dict[str, str], log: Path, t0: float, timeout_s: float,
               say=None) -> WarmProc | None:
        """Fork an engine; None when the launcher cannot (the caller starts it cold). While the launcher is
        still importing vLLM this waits, saying so every HEARTBEAT_S."""
        if not self.serves(env):
            return None
        exit_file = log.with_suffix(".exit")
        exit_file.unlink(missing_ok=True)
        req = {"module": module, "argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log),
               "exit_file": str(exit_file), "owner": os.getpid()}
        with self.lock:
            try:
                self.sock.sendall((json.dumps(req) + "\n").encode())
                answer = self._answer(t0, timeout_s, say)
            except OSError:
                self.close()  # its answer, when it came, would be read as the next launch's
                return None
            except BaseException:
                self.close()
                raise
            if answer is None:
                self.close()
                return None
        if "pid" not in answer:
            return None
        return WarmProc(answer["pid"], exit_file)

    def _answer(self, t0: float, timeout_s: float, say) -> dict | None:
        next_say = t0 + HEARTBEAT_S
        while b"\n" not in self.buf:
            now = time.perf_counter()
            if now > t0 + timeout_s or self.proc.poll() is not None:
                return None
            if say is not None and now >= next_say:
                say(f"engine start: {now - t0:.0f} s so far (the launcher is importing vLLM)")
                next_say = now + HEARTBEAT_S
            ready, _, _ = select.select([self.sock], [], [], 0.5)
            if ready:
                data = self.sock.recv(1 << 16)
                if not data:
                    return None
                self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        """Stop the launcher. An engine it forked for a launch whose answer was never read (given up at the
        deadline, or cut by an error) is nobody's to stop: the launcher kills it if it had not answered yet
        (zygote.py), and an answer it had sent is read here and its engine killed."""
        if self.closed:
            return
        self.closed = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self._unread_answers():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.sock.close()
        except OSError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def _unread_answers(self) -> list[int]:
        """The engine groups of answers still in the socket (the launcher has exited: all it sent is there)."""
        buf = self.buf
        try:
            self.sock.setblocking(False)
            while data := self.sock.recv(1 << 16):
                buf += data
        except OSError:  # nothing more to read, or the socket is gone
            pass
        pids = []
        for line in buf.split(b"\n"):
            try:
                pids.append(int(json.loads(line)["pid"]))
            except (ValueError, KeyError, TypeError):
                pass
        return pids


_launcher: Launcher | None = None
_guard = threading.Lock()
_aside = False  # stood aside for good in this process (stand_aside)


def enabled() -> bool:
    from pipeline.setup import envs

    return not _aside and os.environ.get("QE_ENGINE_LAUNCH", "warm") != "cold" and not envs.has_nvidia_gpu()


def stand_aside() -> bool:
    """Close this process's launcher and start no other: what its imports hold is the host's again, for an
    engine that would not fit beside it. True when one was running."""
    global _launcher, _aside
    with _guard:
        _aside = True
        running = _launcher is not None and not _launcher.closed and _launcher.proc.poll() is None
        if _launcher is not None:
            _launcher.close()
            _launcher = None
        return running


def get(env: dict[str, str]) -> Launcher | None:
    """This process's launcher for engines with `env`: the one running if it serves them, else a new one
    started with `env` (the old one closed: its import would serve no later launch either); None when the
    launcher is off."""
    global _launcher
    if not enabled():
        return None
    with _guard:
        if _launcher is None or not _launcher.serves(env):
            if _launcher is not None:
                _launcher.close()
            _launcher = Launcher(env)
            atexit.register(_launcher.close)
        return _launcher
