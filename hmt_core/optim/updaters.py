"""How ``LowRankOptimizer`` updates each parameter: one updater per slot, picked once when the optimizer is built
(``updater_for``), whose ``update`` is the whole per-step dispatch:

- ``DenseAdam``: AdamW (Loshchilov & Hutter, 2019, Alg. 2) on the gradient of a dense parameter (embeddings, norms,
  an unprojected lm_head), a large one a row chunk at a time with the same arithmetic;
- ``Dense8bitAdam``: bitsandbytes' ``AdamW8bit`` (block-wise 8-bit moments; Dettmers et al., 2022);
- ``DenseInt8Adam``: AdamW with HMT's own 8-bit block-wise moments (``hmt_core.optim.moments8``) for a dense INT8
  weight (``method.embedding_dtype=int8``), a row chunk at a time;
- ``LowRankAdam`` (``method.mode=A``): AdamW on the projected gradient Ĝ = Pᵀ G, written back as P D (GaLore; Zhao
  et al., 2024, Alg. 2);
- ``ApolloScaling`` (``method.mode=B``): the low-rank moments only give a channel or tensor scaling of the full
  gradient, through Fira's norm-growth limiter (APOLLO; Zhu et al., 2024, Alg. 1; Chen et al., 2024, Eq. 9).

An updater does its update's bookkeeping (which gradient, where the clipping coefficient goes, which moments, which
writes); the math is the pure functions of ``hmt_core.optim.update`` and ``hmt_core.adam``, and the steps all updaters
share (Adam's moments step, the weight writes, device-side skipping) are the optimizer's. Updaters hold no state:
the optimizer (``opt``, a ``LowRankOptimizer``, which imports this module) and the slot are arguments."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hmt_core.kernels import ops as kops
from hmt_core.optim import update as upd
from hmt_core.optim.moments8 import Moments8
from hmt_core.optim.rows import row_spans
from hmt_core.optim.settings import Mode, UpdateRule
from hmt_core.optim.slot import Slot
from hmt_core.precision import chunk_rows_for, is_quantized


class Updater:
    """One way of updating a slot from its gradient (see the module docstring)."""

    # the engines hand this update Ĝ = Pᵀ G (accumulated over micro-batches and reduced across ranks as Ĝ, clipped
    # after projection) through ``LowRankOptimizer.update_low_rank``; False: the full gradient G, to ``update``
    takes_low_rank_gradient = False
    # a () limiter memory per slot (with ``method.norm_limiter``): counted by the rank budget
    keeps_limiter_norm = False

    def update(self, opt: Any, s: Slot, grad: Tensor, coef: Tensor | None = None, *,  # grad: G, (out, in) | (n,)
               reduce: Callable[[Tensor], Tensor] | None = None, grad_norm: Tensor | None = None) -> None:
        """One step of ``s`` from its full gradient ``grad``, clipped by ``coef`` (() fp32; None: unclipped).
        ``reduce`` (row shards, ``hmt_core.optim.sharded``: a sum over ranks, in place) and ``grad_norm`` (() ‖G‖,
        known to the caller) serve the updates that read global norms."""
        raise NotImplementedError

    def foreach_adam(self, grad: Tensor) -> bool:
        """Whether ``hmt_core.optim.grouped.update_dense_many`` may run this slot's Adam in foreach ops with other
        slots' (one-tensor dense AdamW), instead of calling ``update``."""
        return False


def _dense_rows(opt: Any, grad: Tensor) -> int:  # grad: (out, in) | (n,): rows per chunk of a dense update
    return opt.chunk_rows(grad) if grad.dim() == 2 else grad.shape[0]


class DenseAdam(Updater):
    """AdamW on the whole gradient; a large weight (embedding, lm_head) a row chunk at a time
    (``LowRankOptimizer._dense_adam_rows``: element-wise the same, bit for bit)."""

    def update(self, opt: Any, s: Slot, grad: Tensor, coef: Tensor | None = None, *,
               reduce: Callable[[Tensor], Tensor] | None = None, grad_norm: Tensor | None = None) -> None:
        if coef is not None:
            grad = grad * coef
        rows = _dense_rows(opt, grad)
        if rows < grad.shape[0]:
            opt._dense_adam_rows(s, grad, rows)
            return
        direction, step_size = opt._adam(s, grad.float())
        opt._apply(s, direction, step_size)

    def foreach_adam(self, grad: Tensor) -> bool:  # not row-chunked
        return grad.dim() != 2 or chunk_rows_for(tuple(grad.shape), torch.float32, like=grad) >= grad.shape[0]


class DenseInt8Adam(DenseAdam):
    """AdamW whose moments are stored in 8 bits (``Moments8``, created at the first update, as bitsandbytes creates
    its state), read as fp32 a row chunk at a time, stepped and stored back: a dense INT8 weight's ``dense_8bit``."""

    def update(self, opt: Any, s: Slot, grad: Tensor, coef: Tensor | None = None, *,
               reduce: Callable[[Tensor], Tensor] | None = None, grad_norm: Tensor | None = None) -> None:
        if coef is not None:
            grad = grad * coef
        if s.name not in opt.moments8:
            opt.moments8[s.name] = Moments8(tuple(grad.shape), grad.device)
        opt._dense_adam_rows(s, grad, _dense_rows(opt, grad), opt.moments8[s.name])

    def foreach_adam(self, grad: Tensor) -> bool:
        """Never: the grouped one-tensor AdamW steps 16-bit moments on the slot, not this weight's 8-bit ones, so a
        deferred (clipped) update calls ``update`` like every other path, whatever the weight's size."""
        return False


class Dense8bitAdam(Updater):
    """bitsandbytes' ``AdamW8bit`` (``LowRankOptimizer.dense8``, one per slot); it cannot skip a step on the device:
    a step under a skip decision reads the flag on the host."""

    def update(self, opt: Any, s: Slot, grad: Tensor, coef: Tensor | None = None, *,
               reduce: Callable[[Tensor], Tensor] | None = None, grad_norm: Tensor | None = None) -> None:
        if coef is not None:
            grad = grad * coef
        if opt.skip.on_host():
            return
        adam8 = opt.dense8[s.name]
        for group in adam8.param_groups:
            group["lr"] = opt.lr_of(s)  # the optimizer's rate (``set_lr``) × the slot's scale, read at every update
        s.param.grad = grad
        adam8.step()


class LowRankAdam(Updater):
    """Mode A: Adam's moments of Ĝ = Pᵀ G (or G Q, P Gᵀ Q), W ← W − step·α·P D Qᵀ
    (``LowRankOptimizer.update_low_rank``, ``write_low_rank``)."""

    takes_low_rank_gradient = True

    def update(self, opt: Any, s: Slot, grad: Tensor, coef: Tensor | None = None, *,
               reduce: Callable[[Tensor], Tensor] | None = None, grad_norm: Tensor | None = None) -> None:
        """Ĝ projected here from ``grad``, then clipped: clip(Pᵀ G) = Pᵀ clip(G)."""
        opt.update_low_rank(s, kops.project(grad, s.local_basis(), backend=opt.kernels), coef)


class ApolloScaling(Updater):
    """Mode B: the moments step on R = Pᵀ G gives APOLLO's scaling s = ‖N‖/‖R‖ (per channel or per tensor), and
    W ← W − step·√α·limit(G ⊙ s) row span by row span, the limiter folded into the coefficient
    (``update.apollo_coefficient``). The clipping coefficient scales R and the coefficient, never G."""

    keeps_limiter_norm = True

    def update(self, opt: Any, s: Slot, grad: Tensor, coef: Tensor | None = None, *,
               reduce: Callable[[Tensor], Tensor] | None = None, grad_norm: Tensor | None = None) -> None:
        """``reduce``: a left-sided R = Σ_k P_kᵀ G_k and the tensor-scaling and limiter norms are summed over ranks;
        the update touches this rank's rows."""
        low = kops.project(grad, s.local_basis(), backend=opt.kernels)
        coef, step_size, keep = self.coefficient(opt, s, low, grad, reduce=reduce, clip=coef, grad_norm=grad_norm)
        rows = opt.chunk_rows(grad)  # bounds addcmul_'s casting temporaries
        spans = (row_spans(grad.shape[0], rows) if rows < grad.shape[0]
                 else opt.writer.spans(s.param, s.master, like=grad))
        for index in spans:
            self.write_rows(opt, s, index, grad[index], coef, step_size, keep)

    def coefficient(self, opt: Any, s: Slot, low: Tensor, grad: Tensor | None, *,  # low: Pᵀ G; grad: (out, in)
                    reduce: Callable | None = None, row_norms: Tensor | None = None, clip: Tensor | None = None,
                    grad_norm: Tensor | None = None) -> tuple[Tensor, float, Tensor | None]:
        """The moments step on ``clip·low``, APOLLO's coefficient of ``grad`` (``upd.apollo_coefficient``; its
        ``row_norms``, ``grad_norm``) → (coef: clip in, 0 if skipped; step size·√scale; the writer's keep flag)."""
        c = opt.rule
        if reduce is not None and s.basis.left is not None:
            low = reduce(low.float())  # Pᵀ G = Σ_k P_kᵀ G_k, replicated
        low = upd.fp32_clipped(low, clip)
        direction, step_size = opt._adam(s, low, for_scaling=True)
        factor = upd.apollo_scaling(direction, low, right_sided=s.basis.right is not None and s.basis.left is None,
                                    kind=c.scaling, reduce=reduce)
        coef, s.limiter_prev = upd.apollo_coefficient(  # a skipped step: coef 0 (rows kept), the memory kept
            grad, factor if clip is None else factor * clip, prev_norm=s.limiter_prev, reduce=reduce,
            row_norms=row_norms, grad_norm=grad_norm, gamma=c.limiter_gamma if c.norm_limiter else None,
            found_inf=opt.skip.flag)
        return coef, step_size * math.sqrt(c.scale), opt._keep(s)

    def write_rows(self, opt: Any, s: Slot, index: Any, g: Tensor, coef: Tensor,  # g: G[index], (rows, in)
                   step_size: float, keep: Tensor | None) -> None:
        """W[index] ← W[index] − step·(g ⊙ coef[index]) (``coefficient``'s coef, step size and keep)."""
        # 0 · NaN is NaN: where the writer does not keep the rows, a skipped step's gradient rows are zeroed too
        g = g if keep is not None else opt.skip.zero(g)
        if opt.writer.fused(s.param.data, g):  # an INT8 weight: one kernel writes the rows
            opt._write_fused(s, index, g * upd.rows_of(coef, index), step_size)
            return
        with opt.writer.rows(s.param.data, s.master, index, keep) as w:
            upd.apply_scaled_update_(w, g, upd.rows_of(coef, index), step_size=step_size, lr=opt.lr_of(s),
                                     weight_decay=opt.rule.weight_decay, style=opt.rule.adam_style)


PROJECTED: dict[Mode, Updater] = {Mode.LOW_RANK_ADAM: LowRankAdam(), Mode.APOLLO_SCALING: ApolloScaling()}


def updater_for(s: Slot, rule: UpdateRule) -> Updater:
    """The slot's updater: its mode's for a projected weight; a dense one's AdamW, with 8-bit moments under
    ``dense_8bit`` (bitsandbytes', or HMT's own for an INT8 weight, which bitsandbytes cannot step)."""
    if s.projected:
        return PROJECTED[rule.mode]
    if not rule.dense_8bit:
        return DenseAdam()
    return DenseInt8Adam() if is_quantized(s.param) else Dense8bitAdam()
