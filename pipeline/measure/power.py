"""What a quality gate can certify at the recipe's item counts: stated before a run, not after.

A non-inferiority gate `accuracy_delta >= -margin` passes when the lower end of the paired 95% CI
of (variant - baseline) stays above -margin (else it is INCONCLUSIVE, or FAIL when the point itself
is below -margin). That CI's width is set by how many items flip between the two models, unknown
before the run: `validate`'s statement assumes a flip rate (10% of items, named as an assumption)
and the normal approximation of the paired difference, SE = sqrt(flip rate / n); sign-off restates
it from the flip rate it observed. tests/test_power.py checks it by simulation against the CI
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
    aa_false_fail: float  # chance that a variant identical in quality does not pass the gate
    drop_80: float  # a true drop this large is kept from passing 80% of the time

    @property
    def certifiable(self) -> bool:
        """Can an unchanged model pass reliably (fail at most 5% of the time)?"""
        return self.aa_false_fail <= 0.05

    def describe(self) -> str:
        verdict = ("certifiable" if self.certifiable else
                   f"not certifiable at this size: even an unchanged model does not pass it "
                   f"{self.aa_false_fail:.0%} of the time (certifiable from about "
                   f"{items_needed(self.margin, self.flip_rate)} items)")
        return (f"{self.n} items: a -{self.margin * 100:.1f} pt margin passes only if the observed delta >= "
                f"{self.pass_needs * 100:+.1f} pt; a true drop of {self.drop_80 * 100:.1f} pt is kept from passing "
                f"80% of the time; {verdict} (assuming {self.flip_rate:.0%} of items flip)")


def noninferiority(n: int, margin: float, flip_rate: float = ASSUMED_FLIP_RATE) -> Power:
    se = math.sqrt(flip_rate / n) if n else math.inf
    pass_needs = -margin + Z95 * se
    return Power(n=n, margin=margin, flip_rate=flip_rate, se=se, pass_needs=pass_needs,
                 aa_false_fail=_phi((pass_needs - 0.0) / se) if se else 0.0,
                 drop_80=max(0.0, margin - (Z95 - Z80) * se))


def certifiable_margin(n: int, flip_rate: float) -> float:
    """Smallest margin an unchanged model passes at least 95% of the time at n items."""
    return (Z95 + 1.644854) * math.sqrt(flip_rate / n) if n else math.inf


def observed(n: int, discordant: int) -> str:
    """What this many paired items certify, at the flip rate sign-off observed (not an assumption)."""
    if not n:
        return ""
    f = max(discordant, 1) / n
    return (f"observed flip rate {discordant / n:.1%} ({discordant} of {n} items): at this n an unchanged model "
            f"passes margins from {certifiable_margin(n, f) * 100:.1f} pt 95% of the time")


def items_needed(margin: float, flip_rate: float = ASSUMED_FLIP_RATE) -> int:
    """Fewest items at which an unchanged model fails the gate at most 5% of the time."""
    return math.ceil(flip_rate * ((Z95 + 1.644854) / margin) ** 2)
