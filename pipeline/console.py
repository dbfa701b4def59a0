"""What a run prints: one timestamped line per event, labelled with the variant it concerns."""

from __future__ import annotations

import time


def say(variant: str, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {variant:>14} | {msg}", flush=True)
