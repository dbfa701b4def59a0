"""The far end of the warm launcher (launcher.py): a process that imports vLLM once and forks engines.

    python -m pipeline.engines.vllm.zygote FD [FOLDER]

Started with the environment every engine of the run shares. It imports what vLLM's API server imports
(on a 2-core CPU machine, most of an engine start), then reads launch requests from the socket FD, one
JSON line each ({"module", "argv", "env", "cwd", "log", "exit_file", "owner"}), and answers each with one line: the
pid of the engine's process group, or an error. Per request it forks a child that opens a session of
its own (the caller takes the engine tree down with killpg, as it does a cold start's) and forks
again: the grandchild becomes the engine (the request's environment, stdin from /dev/null, stdout and
stderr on the engine log, the caller's working folder, the cold command line as its title, the
module run as `python -m` runs it), and the child then execs
engine_guard, a fresh small interpreter, so the tree's memory holds no extra copy of these imports
(engines/memory.py sums RSS over the tree). It has run no OpenMP region when it forks, holds no
device and no event loop: the same state the API server forks its engine core from
(hooks/sitecustomize.py). It exits when its caller closes the socket or dies, removing its folder
(the one its log is in); stopped by SIGTERM (the caller's close) between forking an engine and
answering for it, it kills that engine first, since no caller will ever stop it.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import shutil
import signal
import socket
import sys
import traceback

# what `python -m vllm.entrypoints.openai.api_server` imports before its first line, and then the engine
# core and the CPU worker, which it imports before its model loads
PRELOAD = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.api_server.entry",
           "vllm.v1.engine.async_llm", "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker")


BASE = dict(os.environ)  # the environment it was started with, before any import wrote into it
_unanswered: int | None = None  # the guard of the engine forked for the request not answered yet


def preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the engine imports it itself, and says why it fails
            print(f"QE-ZYGOTE could not preload {name}: {type(exc).__name__}: {exc}", flush=True)


def _engine(req: dict) -> None:
    """In the grandchild: become the engine. Never returns."""
    import runpy
    import signal

    code = 1
    try:
        try:  # what ps and pgrep show: the cold start's command line, not this launcher's. Before the
            # environment is replaced: setproctitle finds room for a title after argv only while the C
            # environment is where the kernel put it (vLLM's own titles, VLLM::EngineCore, need this too)
            import setproctitle

            setproctitle.setproctitle(" ".join([sys.executable, "-m", req["module"], *req["argv"]]))
        except Exception:  # noqa: BLE001 - a title is not worth an engine
            pass
        # a cold start's environment: the launch's, then what importing vLLM wrote into it (vllm/env_override.py:
        # TORCHINDUCTOR_COMPILE_THREADS=1 and the like), as a new interpreter would have it after `import vllm`
        by_imports = {k: v for k, v in os.environ.items() if BASE.get(k) != v}
        os.environ.clear()
        os.environ.update({**req["env"], **by_imports})
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print("QE-LAUNCH warm: forked from a process with vLLM imported", file=sys.stderr, flush=True)
        sys.argv = ["-m", *req["argv"]]
        sys.modules.pop(req["module"], None)  # run as __main__ only, as `python -m` does (its imports stay)
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - the engine's own error goes to its log, as a cold start's would
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()  # what a normal interpreter exit runs (vLLM's shutdown hooks)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def launch(req: dict, sock: socket.socket) -> dict:
    global _unanswered
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the guard-to-be: a session of its own, the engine its child
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            sock.close()
            os.close(r)
            os.setsid()
            engine = os.fork()
            if engine == 0:
                os.close(w)
                _engine(req)
            os.write(w, str(engine).encode())
            os.close(w)
            os.execve(sys.executable, [sys.executable, "-m", "pipeline.engines.engine_guard", "--pid", str(engine),
                                       "--exit-file", req["exit_file"], "--owner", str(req["owner"])], req["env"])
        finally:
            os._exit(127)
    _unanswered = pid
    os.close(w)
    got = os.read(r, 64)
    os.close(r)
    if not got:
        return {"error": "the launch child died before it forked the engine"}
    return {"pid": pid, "engine_pid": int(got)}


def _stopped(*_args) -> None:
    """SIGTERM: the caller closed this launcher, perhaps having given up on a launch in flight, whose engine
    nobody would stop; the engines it did answer for are the caller's and keep serving."""
    if _unanswered is not None:
        for kill in (os.killpg, os.kill):  # its group once it opened its session; the child itself before
            try:
                kill(_unanswered, signal.SIGKILL)
            except OSError:
                pass
    sys.exit(0)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _stopped)
    try:
        return serve(socket.socket(fileno=int(argv[0])))
    finally:  # its folder goes with it however it ends (a forked child never returns through here)
        if len(argv) > 1:
            shutil.rmtree(argv[1], ignore_errors=True)


def serve(sock: socket.socket) -> int:
    global _unanswered
    parent = os.getppid()
    preload()
    # what the imports built stays out of the collector's reach: forked engines would otherwise copy the
    # pages a collection touches, and each engine's tree would hold more of the launcher than it shares
    gc.collect()
    gc.freeze()
    print("QE-ZYGOTE ready", flush=True)
    buf = b""
    while True:
        ready, _, _ = select.select([sock], [], [], 0.5)
        while True:  # reap the guards that exited (they are this process's children)
            try:
                done, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not done:
                break
        if os.getppid() != parent:  # the caller died: no new engines; its engines' guards see this exit
            return 0
        if not ready:
            continue
        data = sock.recv(1 << 20)
        if not data:
            return 0
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                answer = launch(json.loads(line), sock)
            except Exception as exc:  # noqa: BLE001 - the caller starts the engine cold instead
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            sock.sendall((json.dumps(answer) + "\n").encode())
            _unanswered = None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
