"""The reference engine's process (serve.py) as an interface.Engine: started in its own process group under
engine_guard, ready when /health answers, reaped whole on stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipeline.engines.interface import EngineError, KVLayout, Launch, free_port, wait_ready
from pipeline.engines.memory import MemorySampler
from pipeline.setup import envs

SERVED_NAME = "model"


class Server:
    """interface.Engine for the reference engine."""

    def __init__(self, spec: Launch):
        self.spec, self.log_path, self.served_name = spec, spec.log_path, SERVED_NAME
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.memory: MemorySampler | None = None
        self.start_s: float | None = None
        self.launch = "cold"  # a new interpreter each start
        self.busy_s = 0.0
        self._t0: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pipeline.engines.engine_guard", sys.executable, "-m",
               "pipeline.engines.transformers.serve", "--model", str(self.spec.model_dir), "--port", str(self.port),
               "--dtype", self.spec.dtype, "--served-name", SERVED_NAME]
        if self.spec.tokenizer is not None:
            cmd += ["--tokenizer", str(self.spec.tokenizer)]
        return cmd

    def __enter__(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        root = Path(__file__).resolve().parents[3]
        env = {**envs.writes_bytecode(dict(os.environ)), "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_VERBOSITY": "error",
               "TQDM_DISABLE": "1"}  # compressed-tensors' bars, a line per module in the log
        with open(self.log_path, "w") as log:
            self._t0 = t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.memory = MemorySampler(self.proc.pid, _gpu=False).start()
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log_tail(self, n: int = 3) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-n:])[-600:]

    def _wait_ready(self, t0: float) -> None:
        wait_ready("reference engine", self.proc, self.base_url, t0, self.spec.settings.startup_timeout_s,
                   self.log_path, self.spec.say, lambda: self._log_tail(1) or "importing", self._log_tail)

    def stop(self) -> None:
        if self.memory:
            self.memory.stop()
        if self.proc is None:
            return
        if self._t0 is not None:
            self.busy_s += time.perf_counter() - self._t0
            self._t0 = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # it holds nothing that needs a clean exit
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    @contextlib.contextmanager
    def blamed_for_errors(self):
        try:
            yield
        except Exception as exc:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineError(f"the reference engine failed while serving: {self._log_tail()} "
                                  f"(log: {self.log_path}; client saw {type(exc).__name__})") from exc
            raise

    def loaded_weights(self) -> dict | None:
        return None

    def kv_layout(self) -> KVLayout:
        return KVLayout(block_size=None, num_blocks=None)

    def pool_sizing(self) -> dict | None:
        return None

    def gauges(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base_url + "/gauges", timeout=10) as r:
            return {k: float(v) for k, v in json.loads(r.read()).items()}
