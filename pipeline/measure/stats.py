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


# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond: Cornish-Fisher)
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788,
         2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639,
         2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with df degrees of freedom."""
    if df < 1:
        return math.inf
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def ratio_ci(variant: Sequence[float], base: Sequence[float]) -> tuple[float, float, float]:
    """Ratio of geometric means (variant / base) of positive repeat measurements, with a 95% CI:
    a pooled-variance t interval on the log scale. Its width falls as 1/sqrt(repeats), so more
    repeats decide more (a min/max range over repeats only widens with them)."""
    v = np.log(np.asarray(variant, dtype=np.float64))
    b = np.log(np.asarray(base, dtype=np.float64))
    if v.size < 2 or b.size < 2:
        raise ValueError("a ratio CI needs at least two repeats on each side")
    d = float(v.mean() - b.mean())
    df = v.size + b.size - 2
    pooled = ((v.size - 1) * v.var(ddof=1) + (b.size - 1) * b.var(ddof=1)) / df
    half = t975(df) * math.sqrt(pooled * (1 / v.size + 1 / b.size))
    return (math.exp(d), math.exp(d - half), math.exp(d + half))


def mean_ci_log(values: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean of positive repeat measurements with a 95% t interval on the log scale."""
    x = np.log(np.asarray(values, dtype=np.float64))
    if x.size < 2:
        raise ValueError("a CI needs at least two repeats")
    m = float(x.mean())
    half = t975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return (math.exp(m), math.exp(m - half), math.exp(m + half))


def n_to_certify(n: int, value: float, bound: float, threshold: float, z_power: float = 0.841621) -> int | None:
    """Items (or repeats) at which an interval of today's shape would clear `threshold` with 80%
    chance, if the point estimate and the spread behind it hold: the half-width shrinks as
    1/sqrt(n). None when the point itself sits on or beyond the threshold (no n certifies it)."""
    half, room = abs(value - bound), abs(value - threshold)
    if n <= 0 or not (value - threshold) * (value - bound) > 0 or room == 0:
        return None
    if half <= room:
        return n
    return math.ceil(n * ((half / Z95) * (Z95 + z_power) / room) ** 2)


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
