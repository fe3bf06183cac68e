"""HMT's low-rank optimizer (Mode A: GaLore, Zhao et al. 2024, Alg. 2; Mode B: APOLLO, Zhu et al. 2024, Alg. 1):
which state each parameter owns (``hmt_core.optim.slot``), when its basis is refreshed and to what
(``hmt_core.optim.refresh``), and the updates, through the pure math of ``hmt_core.optim.update`` and every weight
write through ``hmt_core.precision.UpdateWriter``. Dense parameters (embeddings, norms, lm_head) get AdamW (the same
update functions with no projection) or bitsandbytes' ``AdamW8bit``; each slot's update is its updater's
(``hmt_core.optim.updaters``), picked here once. Design notes: docs/design/optimizer.md."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from hmt_core import projection as proj
from hmt_core.kernels import ops as kops
from hmt_core.optim import refresh as rf
from hmt_core.optim import update as upd
from hmt_core.optim.clip import clip_coefficient, global_norm
from hmt_core.optim.moments8 import Moments8
from hmt_core.optim.settings import OptimizerSettings
from hmt_core.optim.skip import DeviceSkip, reconcile
from hmt_core.optim.slot import Slot, load_slot_state, slot_state
from hmt_core.optim.updaters import PROJECTED, Dense8bitAdam, updater_for
from hmt_core.precision import UpdateWriter, chunk_rows_for, is_quantized
from hmt_core.rank import RankHistory
from hmt_core.rank_budget import make_rank_budget

__all__ = ["LowRankOptimizer", "Slot", "clip_coefficient", "global_norm"]


class LowRankOptimizer:
    """Per-parameter state in ``slots``; ``settings`` built once from the method's Config
    (``hmt_core.hmt_config.optimizer_settings``). Steps run per parameter inside backward (``hmt_core.optim.hooks``)
    or all at once (``step_all``); docs/design/optimizer.md says why this is not a ``torch.optim.Optimizer``."""

    def __init__(self, slots: list[Slot], settings: OptimizerSettings) -> None:
        self.slots = slots
        self.rule, self.projection = settings.rule, settings.projection
        self.schedule, self.precision, self.seed = settings.schedule, settings.precision, settings.seed
        self.lr = self.rule.lr  # the learning rate every update reads at its step, set by the schedule (``set_lr``)
        self.history = RankHistory()
        # multi-process: (rank, τ-rank, device) -> rank 0's pair, so every process takes one rank decision
        # (``hmt_core.optim.sharded.rank_from_root``); None: this process decides alone
        self.agree_rank: rf.AgreeRank | None = None
        self.refreshes = 0
        self.fallbacks = 0
        p = self.precision
        self.state_dtype = torch.bfloat16 if p.state_dtype == "bf16" else torch.float32
        self.dense_state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
            p.dense_state_dtype)  # None ("weight"): bf16 for a bf16 weight, else fp32
        self.kernels = p.kernels  # "auto" | "triton" | "torch"
        self.writer = UpdateWriter(master_weights=p.master_weights, stochastic_rounding=p.stochastic_rounding,
                                   seed=self.seed)
        for s in slots:
            s.seed = self.seed + s.index
            self.writer.check(s.name, s.param)
            s.master = self.writer.make_master(s.param)
            s.updater = updater_for(s, self.rule)
        limiter = self.rule.norm_limiter and PROJECTED[self.rule.mode].keeps_limiter_norm
        self.budget = make_rank_budget({s.name: (s.full_shape, s.param.dtype.itemsize, s.candidates)
                                        for s in slots if s.projected}, self.projection, state_dtype=p.state_dtype,
                                       limiter=limiter)  # None: no budget
        self.skip = DeviceSkip()  # the step-wide found_inf while updates run under ``skipping``
        self.dense8: dict[str, torch.optim.Optimizer] = {}
        # dense_8bit for a dense INT8 weight (the embedding, method.embedding_dtype=int8): our own 8-bit moments,
        # created at its first update (as bitsandbytes creates its state)
        self.moments8: dict[str, Moments8] = {}
        if self.rule.dense_8bit:
            self._make_dense8()

    def _make_dense8(self) -> None:
        from hmt_core.optim.adamw8bit_chunked import ChunkedAdamW8bit  # imports bitsandbytes: only when asked for

        r = self.rule
        for s in self.slots:
            if isinstance(s.updater, Dense8bitAdam):
                self.dense8[s.name] = ChunkedAdamW8bit([s.param], lr=self.lr, betas=(r.beta1, r.beta2), eps=r.eps,
                                                        weight_decay=r.weight_decay)

    # ------------------------------------------------------------------------------------------------ refresh
    def refresh_due(self, s: Slot) -> bool:
        return s.projected and (s.basis is None or s.clock.step % self.schedule.update_interval == 0)

    @torch.no_grad()
    def refresh(self, s: Slot, grad: Tensor | None, *, sketch: Any = None) -> None:  # grad: (out, in), unclipped
        """New basis (and rank) from ``grad`` (``hmt_core.optim.refresh.choose``); moments moved to it per
        ``moment_policy``. ``sketch`` (FSDP2 with ``dist.refresh=sketch``: ``hmt_core.optim.sharded_sketch.RowSketch``,
        ``grad`` None) stands in for a gradient that is never gathered: its shape, the randomized SVD's factors and
        the projection error come from it, computed across ranks (``method.basis=rsvd``), or a random basis of fixed
        rank (only the shape is read: ``hmt_core.optim.head_update``'s rows)."""
        if sketch is not None:
            rf.check_sketch(self.projection)
        src = grad if sketch is None else sketch
        choice = rf.choose(self.projection, s, grad, sketch, seed=self.seed, budget=self.budget,
                           agree_rank=self.agree_rank)
        self.fallbacks += choice.fell_back
        basis, rank = choice.basis, choice.rank
        rf.move_moments(s, basis, tuple(src.shape), src.device, policy=self.schedule.moment_policy,
                        dtype=self.state_dtype)
        s.basis, s.rank = basis, rank
        if self.budget is not None:
            self.budget.commit(s.name, rank)
        self.refreshes += 1
        error = (proj.relative_projection_error(grad, basis, choice.orthonormal) if sketch is None
                 else sketch.relative_error(basis, choice.orthonormal))
        self.history.record(s.name, s.clock.step, rank, error, choice.tau_rank)

    # ------------------------------------------------------------------------------------- device-side skipping
    def skipping(self, found_inf: Tensor | None) -> AbstractContextManager[None]:
        """Updates inside run under ``found_inf`` (() bool on the device; None: no skip decision): where it is True
        they leave weights and state as they were, with no host synchronization (``hmt_core.optim.skip``)."""
        return self.skip.under(found_inf)

    def _keep(self, s: Slot) -> Tensor | None:  # the writer's keep flag: decay, stochastic rounding, INT8 codes
        return self.skip.keep(self.rule.weight_decay > 0 or self.writer.stochastic
                              or is_quantized(s.param))

    def reconcile(self) -> None:
        reconcile(s.clock for s in self.slots)

    # ------------------------------------------------------------------------------------------------ updates
    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def lr_of(self, s: Slot) -> float:
        """The rate ``s`` is updated at this step: the scheduled rate × the slot's ``lr_scale``."""
        return self.lr * s.lr_scale

    def _begin_adam_step(self, s: Slot, like: Tensor, count: bool = True) -> None:  # like: the moments' gradient
        """Create the moments on first use (projected: ``state_dtype``; dense: ``dense_state_dtype``) and advance
        the step counters (``count`` False: the caller counts a skipped step, ``DeviceSkip.count_many``)."""
        if s.m is None:
            dtype = self.state_dtype if s.projected else (
                self.dense_state_dtype or (torch.bfloat16 if s.param.dtype == torch.bfloat16 else torch.float32))
            s.m = torch.zeros(like.shape, dtype=dtype, device=like.device)
            s.v = torch.zeros(like.shape, dtype=dtype, device=like.device)
        s.clock.step += 1
        s.clock.adam_t += 1
        if count:
            self.skip.count(s.clock)  # taken off the counters when the host reads the flags (``reconcile``)

    def _adam(self, s: Slot, g: Tensor, for_scaling: bool = False) -> tuple[Tensor, float]:  # g: (a, b) fp32
        """Moments update; returns Adam's (D, step size), or APOLLO's unscaled (N, step size)."""
        self._begin_adam_step(s, g)
        return self._adam_moments(s, g, for_scaling)

    def _adam_moments(self, s: Slot, g: Tensor, for_scaling: bool = False) -> tuple[Tensor, float]:  # g: (a, b)
        """``_adam`` after ``_begin_adam_step``."""
        c = self.rule
        old, factors, g = self._skippable_moments(s.m, s.v, g, fusable=not for_scaling)
        if not for_scaling:  # fused Triton Adam, or exactly adam_moments_ + adam_step
            d, step_size = kops.adam_step(s.m, s.v, g, s.clock.adam_t, lr=self.lr_of(s), beta1=c.beta1, beta2=c.beta2,
                                          eps=c.eps, style=c.adam_style, backend=self.kernels, factors=factors)
        else:
            m, v = upd.adam_moments_(s.m, s.v, g, c.beta1, c.beta2, c.adam_style, factors)
            d, step_size = upd.adam_direction(m, v, s.clock.adam_t, lr=self.lr_of(s), beta1=c.beta1, beta2=c.beta2,
                                              eps=c.eps, style=c.adam_style)
        s.clock.born = upd.retire_born(s.clock.born, s.clock.adam_t, c.beta1, c.beta2)
        if s.clock.born is not None:  # rank indices added by a rank increase: their own bias-correction clock
            groups = upd.clock_groups(s.clock.index(*proj.which_sides(s.full_shape, self.projection.sides), d.device),
                                      s.clock.adam_t)
            upd.fresh_clock_(d, s.m, s.v, groups, step_size=step_size, lr=self.lr_of(s), beta1=c.beta1, beta2=c.beta2,
                             eps=c.eps, style=c.adam_style, direction=for_scaling)
        self.skip.restore(old, s.m, s.v)
        # APOLLO's N only makes a scaling, whose coefficient update_full zeroes on a skipped step
        return (d if for_scaling else self.skip.zero(d)), step_size

    def _skippable_moments(self, m: Tensor, v: Tensor, g: Tensor, *,  # m, v, g: (a, b)
                           fusable: bool) -> tuple[tuple[Tensor, ...] | None, Tensor | None, Tensor]:
        """How this update of (m, v) from ``g`` is skipped on the device (``hmt_core.optim.skip``): (snapshot of m, v
        for the fused Triton Adam, or None; ``adam_moments_``'s factors, or None; ``g``, zeroed on a skipped step
        when the factors are used)."""
        if fusable and kops.adam_fuses(m, v, g, backend=self.kernels):
            return self.skip.snapshot(m, v), None, g
        factors = self.skip.moment_factors(self.rule.beta1, self.rule.beta2)
        return None, factors, (g if factors is None else self.skip.zero(g))

    def chunk_rows(self, grad: Tensor) -> int:  # grad: (out, in)
        """Rows of an update from ``grad`` per chunk, so that its fp32 temporaries stay within one row chunk."""
        return chunk_rows_for(tuple(grad.shape), torch.float32, like=grad)

    def _dense_adam_rows(self, s: Slot, grad: Tensor, rows: int,  # grad: (out, in) full gradient
                         eight: Moments8 | None = None) -> None:
        """Dense AdamW ``rows`` rows at a time: element-wise the same as the whole-tensor update (bit for bit),
        but only one chunk of fp32 gradient / moments / direction is alive instead of ~6 weight-sized ones. With
        8-bit moments ``eight`` (``moments8``) each chunk's moments are read as fp32, stepped, and stored back."""
        c = self.rule
        if eight is None:
            self._begin_adam_step(s, grad)
        else:
            s.clock.step, s.clock.adam_t = s.clock.step + 1, s.clock.adam_t + 1
            self.skip.count(s.clock)
        for a in range(0, grad.shape[0], rows):
            b = min(a + rows, grad.shape[0])
            m, v = (s.m[a:b], s.v[a:b]) if eight is None else eight.read(slice(a, b))
            old, factors, g = self._skippable_moments(m, v, grad[a:b].float(), fusable=True)
            d, step_size = kops.adam_step(m, v, g, s.clock.adam_t, lr=self.lr_of(s), beta1=c.beta1, beta2=c.beta2,
                                          eps=c.eps, style=c.adam_style, backend=self.kernels, factors=factors)
            if eight is None:
                self.skip.restore(old, m, v)
            else:
                eight.write(slice(a, b), m, v, self.skip.flag)
            d = self.skip.zero(d)
            with self.writer.rows(s.param.data, s.master, slice(a, b), self._keep(s)) as w:
                upd.apply_update_(w, d, step_size=step_size, lr=self.lr_of(s), weight_decay=c.weight_decay,
                                  style=c.adam_style)

    def _apply(self, s: Slot, full_update: Tensor, step_size: float) -> None:  # full_update: (out, in)
        for index in self.writer.spans(s.param, s.master, like=full_update):
            with self.writer.rows(s.param.data, s.master, index, self._keep(s)) as w:
                upd.apply_update_(w, full_update[index], step_size=step_size, lr=self.lr_of(s),
                                  weight_decay=self.rule.weight_decay, style=self.rule.adam_style)

    @torch.no_grad()
    def update_low_rank(self, s: Slot, low: Tensor, coef: Tensor | None = None) -> None:  # low: Ĝ, (out, r) | (r, in)
        """Mode A update from a (possibly micro-batch-accumulated) projected gradient Ĝ, clipped by ``coef``."""
        low = low.float()
        if coef is not None:
            low = low * coef
        self.write_low_rank(s, *self._adam(s, low))

    def write_low_rank(self, s: Slot, direction: Tensor, step_size: float) -> None:  # direction: (out, r) | (r, in)
        """W ← W − step_size·α·P D (Mode A's write of Adam's direction D)."""
        if s.basis is None:
            self._apply(s, direction, step_size)
            return
        # fused reconstruction + decay + update (Triton), or its row-chunked fallback: no full-size P U Qᵀ
        for index in self.writer.spans(s.param, s.master, like=direction):
            d, basis = direction, s.local_basis()
            if index is not Ellipsis:  # rows of W come from rows of the left factor (P, or D when right-sided)
                d, basis = (d[index], basis) if basis.left is None else (d, proj.Basis(basis.left[index], basis.right))
            if self.writer.fused(s.param.data, d):  # an INT8 weight's one-kernel write of the rows' P U Qᵀ
                a, b = kops.factors(d, basis)
                self._write_fused(s, index, torch.matmul(a, b), step_size * self.rule.scale)
                continue
            with self.writer.rows(s.param.data, s.master, index, self._keep(s)) as w:
                kops.lowrank_update(w, d, basis, scale=self.rule.scale, step_size=step_size, lr=self.lr_of(s),
                                    weight_decay=self.rule.weight_decay, style=self.rule.adam_style,
                                    backend=self.kernels)

    def _write_fused(self, s: Slot, index: Any, update: Tensor, step_size: float) -> None:  # update: rows of W
        self.writer.write_update(s.param.data, index, update.float(), step_size=step_size, lr=self.lr_of(s),
                                 weight_decay=self.rule.weight_decay, style=self.rule.adam_style, keep=self._keep(s))

    @torch.no_grad()
    def update_full(self, s: Slot, grad: Tensor, coef: Tensor | None = None, *,  # grad: (out, in) full gradient
                    reduce: Callable[[Tensor], Tensor] | None = None, grad_norm: Tensor | None = None) -> None:
        """One step of ``s`` from its full gradient, clipped by ``coef``: its updater's (``Updater.update``: dense
        AdamW, Mode A projecting ``grad`` itself, or Mode B). ``reduce`` (Mode B on a row shard,
        ``hmt_core.optim.sharded``: a sum over ranks, in place): a left-sided R = Σ_k P_kᵀ G_k and the
        tensor-scaling and limiter norms are summed; the update touches this rank's rows."""
        s.updater.update(self, s, grad, coef, reduce=reduce, grad_norm=grad_norm)

    @torch.no_grad()
    def step_all(self, max_grad_norm: float | None) -> Tensor | None:
        """Ordinary (not per-layer) step, with the same semantics and rounding as the per-layer path: bases are
        refreshed from the unclipped gradients (SVD bases and energy ranks are scale-invariant), the global norm
        is taken over the full gradients, and a projected (Mode A) gradient is clipped after projection
        (``clip(Pᵀ G) = Pᵀ clip(G)``). Returns the norm (() fp32 on the device), NaN for a step skipped on the
        device (a non-finite gradient); a due refresh checks its gradient on the host (its SVD synchronizes)."""
        live = [s for s in self.slots if s.param.grad is not None]
        if not live:
            return torch.zeros((), device=self.slots[0].param.device) if self.slots else None
        total = global_norm([torch.linalg.vector_norm(s.param.grad) for s in live])
        due = [s for s in live if self.refresh_due(s)]
        if due and not proj.all_finite(total):  # () on the host: a refresh step synchronizes anyway (SVD, rank)
            return torch.full((), math.nan, device=total.device)  # never refresh from a non-finite gradient
        for s in due:
            self.refresh(s, s.param.grad)
        found_inf = ~torch.isfinite(total)
        coef = clip_coefficient(total, max_grad_norm)
        with self.skipping(found_inf):
            for s in live:
                self.update_full(s, s.param.grad, coef)
        return torch.where(found_inf, math.nan, total)

    # ------------------------------------------------------------------------------------------------ state
    def state_tensors(self) -> Iterator[Tensor]:
        for s in self.slots:
            yield from s.tensors()
        for opt in self.dense8.values():
            for st in opt.state.values():
                yield from (t for t in st.values() if isinstance(t, Tensor))
        for eight in self.moments8.values():
            yield from eight.tensors()

    def projected_state_bytes(self) -> int:
        """Bytes of the projected weights' state tensors (moments, limiter, basis): what ``state_budget`` bounds."""
        return sum(t.numel() * t.element_size() for s in self.slots if s.projected
                   for t in (s.m, s.v, s.limiter_prev, *(s.basis or ())) if t is not None)

    def budget_metrics(self) -> dict[str, float]:
        out = {"optim/projected_state_bytes": float(self.projected_state_bytes())}
        if self.budget is not None:
            out["optim/state_budget_bytes"] = float(self.budget.budget)
        return out

    def state_dict(self) -> dict[str, Any]:
        self.reconcile()
        return {"slots": {s.name: slot_state(s) for s in self.slots}, "history": self.history.state_dict(),
                "refreshes": self.refreshes, "fallbacks": self.fallbacks, "lr": self.lr,
                "precision": self.writer.state_dict(),
                "budget": self.budget.state_dict() if self.budget is not None else None,
                "dense8": {name: opt.state_dict() for name, opt in self.dense8.items()},
                "moments8": {name: eight.state_dict() for name, eight in self.moments8.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        by_name = {s.name: s for s in self.slots}
        missing = set(by_name) - set(state["slots"])
        if missing:
            raise ValueError(f"hmt state_dict lacks parameters {sorted(missing)[:5]}")
        for name, st in state["slots"].items():
            load_slot_state(by_name[name], st)
        self.history.load_state_dict(state["history"])
        if self.budget is not None:
            if state.get("budget") is not None:
                self.budget.load_state_dict(state["budget"])
            else:  # written without a budget: the ranks held are the slots' own
                for s in self.slots:
                    if s.projected and s.basis is not None and s.rank in self.budget.grid(s.name):
                        self.budget.commit(s.name, s.rank)
        self.refreshes, self.fallbacks = int(state["refreshes"]), int(state["fallbacks"])
        self.set_lr(float(state["lr"]))
        self.writer.load_state_dict(state.get("precision"))
        for name, opt_state in state["dense8"].items():
            self.dense8[name].load_state_dict(opt_state)
        for name, st in state.get("moments8", {}).items():  # 8-bit moments of a dense INT8 weight
            s = by_name[name]
            self.moments8[name] = Moments8(tuple(s.param.shape), s.param.device)
            self.moments8[name].load_state_dict(st)
