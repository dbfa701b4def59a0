"""Statistics that survive review: Wilson intervals, exact McNemar, paired bootstrap, percentiles.

Pure numpy/stdlib, no engine imports, so the report and the tests can use it anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval for k successes in n trials."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b and c.

    Under H0 each discordant pair is a fair coin: p = 2 * P(Binom(b+c, 1/2) <= min(b, c)).
    """
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_bootstrap_delta(
    base: Sequence[int], variant: Sequence[int], samples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of (variant - base) over paired items, with a 95% percentile bootstrap CI.

    Items are resampled as pairs, so the CI reflects item difficulty shared by both.
    """
    a = np.asarray(base, dtype=np.float64)
    b = np.asarray(variant, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {a.shape} vs {b.shape}")
    n = a.size
    if n == 0:
        return (math.nan, math.nan, math.nan)
    d = b - a
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(samples, n))
    means = d[idx].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return (float(d.mean()), float(lo), float(hi))


def agresti_min_delta(b: int, c: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% CI of a paired difference of proportions (variant - base) from the discordant
    counts: b = correct->wrong, c = wrong->correct, n items. Agresti & Min (2005): add 1/2 to
    every cell of the 2x2 table, then Wald. Unlike the bootstrap it keeps a real width when
    there are few or no flips (no flips in 20 items is not proof of no damage)."""
    if n == 0:
        return (math.nan, math.nan)
    b2, c2, n2 = b + 0.5, c + 0.5, n + 2.0
    d = (c2 - b2) / n2
    se = math.sqrt(max(0.0, (b2 + c2) - (c2 - b2) ** 2 / n2)) / n2
    return (max(-1.0, d - z * se), min(1.0, d + z * se))


def paired_delta_ci(base: Sequence[int], variant: Sequence[int], samples: int = 2000,
                    seed: int = 0) -> tuple[float, float, float]:
    """Delta with the union of the paired-bootstrap and Agresti-Min 95% intervals: a gate
    judged on it holds under both, and neither collapses to a point on few flips."""
    d, lo, hi = paired_bootstrap_delta(base, variant, samples, seed)
    b = sum(1 for x, y in zip(base, variant, strict=True) if x and not y)
    c = sum(1 for x, y in zip(base, variant, strict=True) if y and not x)
    lo2, hi2 = agresti_min_delta(b, c, len(base))
    return (d, min(lo, lo2), max(hi, hi2))


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 95, 99)) -> dict[str, float | None]:
    """p50/p95/p99 (linear interpolation); None where there are no values."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values (family-wise error over many slices)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted
