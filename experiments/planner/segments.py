"""The micro-batches the planner traces: lines of the reference's bytes in the micro-batch b (``batch_segments``).

A phase's peak is a maximum over the step's events, each affine in b, so it is convex in b; ``batch_segments``
lists the doublings b = 1, 2, 4, … whose secants bound it (``experiments.planner.costs`` traces them,
``experiments.planner.capacity`` starts its search from them).
"""

from __future__ import annotations

import itertools

from experiments.config import RunConfig

MAIN_TOKENS = 8192  # the activation deltas' lines are measured around this many tokens per micro-batch
MAX_TOKENS = 32768  # the reference's lines reach this many tokens per micro-batch (or max_batch_size sequences)


def batch_segments(run: RunConfig, max_batch: int = 1024) -> list[list[int]]:
    """Lines [start, b_a, b_b] of the reference's bytes in the micro-batch b, each through its measurements at b_a
    and b_b (``start``: the first micro-batch of the line's piece of the fused loss). The planner reads them
    piecewise (``experiments.planner.costs.derive``): each line holds from its b_a up to the next line's. The main
    line (activation deltas, optimizer samples) is the last one listed.

    A phase's peak is the maximum over the step's events (the loss's logits, a basis refresh's workspace, all saved
    activations at the start of backward, …), each affine in b, so it is convex in b: the secants between
    successive doublings b = 1, 2, 4, … (up to ``MAX_TOKENS`` tokens) are each above it on their own interval and
    below it elsewhere, so each secant on its own interval is an upper bound that is exact at every measured b (the
    maximum of all secants is the same bound). The reference at a card's depth is a line through 1- and 2-layer
    traces, which need not be convex in b (Llama-3.2-3B's backward: 10.9 GiB per sequence from b = 1 to 2, 7.1 from
    4): there the maximum of all secants would carry the steep small-b secant to every b, so each holds on its own
    interval only. The fused loss (``train.fused_ce``) holds ``min(b·seq_len, ce_chunk_tokens)`` tokens of logits,
    a kink the other way: past b = k = ⌊chunk / seq_len⌋ + 1 its per-sequence bytes drop, so the pieces before and
    from k are separate."""
    t = run.train
    chunk = getattr(t, "ce_chunk_tokens", None) if getattr(t, "fused_ce", False) else None
    k = chunk // t.seq_len + 1 if chunk else 1
    top = max(2, min(max_batch, -(-MAX_TOKENS // t.seq_len)))
    pieces = [(1, k - 1), (k, None)] if k > 1 else [(1, None)]
    lines, main = [], None
    for lo, hi in pieces:
        points = [lo]
        while points[-1] < min(hi or top, top) or (hi is None and len(points) < 2):
            nxt = points[-1] * 2
            if hi is not None and nxt > hi:
                break
            points.append(nxt)
        if len(points) == 1:
            lines.append([lo, lo, lo])
        pairs = list(itertools.pairwise(points))
        lines += [[lo, b_a, b_b] for b_a, b_b in pairs]
        if hi is None:
            main = min(pairs, key=lambda pair: abs(pair[0] * t.seq_len - MAIN_TOKENS))
    return [line for line in lines if line != [max(1, k), *main]] + [[max(1, k), *main]]
