"""What a run prints: one timestamped line per event, labelled with the variant it concerns."""

from __future__ import annotations

import time

_last_line = [time.monotonic()]  # when the run last printed a line (say, or a progress line)


def printed() -> None:
    _last_line[0] = time.monotonic()


def silent_for() -> float:
    """Seconds since the run's console last got a line: progress bars speak up when it nears their cadence,
    so consecutive short steps (each quieter than a bar's own 10 s) never add up to a long silence."""
    return time.monotonic() - _last_line[0]


def say(variant: str, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {variant:>14} | {msg}", flush=True)
    printed()
