"""One variant's outcome, read from the run folder the same way by both executors.

Stage code (local or in a Ray task's process) writes result files into the variant's folder
and one accounting line per stage process (`stage-accounting.jsonl`); the executor that ran
it, local or Ray, then reads the outcome and the accounting back from disk with this module,
so sign-off sees the same thing whichever executor ran the stages.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.results import QualityResult, QuantizeResult, SystemsResult
from pipeline.runstore import read_result, write_json

ACCOUNTING = "stage-accounting.jsonl"
BASELINE_FAILED = "not evaluated: the baseline failed, so there is nothing to compare against"


@dataclass
class Spent:
    """What the stages of one process spent: engine starts, seconds engines were alive, seconds
    quantize-environment workers (quantize, dequantize) ran."""

    engine_starts: int = 0
    engine_s: float = 0.0
    quantizer_s: float = 0.0

    def add(self, other: Spent) -> None:
        self.engine_starts += other.engine_starts
        self.engine_s += other.engine_s
        self.quantizer_s += other.quantizer_s


@dataclass
class VariantOutcome:
    """What one variant's stages left: results, or why it was skipped, or why it failed."""

    quantize: QuantizeResult | None = None
    quality: QualityResult | None = None
    systems: SystemsResult | None = None
    skipped: str | None = None
    error: str | None = None
    support: dict | None = None  # the engine support decision (support.json), for variants

    @classmethod
    def coerce(cls, obj) -> VariantOutcome:
        """Outcomes as dicts ({"quality": ..., "error": ...}) are accepted too (tests build them so)."""
        if isinstance(obj, VariantOutcome):
            return obj
        d = dict(obj or {})
        return cls(quantize=d.get("quantize"), quality=d.get("quality"), systems=d.get("systems"),
                   skipped=d.get("skipped"), error=d.get("error"), support=d.get("support"))


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read(vdir: Path) -> VariantOutcome:
    """A variant's outcome as its stages left it in its folder."""
    err = _json(vdir / "error.json").get("error")
    if err:
        return VariantOutcome(error=err)
    support = _json(vdir / "support.json")
    out = VariantOutcome(quantize=read_result(vdir / "quantize.json", QuantizeResult), support=support or None)
    if support.get("mode") == "unsupported":
        out.skipped = support.get("reason", "unsupported")
        return out
    out.quality = read_result(vdir / "quality.json", QualityResult)
    out.systems = read_result(vdir / "systems.json", SystemsResult)
    return out


def record_failure(vdir: Path, msg: str, tb: str = "") -> None:
    """A variant's outcome is this error (read back by `read`), until a later run of it succeeds."""
    vdir.mkdir(parents=True, exist_ok=True)
    write_json(vdir / "error.json", {"error": msg, "traceback": tb})


def record(run_root: Path, variant: str, stage: str, t_start: float, spent: Spent) -> None:
    """One line per stage process: what it spent, for the run's totals."""
    line = {"t0": t_start, "t": time.time(), "variant": variant, "stage": stage,
            "engine_starts": spent.engine_starts, "engine_s": spent.engine_s, "quantizer_s": spent.quantizer_s}
    with open(run_root / ACCOUNTING, "a") as f:
        f.write(json.dumps(line) + "\n")


def accounting(run_root: Path, since: float) -> Spent:
    """What the stage processes of this invocation (ended at or after `since`) spent. A torn
    line (a process killed mid-write) is skipped, not fatal."""
    total = Spent()
    try:
        lines = (run_root / ACCOUNTING).read_text().splitlines()
    except OSError:
        return total
    for line in lines:
        try:
            rec = json.loads(line)
            if rec["t"] >= since:  # ended in this invocation (end times leave room for other hosts' clocks)
                total.add(Spent(int(rec["engine_starts"]), float(rec["engine_s"]), float(rec["quantizer_s"])))
        except (ValueError, KeyError, TypeError):
            continue
    return total
