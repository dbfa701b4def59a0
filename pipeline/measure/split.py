"""The search's two halves of the quality data: what the ladder may read (search) and what signs its answer off
(sealed), chosen by a seed before any candidate is scored.

    suites        each suite's items, each given to a side by a hash of (seed, suite, item id): about half each
    drift, prose  whole essays: a seeded shuffle of the essays the drift windows come from, each given to the
                  side with fewer windows so far, so the sealed prose is other documents, not other windows
                  of the same text (the drift intervals resample whole documents too)
    drift, code   the second text domain (HumanEval, `quality.drift.code_windows`): sealed only; the search
                  never reads a line of code

Every variant is scored on all of it in one pass (one engine start); the halves are a view the sign-off takes
(pipeline/stages/signoff.py), so a side depends only on the seed and the data, never on any score. Pure.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

SIDES = ("search", "sealed")


@dataclass(frozen=True)
class Split:
    side: str  # "search" | "sealed"
    seed: int

    def __post_init__(self):
        if self.side not in SIDES:
            raise ValueError(f"split side {self.side!r}: one of {', '.join(SIDES)}")

    def items(self, suite: str, ids: list) -> list:
        """This side's items of a suite: each item's side is a coin of its own, (seed, suite, id) hashed, so it
        never moves with which other items a variant happens to share (about half on each side)."""
        return sorted(i for i in ids if self.side_of(suite, i) == self.side)

    def side_of(self, suite: str, item) -> str:
        h = hashlib.sha256(f"{self.seed}:{suite}:{item}".encode()).digest()
        return SIDES[h[0] & 1]

    def essays(self, rows: list[dict]) -> set[str]:
        """The essays (documents) this side's prose windows come from."""
        count: dict[str, int] = {}
        for r in prose(rows):
            count[doc(r)] = count.get(doc(r), 0) + 1
        docs = sorted(count)
        random.Random(f"{self.seed}:drift").shuffle(docs)
        held = {"search": 0, "sealed": 0}
        mine = set()
        for d in docs:  # the side with fewer windows takes the next essay; search on a tie
            side = "search" if held["search"] <= held["sealed"] else "sealed"
            held[side] += count[d]
            if side == self.side:
                mine.add(d)
        return mine

    def prose(self, rows: list[dict]) -> list[dict]:
        """This side's essay windows."""
        mine = self.essays(rows)
        return [r for r in prose(rows) if doc(r) in mine]

    def code(self, rows: list[dict]) -> list[dict]:
        """The second domain's windows: all of them on the sealed side, none on the search side."""
        return code(rows) if self.side == "sealed" else []

    def describe(self) -> str:
        return f"{self.side} half, split seed {self.seed}"


def domain(row: dict) -> str:
    return row.get("domain", "essays")  # samples scored before domains were recorded: essays only


def doc(row: dict) -> str:
    return row.get("doc") or f"window-{row.get('window')}"


def prose(rows: list[dict]) -> list[dict]:
    return [r for r in rows if domain(r) == "essays"]


def code(rows: list[dict]) -> list[dict]:
    return [r for r in rows if domain(r) == "code"]
