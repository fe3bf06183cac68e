"""Per-layer updates inside backward (GaLore's per-layer weight updates, Zhao et al. 2024, §4.3; torchtune's
optimizer-in-backward): each trainable parameter's ``register_post_accumulate_grad_hook`` runs its update, with
gradient accumulation (Mode A: Σ_i Pᵀ G_i, full gradients freed at once), ``torch.nn.utils.clip_grad_norm_``'s
global-norm rule (Mode A and dense: deferred to ``finish_step``; Mode B: the previous step's coefficient), non-finite
steps skipped on the device, and the multi-process gradient reduction (``reduce_grad``).
Design notes: docs/design/per_layer_hooks.md."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from hmt_core.kernels import ops as kops
from hmt_core.basis_cache import BasisCache
from hmt_core.optim import grouped
from hmt_core.optim.optimizer import LowRankOptimizer, Slot, clip_coefficient, global_norm
from hmt_core.parallel import GradReducer


class PerLayerEngine:
    def __init__(self, opt: LowRankOptimizer, *, max_grad_norm: float | None,
                 cache: BasisCache | None = None) -> None:
        self.opt = opt
        self.cache = cache  # bases parked in host memory between uses (hmt_core.basis_cache)
        self.order: list[Slot] = []  # projected slots in backward (hook) order, recorded in the first step
        self.next_in_order: dict[str, Slot] = {}
        self.max_grad_norm = max_grad_norm
        self.index, self.count = 0, 1
        self.norms: dict[int, Tensor] = {}  # slot index -> ‖G‖ (stacked in slot order, like clip_grad_norm_)
        self.deferred_low: list[Slot] = []
        self.deferred_dense: list[Slot] = []
        self.deferred_rows: list[Callable[[Tensor | None], None]] = []  # row-sparse embedding updates (clipping)
        self.lagged_coef: Tensor | None = None
        self.nonfinite = False  # a refresh met a non-finite gradient (known on the host): the step is dropped
        self.found_inf: Tensor | None = None  # () bool on the device: a non-finite gradient was seen in this step
        self.poison: Tensor | None = None  # () float on the device: NaN once a non-finite norm was seen (``_flag``)
        self.reduce_grad: GradReducer | None = None  # in place, across ranks (multi-process)
        self._flush_queued = False  # the reducer's flush is queued for the end of the running backward
        self.handles = [s.grad_holder.register_post_accumulate_grad_hook(
            self._hook_for(s)) for s in opt.slots]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def start_micro_batch(self, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise ValueError(f"micro-batch index {index} not in [0, {count})")
        self.index, self.count = index, count
        self.opt.skip.count_later()  # the step's skip counts in one op, in ``finish_step``

    @property
    def clipping(self) -> bool:
        return bool(self.max_grad_norm)

    def _hook_for(self, s: Slot):
        def hook(param: Tensor) -> None:
            self._on_grad(s, param)

        return hook

    def _on_grad(self, s: Slot, param: Tensor) -> None:
        if self.cache is None or not s.projected or param.grad is None:
            return self._on_grad_body(s, param)
        if not self.next_in_order and s not in self.order:
            self.order.append(s)  # first step: learn the backward order
        self._fetch(s, self.next_in_order.get(s.name))
        try:
            self._on_grad_body(s, param)
            self._flush()  # the continuation needs the basis fetched now: no bucketing with parked bases
        finally:
            s.basis = self.cache.park(s.name, s.basis)

    def _fetch(self, s: Slot, prefetch: Slot | None) -> None:
        s.basis = self.cache.fetch(s.name, s.basis)
        if prefetch is not None:
            self.cache.prefetch(prefetch.name)

    @torch.no_grad()
    def _on_grad_body(self, s: Slot, param: Tensor) -> None:
        opt, last = self.opt, self.index == self.count - 1
        g = param.grad
        if g is None:  # another hook already consumed it
            return
        if self.nonfinite:
            param.grad = None
            return
        if s.updater.takes_low_rank_gradient:  # Mode A: Ĝ accumulated, reduced, clipped
            refresh = (self.index == 0 or s.basis is None) and opt.refresh_due(s)
            param.grad = None  # the full gradient dies here (or once its reduction has been used)
            if refresh or not self.lowrank_comm:
                return self._reduce(g, s, lambda: self._mode_a(s, g, None, refresh=refresh, last=last))
            low = kops.project(g, s.basis, backend=opt.kernels).float()  # Pᵀ G_local, reduced: r × n, not m × n
            self._queue_flush()
            return self.reduce_grad.projected(low, lambda: self._mode_a(s, None, low, refresh=False, last=last))
        if not last:
            return  # p.grad keeps accumulating
        self._reduce(g, s, lambda: self._full_grad(s, param, g))

    @torch.no_grad()
    def _mode_a(self, s: Slot, g: Tensor | None, low: Tensor | None, *, refresh: bool, last: bool) -> None:
        # g: the averaged gradient (out, in); None (not kept) when ``low``, the averaged Ĝ of the local one, is given
        """A Mode A weight's gradient, once averaged: a due refresh, then Ĝ accumulated, and the update (applied
        here, or deferred to ``finish_step`` by clipping)."""
        if self.nonfinite:  # seen since the hook handed the gradient over
            return
        opt = self.opt
        if refresh:
            if not self._finite(g):
                return
            opt.refresh(s, g)
        if low is None:
            low = kops.project(g, s.basis, backend=opt.kernels).float()
        s.pending = low if s.pending is None else s.pending.add_(low)
        if self.count == 1:
            self.norms[s.index] = torch.linalg.vector_norm(low if self.lowrank_comm else g)
        if not last:
            return
        if self.count > 1:
            self.norms[s.index] = torch.linalg.vector_norm(s.pending)
        if self.clipping:
            self.deferred_low.append(s)
        else:
            with opt.skipping(self._flag(self.norms[s.index])):
                opt.update_low_rank(s, s.pending)
            s.pending = None

    @torch.no_grad()
    def _full_grad(self, s: Slot, param: Tensor, g: Tensor) -> None:  # g: param.grad, averaged
        """A Mode B weight's or a dense parameter's accumulated gradient, once averaged (last micro-batch)."""
        opt = self.opt
        if self.nonfinite:
            param.grad = None
            return
        # Mode B: ‖G‖ also makes the limiter's ‖s ⊙ G‖ = s‖G‖ (``update.apollo_coefficient``), accumulated in fp32
        acc = torch.float32 if s.projected and g.dtype.itemsize < 4 else None
        self.norms[s.index] = torch.linalg.vector_norm(g, dtype=acc)
        if s.projected:  # Mode B
            if opt.refresh_due(s):
                if not self._finite(self.norms[s.index]):  # () on the host: a refresh step synchronizes anyway
                    param.grad = None
                    return
                opt.refresh(s, g)
            with opt.skipping(self._flag(self.norms[s.index])):
                opt.update_full(s, g, self.lagged_coef, grad_norm=self.norms[s.index])
            param.grad = None
        elif self.clipping:
            self.deferred_dense.append(s)
        else:
            with opt.skipping(self._flag(self.norms[s.index])):
                opt.update_full(s, g)
            param.grad = None

    @property
    def lowrank_comm(self) -> bool:
        return self.reduce_grad is not None and bool(getattr(self.reduce_grad, "lowrank", False))

    def _reduce(self, g: Tensor, s: Slot, done: Callable[[], None]) -> None:
        """``done`` once ``g`` is averaged across ranks (at once single-process). The reducer's ``flush`` is queued
        to run when this backward pass ends (like DDP's ``Reducer`` finalizing), so every deferred continuation has
        run before the next micro-batch's hooks or ``finish_step``."""
        if self.reduce_grad is None:
            return done()
        self._queue_flush()
        self.reduce_grad.full(g, s.name, done)

    def _queue_flush(self) -> None:
        if not self._flush_queued and torch._C._current_graph_task_id() != -1:  # inside an autograd backward
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            self._flush_queued = True

    def _flush(self) -> None:
        self._flush_queued = False
        if self.reduce_grad is not None:
            self.reduce_grad.flush()

    def _finite(self, t: Tensor) -> bool:
        """False (and remembered for the step) if ``t`` has a non-finite value; fake tensors (dry run) pass. A host
        synchronization: only for a gradient a basis refresh is about to use (refresh steps synchronize anyway)."""
        if not is_fake(t) and not bool(torch.isfinite(t).all()):
            self.nonfinite = True
        return not self.nonfinite

    def _flag(self, norm: Tensor) -> Tensor:
        """The step's ``found_inf`` after seeing ``norm`` (() of a gradient, non-finite iff the gradient has a
        non-finite value or its norm overflows): a new () bool device tensor, no host synchronization. Updates
        issued earlier keep the flag they were issued under. Two ops per norm: the step's ``poison``, a () float,
        becomes ``poison + 0·norm``, which is NaN from the first non-finite norm on (0·∞ and 0·NaN are NaN; ``add``
        with ``alpha=0``), and the flag is ``poison ≠ poison`` (``isfinite`` alone is four: abs, ne, eq, mul)."""
        self.poison = norm * 0.0 if self.poison is None else torch.add(self.poison, norm, alpha=0.0)
        self.found_inf = torch.ne(self.poison, self.poison)
        return self.found_inf

    def _no_norm(self, value: float) -> Tensor | None:  # () on the weights' device: a step with nothing to measure
        return torch.full((), value, device=self.opt.slots[0].param.device) if self.opt.slots else None

    def discard_step(self) -> None:
        """Forget this step's gradients and deferred updates (a skipped step)."""
        for s in self.deferred_low:
            s.pending = None
        for s in self.deferred_dense:
            s.param.grad = s.pending = None
        self.norms, self.deferred_low, self.deferred_dense, self.deferred_rows = {}, [], [], []
        self.index, self.count, self.nonfinite, self.found_inf, self.poison = 0, 1, False, None, None
        self.opt.skip.flush_counts()

    def _global_norm(self) -> Tensor:  # () fp32: ‖g‖ over every parameter (a sharded engine also over ranks)
        return global_norm([self.norms[i] for i in sorted(self.norms)])

    @torch.no_grad()
    def finish_step(self) -> Tensor | None:
        """After the last micro-batch's backward: the global norm, then any deferred (clipped) updates, skipped on
        the device if a gradient was not finite. Returns the norm (() fp32 on the device), NaN for a skipped step."""
        try:
            return self._finish()
        finally:
            self.opt.skip.flush_counts()

    def _finish(self) -> Tensor | None:
        self._flush()  # normally done at the end of backward already
        if self.nonfinite:
            self.discard_step()
            return self._no_norm(float("nan"))
        if not self.norms:
            return self._no_norm(0.0)
        total = self._global_norm()
        found = self._flag(total)
        if self.cache is not None and self.deferred_low:
            self.cache.prefetch(self.deferred_low[0].name)
        coef = clip_coefficient(total, self.max_grad_norm)
        with self.opt.skipping(found):
            self._apply_deferred(coef)
        if coef is not None:  # a skipped step keeps the previous coefficient (None: 1, unclipped)
            self.lagged_coef = (coef.masked_fill(found, 1.0) if self.lagged_coef is None
                                else torch.where(found, self.lagged_coef, coef))
        if self.cache is not None and self.order and not self.next_in_order:
            self.next_in_order = {a.name: b for a, b in zip(self.order, self.order[1:])}
        self.norms, self.deferred_low, self.deferred_dense, self.deferred_rows = {}, [], [], []
        self.index, self.count, self.found_inf, self.poison = 0, 1, None, None
        return total.masked_fill(found, math.nan)

    def _apply_deferred(self, coef: Tensor | None) -> None:
        if self.cache is None:  # Adam over the slots in foreach ops (hmt_core.optim.grouped), then each write
            grouped.update_low_rank_many(self.opt, self.deferred_low, [s.pending for s in self.deferred_low], coef)
            for s in self.deferred_low:
                s.pending = None
            self._apply_deferred_dense(coef)
            return
        for i, s in enumerate(self.deferred_low):
            if self.cache is not None:
                self._fetch(s, self.deferred_low[i + 1] if i + 1 < len(self.deferred_low) else None)
            self.opt.update_low_rank(s, s.pending, coef)
            s.pending = None
            if self.cache is not None:
                s.basis = self.cache.park(s.name, s.basis)
        self._apply_deferred_dense(coef)

    def _apply_deferred_dense(self, coef: Tensor | None) -> None:
        # pending: a sharded engine's local gradient shard (else None)
        grads = [s.param.grad if s.pending is None else s.pending for s in self.deferred_dense]
        grouped.update_dense_many(self.opt, self.deferred_dense, grads, coef)
        for s in self.deferred_dense:
            s.param.grad = s.pending = None
        for apply_rows in self.deferred_rows:  # hmt_core.sparse_embedding: the touched rows, clipped by ``coef``
            apply_rows(coef)
