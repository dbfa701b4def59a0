"""What a quality gate can certify at the recipe's item counts: stated before a run, not after.

A non-inferiority gate `accuracy_delta >= -margin` passes when the lower end of the paired 95% CI
of (variant - baseline) stays above -margin. That CI's width is set by how many items flip between
the two models, unknown before the run: the statement assumes a flip rate (10% of items, about what
4-bit AWQ flipped on the default model: 66 of 708 items) and the normal approximation of the paired
difference, SE = sqrt(flip rate / n). tests/test_power.py checks it by simulation against the CI
sign-off really uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959964
Z80 = 0.841621
ASSUMED_FLIP_RATE = 0.10


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@dataclass(frozen=True)
class Power:
    n: int
    margin: float
    flip_rate: float
    se: float
    pass_needs: float  # the observed delta must be at least this to pass
    aa_false_fail: float  # chance that a variant identical in quality fails the gate
    drop_80: float  # a true drop this large fails the gate 80% of the time

    @property
    def certifiable(self) -> bool:
        """Can an unchanged model pass reliably (fail at most 5% of the time)?"""
        return self.aa_false_fail <= 0.05

    def describe(self) -> str:
        verdict = ("can be certified" if self.certifiable else
                   f"cannot be certified at this size: even an unchanged model fails it {self.aa_false_fail:.0%} of "
                   f"the time (certifiable from about {items_needed(self.margin, self.flip_rate)} items)")
        return (f"{self.n} items: a -{self.margin * 100:.1f} pt margin passes only if the observed delta >= "
                f"{self.pass_needs * 100:+.1f} pt; a true drop of {self.drop_80 * 100:.1f} pt fails it 80% of the "
                f"time; {verdict} (assuming {self.flip_rate:.0%} of items flip)")


def noninferiority(n: int, margin: float, flip_rate: float = ASSUMED_FLIP_RATE) -> Power:
    se = math.sqrt(flip_rate / n) if n else math.inf
    pass_needs = -margin + Z95 * se
    return Power(n=n, margin=margin, flip_rate=flip_rate, se=se, pass_needs=pass_needs,
                 aa_false_fail=_phi((pass_needs - 0.0) / se) if se else 0.0,
                 drop_80=max(0.0, margin - (Z95 - Z80) * se))


def items_needed(margin: float, flip_rate: float = ASSUMED_FLIP_RATE) -> int:
    """Fewest items at which an unchanged model fails the gate at most 5% of the time."""
    return math.ceil(flip_rate * ((Z95 + 1.644854) / margin) ** 2)
