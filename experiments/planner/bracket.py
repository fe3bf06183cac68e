"""Bracketing search over full-size traces: the largest micro-batch (or sequence length) whose traced step fits.

Regula falsi (false position) on a monotone excess function, kept strictly inside the bracket of the largest value
verified to fit and the smallest verified over, so every full-size trace narrows it; used by the capacity procedure
(``experiments.planner.capacity``) for baselines' micro-batches and for shortened sequences.
"""

from __future__ import annotations

import math

MAX_VERIFY = 5  # full-size traces (or planner calls) per search
SEQ_STEP = 64  # a shortened sequence is a multiple of this many tokens


def bracket(over, start: int, step_down, max_traces: int = MAX_VERIFY,
            hi: int | None = None) -> tuple[int, int | None, int]:
    """The largest x ≥ 1 with ``over(x) ≤ 0`` for a monotone ``over`` (a full trace's excess over the budget, GiB),
    from the predicted ``start``: the next x is the root of the secant through the last two traces (regula falsi;
    after the first, the model's ``step_down(x, excess)`` below a miss, x + 1 above a fit), kept strictly between the
    largest x known to fit and the smallest known over (``hi``: one known before the search). Returns (largest x
    verified to fit or 0, smallest x verified over or None, traces used): exact when the second is the first + 1."""
    lo, points, x = 0, [], start if hi is None else min(start, hi - 1)
    while len(points) < max_traces and x >= 1 and (hi is None or hi - lo > 1):
        excess = over(x)
        points.append((x, excess))
        if excess > 0:
            hi = x if hi is None else min(hi, x)
        else:
            lo = max(lo, x)
        (x0, e0), (x1, e1) = points[-2:] if len(points) > 1 else (points[-1], points[-1])
        if len(points) > 1 and e1 != e0:
            guess = math.floor(x1 - e1 * (x1 - x0) / (e1 - e0))
        else:
            guess = step_down(x, excess) if excess > 0 else x + 1
        x = max(guess, lo + 1)
        if hi is not None:
            x = min(x, hi - 1)
    return lo, hi, len(points)
