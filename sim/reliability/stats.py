"""Confidence intervals over seeds: the mean +- t(0.975, n-1) x sd / sqrt(n), Student's t
(the seeds' results are independent draws of the same run). The t quantiles for 1 to 30
degrees of freedom are the standard table's; past 30 the Cornish-Fisher expansion of t in the
normal quantile (Abramowitz and Stegun 26.7.5), within 1e-4 of the table there."""

from __future__ import annotations

import math
from collections.abc import Sequence

# t(0.975, df) for df = 1..30.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959963984540054


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3


def mean_ci(values: Sequence[float]) -> tuple[float | None, float | None]:
    """(low, high) of the 95% confidence interval of the mean; (None, None) for one value."""
    n = len(values)
    if n < 2:
        return None, None
    m = math.fsum(values) / n
    var = math.fsum((v - m) ** 2 for v in values) / (n - 1)
    half = t975(n - 1) * math.sqrt(var / n)
    return m - half, m + half
