"""The statistics of the seed-averaged figures (experiments/_stats.py), against scipy's own
interval and against simulated paired t-tests."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from helpers import REPO
from scipy import stats

sys.path.insert(0, str(REPO / "experiments"))
from _stats import detectable_difference, interval


def test_interval_is_scipys_95_percent_t_interval():
    values = np.array([0.71, 0.79, 0.75, 0.72, 0.75])
    mean, half = interval(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=values.mean(), scale=stats.sem(values))
    assert mean == pytest.approx(0.744, abs=1e-12)
    assert (mean - half, mean + half) == pytest.approx((low, high), abs=1e-12)


@pytest.mark.parametrize("n", [3, 5, 20, 30])
def test_the_detectable_difference_is_rejected_with_80_percent_power(n):
    # 40,000 simulated paired experiments with the true difference at the detectable one: the
    # two-sided t-test at 5% rejects 80% of them (binomial sd 0.002; 0.01 is five of them)
    sd = 0.025
    difference = detectable_difference(sd, n)
    samples = np.random.default_rng(n).normal(difference, sd, size=(40_000, n))
    rejected = stats.ttest_1samp(samples, 0.0, axis=1).pvalue < 0.05
    assert rejected.mean() == pytest.approx(0.80, abs=0.01)
    # above the normal approximation (z₀.₉₇₅ + z₀.₈)·sd/√n, which ignores the estimated sd
    assert difference > (stats.norm.ppf(0.975) + stats.norm.ppf(0.8)) * sd / np.sqrt(n)
