"""What every serving engine offers the stages: the seam a second engine plugs into.

An engine kind is a package under pipeline/engines/ (vllm/ today) whose __init__ provides the
functions of `EngineKind`; `kind(name)` imports it. The stages never name an engine's command
line, metric names or kernels: they hand a `Launch` to `launch()`, wait on the returned `Engine`
as a context manager (launch, readiness, always reaped), and read it through the neutral methods
below. An OpenAI-compatible HTTP endpoint at `base_url` serving `served_name` is part of the
contract: lm-eval and the load generator (loadgen.py) speak to every engine the same way.
"""

from __future__ import annotations

import contextlib
import importlib
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# the scheduler gauges every engine reports, under these names: sequences running and waiting now,
# the fraction of the KV pool in use (0-1), preemptions and finished requests since the engine started
GAUGES = ("running", "waiting", "kv_usage", "preemptions", "finished")
HERE = Path(__file__).resolve().parent


class EngineError(Exception):
    """The engine failed to start, crashed or timed out; message says which and why."""


@dataclass(frozen=True)
class KVLayout:
    """The KV pool as the engine cut it. `null_blocks`: blocks the pool keeps that never hold tokens."""
    block_size: int | None
    num_blocks: int | None
    max_concurrency: float | None = None  # the engine's own figure for requests of max_model_len
    null_blocks: int = 0

    @property
    def usable_blocks(self) -> int | None:
        return self.num_blocks - self.null_blocks if self.num_blocks else None


@dataclass
class Launch:
    """Everything one engine start depends on. `settings` is the recipe's engine section (identical for
    every variant); the rest is what one variant changes on purpose."""
    model_dir: Path
    settings: object  # recipe.serving.EngineSettings
    dtype: str
    log_path: Path
    trust_remote_code: bool = False
    kv_cache_dtype: str = "auto"  # "fp8": an FP8 KV cache (scales from the checkpoint where it has them)
    load_quantization: str | None = None  # quantize the weights while loading ("bitsandbytes")
    tokenizer: Path | None = None  # where the weights folder carries none (imported checkpoints)
    max_logprobs: int | None = None  # top-k log-probabilities a request may ask for, above the engine's default
    kv_pool_bytes: int | None = None  # a fixed pool; None: the engine sizes its pool itself
    # the engine sizes its pool so its whole process tree keeps within this many bytes, of which
    # `outside_bytes` is what its own sizing does not count (measure/overhead.py); None: its own default
    memory_budget_bytes: int | None = None
    outside_bytes: int = 0
    numerics: dict[str, str] | None = None  # the engine environment of the compute path (EngineKind.numerics_env)
    extra: list[str] = field(default_factory=list)  # engine-specific options a test or benchmark adds
    # where a start says what it is doing while it is not ready yet (the run's console), so a long start
    # is never a silent one; None: silent. Not part of what the start depends on.
    say: Callable[[str], None] | None = field(default=None, compare=False, repr=False)

    def options(self) -> dict:
        """What this launch changes on purpose, as keyed into results (paths differ per machine)."""
        return {"kv_cache_dtype": self.kv_cache_dtype, "load_quantization": self.load_quantization,
                "max_logprobs": self.max_logprobs, "own_tokenizer": self.tokenizer is None}


class Engine(Protocol):
    """One running engine. Enter it to launch and wait until it answers; leaving stops it and its
    whole process tree. `memory` samples that tree from launch to stop (memory.MemorySampler)."""
    served_name: str
    port: int
    log_path: Path
    memory: object
    start_s: float | None
    launch: str  # how it started, which start_s depends on: "cold", "warm", "warm, after the launcher's import"
    busy_s: float

    @property
    def base_url(self) -> str: ...
    def __enter__(self) -> Engine: ...
    def __exit__(self, *exc) -> None: ...
    def stop(self) -> None: ...
    def blamed_for_errors(self) -> contextlib.AbstractContextManager: ...
    def loaded_weights(self) -> dict | None: ...  # bytes of parameters and buffers it holds once loaded
    def kv_layout(self) -> KVLayout: ...
    # how the engine sized its pool under Launch.memory_budget_bytes: what it was asked for and what it
    # read and decided (budget_bytes, outside_bytes, requested_bytes, non_kv_bytes, ...); None: not budget-sized
    def pool_sizing(self) -> dict | None: ...
    def gauges(self) -> dict[str, float]: ...  # GAUGES, by those names


class EngineKind(Protocol):
    """The module-level functions an engine package provides."""
    def launch(self, spec: Launch) -> Engine: ...
    def numerics_env(self, compute: str = "") -> dict[str, str]: ...  # environment of a compute path
    def placement(self) -> dict[str, str]: ...  # process layout (part of what a measurement means)
    def capabilities(self) -> dict: ...  # what this engine build can run on this host (asked of it, cached)
    def decide(self, fmt, model_cfg: dict, caps: dict | None = None, dtype: str = "float32",
               activations: str = "auto"): ...  # a formats.Decision
    def architectures(self) -> set[str] | None: ...  # model classes it serves (None: cannot tell here)
    def native_on(self, weights: str) -> str: ...  # where a weight format runs natively, in words
    # why this engine measures no memory, capacity or latency (its variants' systems are N/A); None: it does
    def systems_not_measured(self) -> str | None: ...
    # begin, in the background, what makes this run's engine starts faster; wait=True: until it is ready,
    # returning the seconds that took (benchmarks/engine_start.py), None where there is nothing to begin
    def prestart(self, wait: bool = False) -> float | None: ...


HEARTBEAT_S = 10.0  # at most this long without a line while an engine starts


def wait_ready(what: str, proc, base_url: str, t0: float, timeout_s: float, log_path: Path,
               say: Callable[[str], None] | None, phase: Callable[[], str], tail: Callable[[], str]) -> None:
    """Until the engine process `proc`, launched at perf_counter() `t0`, answers GET /health with 200: saying
    where its start is (`phase`) at least every HEARTBEAT_S, failing with its log's `tail` if it exits, and
    after `timeout_s`."""
    next_say = t0 + HEARTBEAT_S
    while (now := time.perf_counter()) < t0 + timeout_s:
        if say is not None and now >= next_say:
            say(f"{what} start: {now - t0:.0f} s so far ({phase()})")
            next_say = now + HEARTBEAT_S
        if proc.poll() is not None:
            raise EngineError(f"{what} exited with code {proc.returncode} while starting: {tail()} (log: {log_path})")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)  # a refused connection costs nothing; a ready engine waits at most this
    raise EngineError(f"{what} not ready after {timeout_s:.0f} s (engine.startup_timeout_s); log: {log_path}")


def free_port() -> int:
    """A free localhost port for an engine's HTTP endpoint."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kinds() -> tuple[str, ...]:
    """The engine kinds here: folders under pipeline/engines/ whose __init__.py defines launch(), found
    without importing them (an engine's imports are heavy and live in its own environment)."""
    return tuple(sorted(d.name for d in HERE.iterdir()
                        if (d / "__init__.py").exists() and "\ndef launch(" in (d / "__init__.py").read_text()))


def kind(name: str = "vllm") -> EngineKind:
    if name not in kinds():
        raise ValueError(f"engine.kind: {name!r} is not one of {', '.join(kinds())}")
    return importlib.import_module(f"pipeline.engines.{name}")
