"""The installer behind the two environments: uv where it can be had, pip otherwise, same pins.

uv (pinned, installed once with pip into the cache's tools folder) resolves and installs the
same requirement files several times faster than pip. It does not read pip's configuration,
so the settings pip would use here (index, extra indexes, find-links, constraints, certificate,
timeout) are read from `pip config list` and handed to uv explicitly, with pip's rule of taking
the best version across every index. A pip setting this module does not know how to hand over,
a uv that cannot be installed, or a uv install that fails, all mean pip builds the environment
instead, and the log says why. QUANTIZE_EVAL_INSTALLER=pip forces pip.

Standard library only: it runs under the system python3 before anything is installed.
"""

from __future__ import annotations

import ast
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

UV = "uv==0.13.9"
# pip settings with nothing to hand over: they change pip's chatter, not what gets installed
# (pip's own cache: uv keeps its own)
HARMLESS = {"disable-pip-version-check", "no-warn-script-location", "progress-bar", "quiet",
            "verbose", "no-color", "root-user-action", "require-virtualenv", "cache-dir", "no-cache-dir"}
LISTS = ("find-links", "extra-index-url", "trusted-host")
SINGLE = ("index-url", "constraint", "cert", "default-timeout", "timeout", "no-index", "proxy")
# the sections `pip install` reads, weakest first (`pip config list` prints section.key)
SCOPES = ("global", "install", ":env:")


def pip_settings(listing: str) -> tuple[dict, list[str]]:
    """Parse `pip config list` output into {key: value or [values]} and the keys not understood."""
    found: dict[str, list[tuple[int, str]]] = {}
    for line in listing.splitlines():
        name, sep, raw = line.partition("=")
        if not sep or "." not in name:
            continue
        scope, _, key = name.rpartition(".")
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip().strip("'\"")
        if scope not in SCOPES:
            continue  # another command's section (download, freeze, ...)
        rank = SCOPES.index(scope)
        found.setdefault(key, []).append((rank, str(value)))
    settings: dict = {}
    unknown = []
    for key, values in found.items():
        values.sort(key=lambda rv: rv[0])
        if key in LISTS:
            seen: list[str] = []
            for _, v in values:
                seen += [x for x in v.split() if x not in seen]
            settings[key] = seen
        elif key in SINGLE:
            settings[key] = values[-1][1]
        elif key not in HARMLESS:
            unknown.append(key)
    return settings, unknown


def uv_arguments(settings: dict) -> tuple[list[str], dict[str, str]]:
    """uv pip install's flags and environment that ask for what pip's settings ask for."""
    args = ["--index-strategy", "unsafe-best-match"]
    env: dict[str, str] = {}
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if settings.get("index-url"):
        args += ["--index-url", settings["index-url"]]
    for url in settings.get("extra-index-url", []):
        args += ["--extra-index-url", url]
    for place in settings.get("find-links", []):
        args += ["--find-links", place]
    for host in settings.get("trusted-host", []):
        args += ["--allow-insecure-host", host]
    if settings.get("constraint"):
        args += ["--constraint", settings["constraint"]]
    if settings.get("proxy"):
        env["HTTP_PROXY"] = env["HTTPS_PROXY"] = settings["proxy"]
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = settings["cert"]
    timeout = settings.get("timeout") or settings.get("default-timeout")
    if timeout:
        env["UV_HTTP_TIMEOUT"] = timeout
    return args, env


class Installer:
    """Creates a venv and installs into it, with uv or with pip; `name` says which."""

    def __init__(self, tools: Path, log, force_pip: bool = False):
        self.log = log
        self.uv, self.uv_args, self.uv_env, why = None, [], {}, ""
        if force_pip:
            why = "uv failed above"
        elif os.environ.get("QUANTIZE_EVAL_INSTALLER", "").lower() == "pip":
            why = "QUANTIZE_EVAL_INSTALLER=pip"
        elif (listing := self._pip_config()) is None:
            why = "pip's settings could not be read (pip config list failed)"
        else:
            settings, unknown = pip_settings(listing)
            if unknown:
                why = f"pip settings uv would not be given: {', '.join(sorted(unknown))}"
            else:
                self.uv_args, self.uv_env = uv_arguments(settings)
                self.uv, why = bootstrap_uv(tools, log)
        self.name = UV.replace("==", " ") if self.uv else "pip"
        if not self.uv:
            self._say(f"# installer: pip ({why})")

    def _say(self, text: str) -> None:
        self.log.write(text + "\n")
        self.log.flush()

    def _pip_config(self) -> str | None:
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                                  text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout if proc.returncode == 0 else None

    def run(self, cmd: list[str], env: dict | None = None) -> None:
        run_logged(cmd, self.log, {**os.environ, **(env or {})})

    def _uv(self, *args: str) -> None:
        self.run([self.uv, *args], env={**self.uv_env, "UV_PYTHON_DOWNLOADS": "never",
                                        "UV_NO_PROGRESS": "1"})

    def venv(self, target: Path, pip_pin: str) -> None:
        """A new venv at `target` holding the pinned pip (optional extras are installed later)."""
        py = str(target / "bin" / "python")
        if self.uv:
            self._uv("venv", "--no-config", "--python", sys.executable, str(target))
            self.install(py, [pip_pin])
        else:
            self.run([sys.executable, "-m", "venv", str(target)])
            self.run([py, "-m", "pip", "install", "-q", pip_pin])

    def install(self, py: str, args: list[str]) -> None:
        if self.uv:
            self._uv("pip", "install", "--no-config", "--python", py, *self.uv_args, *args)
        else:
            self.run([py, "-m", "pip", "install", *args])

    def uninstall(self, py: str, names: tuple[str, ...]) -> None:
        if self.uv:
            self._uv("pip", "uninstall", "--no-config", "--python", py, *names)
        else:
            self.run([py, "-m", "pip", "uninstall", "-y", *names])


def run_logged(cmd: list[str], log, env: dict[str, str]) -> None:
    """`cmd` under exactly `env`, the command line and its output into `log`; RuntimeError if it fails."""
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}")


def bootstrap_uv(tools: Path, log) -> tuple[str | None, str]:
    """The pinned uv, installed once into `tools` with pip; (path, "") or (None, why not)."""
    where = tools / UV.replace("==", "-")
    exe = where / "bin" / "uv"
    if exe.exists():
        return str(exe), ""
    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f".{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # both environments are built at once: one installs uv
        if exe.exists():
            return str(exe), ""
        staging = where.with_name(where.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)  # an interrupted earlier attempt
        shutil.rmtree(where, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging), UV]
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=300)
        except subprocess.TimeoutExpired:
            return None, f"installing {UV} timed out"
        if proc.returncode != 0 or not (staging / "bin" / "uv").exists():
            return None, f"{UV} could not be installed (exit {proc.returncode})"
        os.replace(staging, where)
    return str(exe), ""
