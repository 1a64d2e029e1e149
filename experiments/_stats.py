"""The statistics the seed-averaged figures share: a mean with its 95% t-interval, and the
smallest difference a paired t-test of that many seeds detects with 80% power."""

from __future__ import annotations

import numpy as np
from scipy import optimize, stats


def interval(values: np.ndarray) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval."""
    half = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return float(values.mean()), float(half)


def detectable_difference(sd: float, n: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest true mean difference that a two-sided paired t-test at level ``alpha`` on
    ``n`` pairs whose differences have standard deviation ``sd`` rejects with probability
    ``power``: the exact power of the noncentral t distribution, solved for the difference."""
    df, critical = n - 1, stats.t.ppf(1 - alpha / 2, n - 1)

    def missing_power(difference: float) -> float:
        shift = difference / sd * np.sqrt(n)
        # the far tail: scipy's nct.cdf returns NaN at some large shifts (df 2, 4) where it is 0
        below = np.nan_to_num(stats.nct.cdf(-critical, df, shift))
        return stats.nct.sf(critical, df, shift) + below - power

    return float(optimize.brentq(missing_power, 1e-12 * sd, 10 * sd))
