"""The stated power of a non-inferiority gate, checked by simulation against the CI sign-off uses
(pipeline/stats.paired_delta_ci: the union of a paired bootstrap and Agresti-Min)."""

from __future__ import annotations

import numpy as np

from pipeline.measure import power, stats


def replicate(rng, n: int, flip_rate: float, drop: float) -> tuple[list[int], list[int]]:
    """Baseline right on 60% of items; each item flips wrong (rate f/2 + drop/2) or right (f/2 - drop/2)."""
    base = (rng.random(n) < 0.6).astype(int)
    u = rng.random(n)
    down, up = flip_rate / 2 + drop / 2, flip_rate / 2 - drop / 2
    var = base.copy()
    var[(base == 1) & (u < down / 0.6)] = 0  # c->w among the right ones, so the overall rate is `down`
    var[(base == 0) & (u < up / 0.4)] = 1
    return base.tolist(), var.tolist()


def fail_rate(n: int, margin: float, flip_rate: float, drop: float, reps: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    fails = 0
    for i in range(reps):
        b, v = replicate(rng, n, flip_rate, drop)
        _, lo, _ = stats.paired_delta_ci(b, v, samples=1000, seed=i)
        fails += lo < -margin
    return fails / reps


def test_an_unchanged_model_fails_a_certifiable_gate_at_most_5_percent_of_the_time():
    p = power.noninferiority(1000, 0.05)
    assert p.certifiable and p.aa_false_fail < 0.01
    assert fail_rate(1000, 0.05, 0.10, 0.0, reps=300, seed=1) <= 0.05


def test_false_fails_and_detection_match_the_stated_figures():
    p = power.noninferiority(400, 0.05)  # borderline: an unchanged model fails ~11% of the time
    assert not p.certifiable and 0.08 < p.aa_false_fail < 0.15
    observed = fail_rate(400, 0.05, 0.10, 0.0, reps=400, seed=2)
    assert abs(observed - p.aa_false_fail) < 0.06, (observed, p.aa_false_fail)
    detected = fail_rate(400, 0.05, 0.10, p.drop_80, reps=400, seed=3)
    assert abs(detected - 0.80) < 0.07, detected


def test_the_statement_says_what_can_and_cannot_be_certified():
    small = power.noninferiority(200, 0.05).describe()
    assert "200 items: a -5.0 pt margin passes only if the observed delta >=" in small
    assert "not certifiable at this size" in small and "certifiable from about" in small
    assert "; certifiable (assuming 10% of items flip)" in power.noninferiority(2000, 0.05).describe()
    assert power.items_needed(0.05) == 520
