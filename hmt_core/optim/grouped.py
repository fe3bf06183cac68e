"""HMT's deferred updates (``finish_step``: Mode A's clipped low-rank updates and the dense parameters') with Adam
run over several slots at once in ``torch._foreach_*`` ops (``hmt_core.adam.adam_step_many``): on CUDA one
multi-tensor kernel per op instead of one launch per op and slot, with the same arithmetic tensor by tensor as
``LowRankOptimizer.update_low_rank`` / ``update_full`` (so the same bits). The weight writes stay one slot at a
time (their shapes differ: GEMMs, row chunks, INT8 codes).

A group's directions (and the foreach temporaries beside them) are alive together: slots are grouped so that the
group's fp32 directions hold at most a quarter of one row chunk (``hmt_core.precision.chunk_budget``), so the
group's temporaries (gradient copies, numerators, denominators, directions) stay within the one row chunk that an
update's write already holds. Slots the foreach path does not cover (the fused Triton Adam, young rank indices with
their own bias-correction clock, bitsandbytes' dense 8-bit AdamW, a dense INT8 weight's own 8-bit moments,
row-chunked large dense weights) take the ordinary one-slot path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hmt_core.adam import adam_step_many
from hmt_core.kernels import ops as kops
from hmt_core.optim import update as upd
from hmt_core.optim.optimizer import LowRankOptimizer, Slot
from hmt_core.precision import chunk_budget


def update_low_rank_many(opt: LowRankOptimizer, slots: list[Slot], lows: list[Tensor],  # each low: Ĝ
                         coef: Tensor | None) -> None:
    """``opt.update_low_rank(s, low, coef)`` for each slot, in order."""
    if not slots:
        return
    lows = [low.float() for low in lows]
    if coef is not None:
        lows = torch._foreach_mul(lows, coef)
    for s, (d, step_size) in zip(slots, _adam_many(opt, slots, lows)):
        opt.write_low_rank(s, d, step_size)


def update_dense_many(opt: LowRankOptimizer, slots: list[Slot], grads: list[Tensor],  # each grad: the param's
                      coef: Tensor | None) -> None:
    """``opt.update_full(s, grad, coef)`` for each dense slot, in order."""
    whole = [s.updater.foreach_adam(g) for s, g in zip(slots, grads)]
    batch = [(s, g) for s, g, w in zip(slots, grads, whole) if w]
    if batch:
        gs = [g for _, g in batch]
        if coef is not None:
            gs = torch._foreach_mul(gs, coef)
        dense = [s for s, _ in batch]
        for s, (d, step_size) in zip(dense, _adam_many(opt, dense, [g.float() for g in gs])):
            opt._apply(s, d, step_size)
    for s, g, w in zip(slots, grads, whole):
        if not w:
            opt.update_full(s, g, coef)


def _adam_many(opt: LowRankOptimizer, slots: list[Slot], gs: list[Tensor]) -> list[tuple[Tensor, float]]:
    """``opt._adam(s, g)`` for each slot (same results), the eligible ones in groups of one clock."""
    c, out = opt.rule, [None] * len(slots)
    groups: dict[tuple, list[int]] = {}
    for i, (s, g) in enumerate(zip(slots, gs)):
        opt._begin_adam_step(s, g, count=False)
        s.clock.born = upd.retire_born(s.clock.born, s.clock.adam_t, c.beta1, c.beta2)
        if s.clock.born is None and not kops.adam_fuses(s.m, s.v, g, backend=opt.kernels):
            groups.setdefault((s.clock.adam_t, s.lr_scale, g.device), []).append(i)
    opt.skip.count_many([s.clock for s in slots])
    grouped = {i for idx in groups.values() for i in idx}
    for i in (i for i in range(len(slots)) if i not in grouped):
        out[i] = opt._adam_moments(slots[i], gs[i])
    factors = opt.skip.moment_factors(c.beta1, c.beta2)
    for (t, lr_scale, _), idx in groups.items():
        for part in _parts(idx, gs):
            g = [gs[i] if factors is None else opt.skip.zero(gs[i]) for i in part]
            ds, step_size = adam_step_many([slots[i].m for i in part], [slots[i].v for i in part], g, t,
                                           lr=opt.lr * lr_scale,
                                           beta1=c.beta1, beta2=c.beta2, eps=c.eps, style=c.adam_style,
                                           factors=factors)
            for i, d in zip(part, ds):
                out[i] = (d, step_size)
    return out


def _parts(idx: list[int], gs: list[Tensor]) -> list[list[int]]:
    """``idx`` in runs whose fp32 directions hold ≤ a quarter of one row chunk (a single larger one alone)."""
    parts, run, size = [], [], 0
    for i in idx:
        nbytes = gs[i].numel() * 4
        if run and size + nbytes > chunk_budget(gs[i]) // 4:
            parts.append(run)
            run, size = [], 0
        run.append(i)
        size += nbytes
    return parts + [run] if run else parts
