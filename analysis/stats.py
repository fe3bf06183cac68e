"""Is a difference between two methods larger than the spread over seeds?

Welch's unequal-variance t-test (Welch, 1947; ``scipy.stats.ttest_ind(equal_var=False)``) on the final validation
losses of two settings' seeds: a difference is reported as real only when p < ``ALPHA``. With three seeds per
setting the test has few degrees of freedom (≈ 4), so it only flags differences several times the seed spread;
a "no" means "not shown with these seeds", not "equal".
"""

from __future__ import annotations

import math
import warnings
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
    def spreadless(x: list[float]) -> bool:  # spread below float rounding: the t statistic would be noise
        return max(x) - min(x) <= 1e-12 * max(abs(v) for v in x)

    if spreadless(a) and spreadless(b):
        return 0.0 if abs(sum(a) / len(a) - sum(b) / len(b)) > 1e-12 * max(map(abs, a + b)) else 1.0
    with warnings.catch_warnings():  # scipy warns on near-identical samples; the p-value it returns is still right
        warnings.simplefilter("ignore", RuntimeWarning)
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
