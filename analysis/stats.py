"""Is a difference between two methods larger than the spread over seeds?

Welch's unequal-variance t-test (Welch, 1947; ``scipy.stats.ttest_ind(equal_var=False)``) on the final validation
losses of two settings' seeds: a difference is reported as real only when p < ``ALPHA``. With three seeds per
setting the test has few degrees of freedom (≈ 4), so it only flags differences several times the seed spread;
a "no" means "not shown with these seeds", not "equal".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ALPHA = 0.05


def _finite(values: Sequence[float]) -> list[float]:
    return [float(x) for x in values if x is not None and math.isfinite(float(x))]


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of Welch's t-test over the finite values; NaN with fewer than two on either side. Two
    samples with zero spread each are as different as their means say: p = 0 if they differ, 1 if equal."""
    from scipy import stats

    a, b = _finite(a), _finite(b)
    if len(a) < 2 or len(b) < 2:
        return math.nan
    if max(a) == min(a) and max(b) == min(b):
        return 0.0 if a[0] != b[0] else 1.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def verdict(a: Sequence[float], b: Sequence[float]) -> str:
    """"lower" / "higher" (mean of ``a`` vs ``b``, significant at ``ALPHA``), "no" (not significant), or "—"
    (fewer than two seeds on a side)."""
    p = welch_p(a, b)
    if math.isnan(p):
        return "—"
    if p >= ALPHA:
        return "no"
    a, b = _finite(a), _finite(b)
    return "lower" if sum(a) / len(a) < sum(b) / len(b) else "higher"
