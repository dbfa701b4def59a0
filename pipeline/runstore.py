"""The run folder: where a run lives, how results are written, and when a stage is done.

    runs/<recipe>-<utc>/manifest.json         recipe snapshot, hashes, versions, hardware
    runs/<...>/<variant>/{quantize,quality,systems}.json, samples/<suite>.jsonl, logs
    runs/<...>/signoff.json, results.json, report.html

Writes go to a temp file and `os.replace` it, so a killed run leaves either the old file
or the new one. A stage is done when its JSON validates and its input hash matches.
Rerunning a recipe resumes the newest run folder of that recipe name: stages whose input
hash is unchanged are not recomputed, changed ones are (`--fresh` starts a new folder).
A run of another recipe is never written to.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

T = TypeVar("T", bound=BaseModel)
_UMASK = os.umask(0)
os.umask(_UMASK)


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def hash_obj(obj) -> str:
    return hashlib.sha256(canonical(obj).encode()).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(root: Path, pattern: str = "*") -> str:
    """One hash over the relative names and contents of the files under root."""
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob(pattern) if q.is_file()):
        h.update(str(p.relative_to(root)).encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the weight files alone (safetensors, else .bin), counted the same way for the
    baseline and every variant; tokenizer files and stray copies do not count."""
    files = list(model_dir.glob("*.safetensors")) or list(model_dir.glob("*.bin"))
    return sum(p.stat().st_size for p in files) if files else dir_bytes(model_dir)


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; results are for reviewers to read
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tmp_name(target: Path) -> Path:
    """<name>.tmp<pid>@<host>: a cache shared by several hosts tells whose half-written file or folder it is."""
    import socket

    return target.with_name(f"{target.name}.tmp{os.getpid()}@{socket.gethostname()}")


def drop_stale_tmp(target: Path) -> None:
    """Half-written files or folders of killed runs (<name>.tmp<pid>[@<host>], that pid gone on this
    host) are never trusted; another host's are left alone (its pids are not in this /proc)."""
    import socket

    for tmp in target.parent.glob(target.name + ".tmp*"):
        pid, _, host = tmp.name.rsplit(".tmp", 1)[1].partition("@")
        if host and host != socket.gethostname():
            continue
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(target: Path, replace: bool = True) -> Iterator[Path]:
    """A folder that appears whole or not at all: yields an empty temporary folder beside target to
    fill, then renames it onto target. Nothing is published when the block raises or leaves the
    folder empty (a producer that had nothing to write). replace=False keeps a target another writer
    published first (content-addressed: both wrote the same thing); any other failure to publish raises."""
    drop_stale_tmp(target)
    tmp = tmp_name(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not any(tmp.iterdir()):
        tmp.rmdir()
        return
    if replace:
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if replace or not target.exists():
            raise


def write_json(path: Path, obj) -> None:
    if isinstance(obj, BaseModel):
        text = obj.model_dump_json(indent=2)
    else:
        text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    atomic_write_text(path, text + "\n")


def read_result(path: Path, model: type[T], input_hash: str | None = None) -> T | None:
    """The result at path if it validates (and matches input_hash when given), else None."""
    try:
        result = model.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError):
        return None
    if input_hash is not None and getattr(result, "input_hash", None) != input_hash:
        return None
    return result


class RunLocked(Exception):
    """Another process is running this recipe; one line naming it."""


@contextmanager
def run_lock(runs_dir: Path, recipe_name: str, lock_dir: Path) -> Iterator[None]:
    """One run of a recipe at a time: two would resume into one folder and overwrite each other's
    stages. The lock lives in lock_dir (the cache), so a run refused before it starts leaves nothing
    in the runs folder; the holder's pid, host and start time are in it, for the one refused."""
    import fcntl
    import socket

    lock_dir.mkdir(parents=True, exist_ok=True)
    path = lock_dir / f"{recipe_name}-{hash_obj(str(runs_dir.resolve()))[:12]}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise RunLocked(f"recipe {recipe_name!r} is already running ({holder}; lock {path}): wait for it "
                            "or stop it; its run folder is resumed by the next run") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        f.flush()
        yield


class RunDir:
    def __init__(self, root: Path):
        self.root = root

    def variant(self, name: str) -> Path:
        return self.root / name

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"


def open_run(runs_dir: Path, recipe_name: str, identity: str, fresh: bool = False) -> tuple[RunDir, bool]:
    """The newest run of this recipe (resumed), else a new folder. A run is this recipe's when its
    manifest has the same name and the same identity (the hash of what the experiment is: model,
    engine, calibration, quality, workload), so a different recipe that happens to share the name
    never resumes into it, while adding a variant or changing a gate does. Absolute: the workers that
    write into it run from the repository's root, not from where the user started the run."""
    runs_dir = runs_dir.resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    if not fresh:
        for cand in sorted(runs_dir.glob(f"{recipe_name}-*"), reverse=True):
            try:
                manifest = json.loads((cand / "manifest.json").read_text())
            except (OSError, ValueError):
                continue
            # the same experiment: resumed, and the stages' input hashes decide what reruns
            if manifest.get("recipe_name") == recipe_name and manifest.get("identity") == identity:
                return RunDir(cand), True
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    root = runs_dir / f"{recipe_name}-{stamp}"
    n = 1
    while root.exists():
        n += 1
        root = runs_dir / f"{recipe_name}-{stamp}-{n}"
    root.mkdir(parents=True)
    return RunDir(root), False
