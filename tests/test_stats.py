"""Statistics against values worked by hand."""

from __future__ import annotations

import math

import pytest

from pipeline import stats
from pipeline.runstore import hash_obj


def test_wilson_known_values():
    lo, hi = stats.wilson(50, 100)
    assert lo == pytest.approx(0.40383, abs=1e-4) and hi == pytest.approx(0.59617, abs=1e-4)
    lo, hi = stats.wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.27753, abs=1e-4)
    assert all(math.isnan(x) for x in stats.wilson(0, 0))


def test_mcnemar_exact():
    # b=1, c=9: p = 2 * (C(10,0) + C(10,1)) / 2^10
    assert stats.mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    assert stats.mcnemar_exact(9, 1) == stats.mcnemar_exact(1, 9)
    assert stats.mcnemar_exact(5, 5) == 1.0
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(0, 12) == pytest.approx(2 / 4096)


def test_paired_bootstrap():
    same = [1, 0, 1, 1, 0] * 20
    assert stats.paired_bootstrap_delta(same, same) == (0.0, 0.0, 0.0)
    worse = [0] * 100
    d, lo, hi = stats.paired_bootstrap_delta([1] * 100, worse)
    assert (d, lo, hi) == (-1.0, -1.0, -1.0)
    base = [1] * 60 + [0] * 40
    var = [1] * 50 + [0] * 50  # 10 correct->wrong flips
    d, lo, hi = stats.paired_bootstrap_delta(base, var, samples=4000, seed=3)
    assert d == pytest.approx(-0.10)
    assert -0.17 < lo < -0.10 < hi < -0.04
    with pytest.raises(ValueError):
        stats.paired_bootstrap_delta([1, 0], [1])


def test_percentiles():
    p = stats.percentiles(list(range(1, 101)))
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert stats.percentiles([]) == {"p50": None, "p95": None, "p99": None}


def test_holm():
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_hash_is_order_independent_for_keys_and_sensitive_to_values():
    assert hash_obj({"a": 1, "b": [1, 2]}) == hash_obj({"b": [1, 2], "a": 1})
    assert hash_obj({"a": 1}) != hash_obj({"a": 2})
    assert hash_obj([1, 2]) != hash_obj([2, 1])


def test_agresti_min_keeps_width_without_flips():
    lo, hi = stats.agresti_min_delta(0, 0, 20)
    assert lo < -0.05 and hi > 0.05  # 20 items without a flip cannot prove a 5-point margin
    lo, hi = stats.agresti_min_delta(0, 0, 2000)
    assert -0.002 < lo < 0 < hi < 0.002
    d, lo, hi = stats.paired_delta_ci([1] * 12 + [0] * 8, [1] * 12 + [0] * 8)
    assert d == 0 and lo < -0.05  # the union is at least as wide as Agresti-Min
    # b=10 correct->wrong of n=100: centred near -0.1
    lo, hi = stats.agresti_min_delta(10, 0, 100)
    assert lo < -0.10 < hi < 0
