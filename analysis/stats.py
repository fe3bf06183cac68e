"""Is a difference between two settings larger than the spread over seeds?

The runs of a campaign at one seed share their data order (and initialisation) across settings, so two settings
are compared **paired by seed**: the paired t-test (Student, 1908; ``scipy.stats.ttest_rel``) on the per-seed
differences of the final validation loss, over the seeds both settings ran. A difference is reported as real only
when p < ``ALPHA``. With three seeds the test has 2 degrees of freedom, so it flags only differences that are
consistent from seed to seed; a "no" means "not shown with these seeds", not "equal". The Wilcoxon signed-rank
test (``scipy.stats.wilcoxon``) is not used: with n = 3 pairs its smallest two-sided p is 0.25, so it can never
reject.

Every table compares paired: an unpaired test (Welch's) would count the seeds' shared data order as noise and
miss differences that hold at every seed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

ALPHA = 0.05
TEST_NAME = "paired t-test over seeds"


def _finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


def paired(a: Mapping, b: Mapping) -> list[tuple[float, float]]:
    """``[(a[seed], b[seed])]`` for the seeds where both have a finite value, in seed order."""
    return [(float(a[s]), float(b[s])) for s in sorted(set(a) & set(b), key=str) if _finite(a[s]) and _finite(b[s])]


def paired_p(a: Mapping, b: Mapping) -> float:
    """Two-sided p-value of the paired t-test of ``{seed: value}`` against ``{seed: value}`` over their common
    seeds; NaN with fewer than two pairs. Differences with no spread (below float rounding) are as different as
    their mean says: p = 0 when it is nonzero, 1 when zero."""
    from scipy import stats

    pairs = paired(a, b)
    if len(pairs) < 2:
        return math.nan
    diffs = [x - y for x, y in pairs]
    scale = max(abs(v) for pair in pairs for v in pair) or 1.0
    if max(diffs) - min(diffs) <= 1e-12 * scale:  # the t statistic would be rounding noise over rounding noise
        return 0.0 if abs(sum(diffs) / len(diffs)) > 1e-12 * scale else 1.0
    with warnings.catch_warnings():  # scipy warns on near-identical samples; the p-value it returns is still right
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_rel([x for x, _ in pairs], [y for _, y in pairs]).pvalue)


def verdict(a: Mapping, b: Mapping) -> str:
    """"lower" / "higher" (mean paired difference of ``a`` vs ``b``, significant at ``ALPHA``), "no" (not
    significant), or "—" (fewer than two common seeds)."""
    p = paired_p(a, b)
    if math.isnan(p):
        return "—"
    if p >= ALPHA:
        return "no"
    diffs = [x - y for x, y in paired(a, b)]
    return "lower" if sum(diffs) < 0 else "higher"
