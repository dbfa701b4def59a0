"""What a run prints: one timestamped line per event (`say`), and the progress of a long step,
as users of these tools expect to see it.

On a terminal: one line redrawn in place, `done/total`, the rate and the ETA. Elsewhere (CI logs,
a file): a plain line every `every` seconds, so a log shows the run is alive without a line per
item. A step with no known total shows what is done and the time it has taken. `--quiet`
(QUANTIZE_EVAL_QUIET=1) shows none of it: the stage summary lines and the verdict stay.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

QUIET_ENV = "QUANTIZE_EVAL_QUIET"


_last_line = [time.monotonic()]  # when the run last printed a line (say, or a progress line)


def printed() -> None:
    _last_line[0] = time.monotonic()


def silent_for() -> float:
    """Seconds since the run's console last got a line: progress bars speak up when it nears their cadence,
    so consecutive short steps (each quieter than a bar's own 10 s) never add up to a long silence."""
    return time.monotonic() - _last_line[0]


def say(variant: str, msg: str) -> None:
    """One event of a run, labelled with the variant it concerns."""
    print(f"[{time.strftime('%H:%M:%S')}] {variant:>14} | {msg}", flush=True)
    printed()


def quiet() -> bool:
    return os.environ.get(QUIET_ENV) == "1"


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


class Progress:
    """`with Progress("quality", 1000, "prompts", label="baseline") as p: ... p.advance()` (thread-safe)."""

    def __init__(self, what: str, total: int | None = None, unit: str = "", label: str = "", every: float = 10.0,
                 stream=None, clock: Callable[[], float] = time.monotonic):
        self.what, self.total, self.unit, self.label, self.every = what, total, unit, label, every
        self.stream = stream or sys.stdout
        self.clock = clock
        self.done = 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = self._last = clock()
        self._lock = threading.Lock()
        self.lines = 0  # plain lines written (non-terminal mode)
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Progress:
        """As a context manager it also ticks: a line every `every` s even while nothing completes (a first
        request that takes a while), so a step is never silent longer than that."""
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self.close()

    def _tick(self) -> None:
        while not self._stop.wait(1.0 if self.tty else self.every / 4):
            self.update(self.done)

    def text(self) -> str:
        elapsed = self.clock() - self._t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            eta = (self.total - self.done) / rate if rate > 0 else None
            return (f"{self.what}: {self.done}/{self.total}{unit} ({self.done / self.total:.0%}), {rate:.1f}/s, "
                    + (f"ETA {_seconds(eta)}" if eta is not None else "ETA –"))
        return f"{self.what}: {self.done}{unit} in {_seconds(elapsed)}" if self.unit else \
            f"{self.what}: {_seconds(elapsed)} so far"

    def _emit(self, final: bool = False) -> None:
        stamp = time.strftime("%H:%M:%S")
        head = f"[{stamp}] {self.label:>14} | " if self.label else f"[{stamp}] "
        if self.tty:
            width = 24
            bar = ""
            if self.total:
                fill = int(width * min(1.0, self.done / self.total))
                bar = "[" + "#" * fill + "-" * (width - fill) + "] "
            self.stream.write("\r\033[K" + head + bar + self.text() + ("\n" if final else ""))
        else:
            self.stream.write(head + self.text() + "\n")
            self.lines += 1
            printed()
        self.stream.flush()

    def update(self, done: int) -> None:
        with self._lock:
            self.done = done
            now = self.clock()
            if quiet():
                return
            # on the real clock, silence is the console's (any step's last line, this bar's included), so
            # consecutive short steps never add up to a long silence; on an injected clock, this bar's own
            quiet_s = silent_for() if self.clock is time.monotonic else now - self._last
            if self.tty or quiet_s >= self.every * 0.95:
                self._last = now
                self._emit()

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def close(self) -> None:
        """On a terminal, finish the redrawn line; elsewhere nothing more (the stage summary follows)."""
        if self.tty and not quiet():
            self._emit(final=True)


class Heartbeat:
    """For a step that runs in a subprocess: elapsed time every `every` s, or done/total, rate and ETA
    when `count` (polled) returns (done, total), e.g. read from the subprocess's log."""

    def __init__(self, what: str, label: str = "", every: float = 10.0, stream=None,
                 count: Callable[[], tuple[int, int] | None] | None = None, unit: str = ""):
        self.progress = Progress(what, None, "", label, every, stream)
        self.count, self.unit = count, unit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0 if self.progress.tty else self.progress.every / 4):
            seen = self.count() if self.count else None
            if seen:
                self.progress.total, self.progress.unit = seen[1], self.unit
            self.progress.update(seen[0] if seen else 0)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.progress.close()
