"""Bookkeeping for HMT's low-rank optimizer: per-parameter slots, basis refresh schedule, state (de)serialization.

The math lives in ``hmt_core.optim.update`` (Mode A: GaLore, Zhao et al. 2024, Alg. 2; Mode B: APOLLO, Zhu et
al. 2024, Alg. 1) and ``hmt_core.projection`` / ``hmt_core.rank``; this class only decides *when* to refresh a
basis, which state tensors a parameter owns, and routes dense parameters (embeddings, norms, lm_head) to a
plain AdamW (the same update functions with no projection) or to bitsandbytes' ``AdamW8bit``.

A basis is refreshed before the update whose index ``step`` satisfies ``step % update_interval == 0``
(galore-torch's schedule: steps 0, T, 2T, ...). ``step`` counts updates; ``adam_t`` counts bias-correction
steps (equal, except after a ``reset`` of the moments); ``born`` gives rank indices added by a rank increase
their own bias-correction clock (``hmt_core.optim.update``, "Per-coordinate bias-correction clocks").

With ``basis="random"`` and a dynamic rank, the rank is chosen from what the Gaussian bases themselves capture
(``random_rank="captured"``, ``hmt_core.rank.choose_rank_by_capture``), not from the gradient's spectrum.

With ``state_budget`` and a dynamic rank, ``hmt_core.rank_budget.RankBudget`` caps each refresh's rank so the
projected state (moments, basis, limiter) never exceeds the budget; the τ-rank is recorded beside it.

Every weight write goes through ``hmt_core.precision.UpdateWriter``: in place (default), into the slot's fp32
``master`` copy, or through fp32 row chunks rounded stochastically into the BF16 weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from hmt_core import projection as proj
from hmt_core.kernels import ops as kops
from hmt_core.optim import update as upd
from hmt_core.optim.moments8 import Moments8
from hmt_core.optim.rows import row_spans
from hmt_core.optim.skip import DeviceSkip, reconcile
from hmt_core.precision import QuantizedWeight, UpdateWriter, chunk_rows_for
from hmt_core.rank import (RankHistory, captured_energy, choose_rank, choose_rank_by_capture, sketch_size,
                           valid_candidates)
from hmt_core.rank_budget import energy_curve, make_rank_budget


def global_norm(norms: list[Tensor]) -> Tensor:
    """‖(‖G_1‖, ..., ‖G_n‖)‖ in fp32, the arithmetic of ``torch.nn.utils.clip_grad_norm_``."""
    return torch.linalg.vector_norm(torch.stack(norms).float())


def clip_coefficient(total: Tensor, max_grad_norm: float | None) -> Tensor | None:
    """``min(1, c / (‖g‖ + 1e-6))`` as a 0-d tensor, like ``clip_grad_norm_``; ``None`` when not clipping."""
    if not max_grad_norm:
        return None
    return torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)


@dataclass(eq=False)
class Slot:
    name: str
    param: nn.Parameter
    index: int  # 1-based position among trainable parameters: APOLLO's projection seed
    projected: bool
    candidates: tuple[int, ...] = ()
    basis: proj.Basis | None = None
    m: Tensor | None = None  # (a, b) low-rank (projected) or full (dense)
    v: Tensor | None = None
    step: int = 0
    adam_t: int = 0
    seed: int = 0
    rank: int = 0
    limiter_prev: Tensor | None = None  # () Mode B norm-growth limiter memory
    pending: Tensor | None = None  # low-rank gradient accumulated over micro-batches / awaiting clipping
    master: Tensor | None = None  # fp32 master copy of a low-precision weight (master_weights)
    born: tuple[int, ...] | None = None  # (r,) adam step at which each rank index started; None: all at 0
    rows: slice | None = None  # FSDP2 (hmt_core.optim.sharded): ``param`` is the local shard, these global rows
    global_shape: tuple[int, ...] | None = None  # the whole weight's shape (None: ``param``'s own)
    grad_param: nn.Parameter | None = None  # the parameter whose ``.grad`` the hooks read (None: ``param``)
    clock: tuple[Any, tuple[upd.ClockGroup, ...]] | None = None  # (born, device) and its cached index tensors
    skipped: Tensor | None = None  # () int32 on the device: updates skipped on the device, not yet taken off
    #                                ``step``/``adam_t`` (``LowRankOptimizer.reconcile``)

    @property
    def full_shape(self) -> tuple[int, ...]:  # the layout (which side is projected) and rank follow it, not a shard's
        return self.global_shape if self.global_shape is not None else tuple(self.param.shape)

    def local_basis(self) -> proj.Basis | None:  # P[a:b] for a sharded left basis (Qᵀ is shared by all rows)
        b = self.basis
        return b if self.rows is None or b is None or b.left is None else proj.Basis(b.left[self.rows], b.right)

    def state_shape(self, basis: proj.Basis, shape: tuple[int, int]) -> tuple[int, int]:  # moments: local rows
        rows, cols = upd.low_rank_shape(basis, shape)  # when right-sided and sharded
        return (self.param.shape[0], cols) if self.rows is not None and basis.left is None else (rows, cols)


class LowRankOptimizer:
    def __init__(self, slots: list[Slot], cfg: Any) -> None:
        self.slots = slots
        self.cfg = cfg
        self.lr = cfg.lr
        self.history = RankHistory()
        # multi-process: (rank, τ-rank, device) -> rank 0's pair, so every process takes one rank decision
        # (``hmt_core.optim.sharded.rank_from_root``); None: this process decides alone
        self.agree_rank: Callable[[int, int, torch.device], tuple[int, int]] | None = None
        self.refreshes = 0
        self.fallbacks = 0
        self.state_dtype = torch.bfloat16 if cfg.state_dtype == "bf16" else torch.float32
        self.dense_state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
            getattr(cfg, "dense_state_dtype", "fp32"))  # None ("weight"): bf16 for a bf16 weight, else fp32
        self.kernels = getattr(cfg, "kernels", None)  # "auto" | "triton" | "torch"; None: hmt_core.kernels' global
        self.writer = UpdateWriter(master_weights=getattr(cfg, "master_weights", False),
                                   stochastic_rounding=getattr(cfg, "stochastic_rounding", False), seed=cfg.seed)
        for s in slots:
            s.seed = cfg.seed + s.index
            self.writer.check(s.name, s.param)
            s.master = self.writer.make_master(s.param)
        self.budget = make_rank_budget({s.name: (s.full_shape, s.param.dtype.itemsize, s.candidates)
                                        for s in slots if s.projected}, cfg)  # None: no state budget
        self.skip = DeviceSkip()  # the step-wide found_inf while updates run under ``skipping``
        self.dense8: dict[str, torch.optim.Optimizer] = {}
        # dense_8bit for a dense INT8 weight (the embedding, method.embedding_dtype=int8): our own 8-bit moments,
        # created at its first update (as bitsandbytes creates its state)
        self.moments8: dict[str, Moments8] = {}
        if cfg.dense_8bit:
            import bitsandbytes as bnb  # optional dependency: only when asked for

            for s in slots:
                if not s.projected and not isinstance(s.param, QuantizedWeight):
                    self.dense8[s.name] = bnb.optim.AdamW8bit([s.param], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                                              eps=cfg.eps, weight_decay=cfg.weight_decay)

    # ------------------------------------------------------------------------------------------------ refresh
    def refresh_due(self, s: Slot) -> bool:
        return s.projected and (s.basis is None or s.step % self.cfg.update_interval == 0)

    @torch.no_grad()
    def refresh(self, s: Slot, grad: Tensor | None, *, sketch: Any = None) -> None:  # grad: (out, in), unclipped
        """New basis (and rank) from ``grad``; moments moved to it per ``moment_policy``. ``sketch`` (FSDP2 with
        ``dist.refresh=sketch``: ``hmt_core.optim.sharded_sketch.RowSketch``, ``grad`` None) stands in for a gradient
        that is never gathered: its shape, the randomized SVD's factors and the projection error come from it,
        computed across ranks (``method.basis=rsvd``), or a random basis of fixed rank (only the shape is read:
        ``hmt_core.optim.head_update``'s rows)."""
        c = self.cfg
        shape_only = c.basis == "random" and c.rank is not None and c.sides != "identity"  # reads no values
        if sketch is not None and not shape_only and (c.basis != "rsvd" or c.sides == "identity"):
            raise ValueError(f"a sketched refresh needs method.basis=rsvd or a random basis of fixed rank (got "
                             f"basis={c.basis}, rank={c.rank}, sides={c.sides})")
        src = grad if sketch is None else sketch
        shape = tuple(src.shape)
        use_left, use_right = proj.which_sides(shape, c.sides)
        max_rank = min(shape)
        dtype, device = src.dtype, src.device
        orthonormal = c.basis != "random"
        factors = curve = tau_rank = None  # curve: E(r) on the budget's rank grid
        if c.sides == "identity":
            basis, rank, orthonormal = proj.identity_basis(shape, use_left, device, dtype), max_rank, True
        else:
            k = c.rank if c.rank is not None else sketch_size(s.candidates, c.rank_fallback, max_rank)
            if c.basis == "svd":
                factors = proj.exact_svd(grad, k)
            elif c.basis == "rsvd" or (c.rank is None and c.random_rank == "spectrum"):  # legacy: a sketch
                gen = torch.Generator().manual_seed(c.seed * 1_000_003 + s.index * 7919 + s.step)
                warm = s.basis if c.basis == "rsvd" else None
                kw = dict(power_iters=c.power_iters, oversample=c.oversample, warm=warm, generator=gen)
                factors = proj.randomized_svd(grad, k, **kw) if sketch is None else sketch.randomized_svd(k, **kw)
            if c.rank is not None:
                rank = c.rank
            elif c.basis == "random" and c.random_rank == "captured":
                rank, curve = self._random_capture(s, grad, use_left, use_right)
            elif factors is not None:
                rank = choose_rank(factors.s, factors.total_energy, candidates=s.candidates, tau=c.tau,
                                   fallback=c.rank_fallback, max_rank=max_rank)
                if self.budget is not None:
                    curve = energy_curve(factors.s, factors.total_energy, self.budget.grid(s.name))
            else:
                rank = s.rank or (valid_candidates(s.candidates, max_rank) or (max_rank,))[0]
            tau_rank = rank
            if self.budget is not None:  # dynamic rank only (a fixed rank has no budget)
                rank = self.budget.choose(s.name, s.step, tau_rank, curve)
            if self.agree_rank is not None and c.rank is None:  # a dynamic rank: rank 0's, on every process
                rank, tau_rank = self.agree_rank(rank, tau_rank, device)
            if factors is not None and c.basis == "rsvd" and rank > factors.s.numel():  # full rank: every vector
                exact = proj.exact_svd(grad, rank) if sketch is None else sketch.randomized_svd(rank, **kw)
                factors = exact or factors
            if c.basis == "random":
                basis, s.seed = proj.random_basis(shape, rank, use_left, use_right, s.seed, device, dtype)
            elif factors is not None and factors.s.numel() >= rank:
                basis = proj.basis_from_factors(factors, rank, use_left, use_right, dtype)
            else:  # factorization failed: keep the previous basis, else a seeded orthonormal one
                self.fallbacks += 1
                if s.basis is not None:
                    basis, rank = s.basis, s.basis.rank
                else:
                    basis = proj.orthonormal_fallback(shape, rank, use_left, use_right, s.seed, device, dtype)
        low_shape = s.state_shape(basis, shape)
        if s.m is None:
            s.m = torch.zeros(low_shape, dtype=self.state_dtype, device=device)
            s.v = torch.zeros(low_shape, dtype=self.state_dtype, device=device)
        elif s.basis is not None and basis is not s.basis:
            s.born = upd.transfer_born(s.born, s.basis, basis, c.moment_policy, s.adam_t)
            s.m, s.v = upd.transfer_moments(s.m, s.v, s.basis, basis, c.moment_policy, low_shape)
            if c.moment_policy == "reset":
                s.adam_t = 0
        s.basis, s.rank = basis, rank
        if self.budget is not None:
            self.budget.commit(s.name, rank)
        self.refreshes += 1
        error = (proj.relative_projection_error(grad, basis, orthonormal) if sketch is None
                 else sketch.relative_error(basis, orthonormal))
        self.history.record(s.name, s.step, rank, error, tau_rank)

    def _random_rank(self, s: Slot, grad: Tensor, use_left: bool, use_right: bool) -> int:  # grad: (out, in)
        """Smallest rank whose seeded Gaussian basis (the one ``random_basis`` would draw now) captures
        ≥ τ × what the largest considered rank's basis captures (the largest candidate, or full rank with
        ``rank_fallback="full"``). Dry run: the largest (no values to measure)."""
        return self._random_capture(s, grad, use_left, use_right)[0]

    def _random_capture(self, s: Slot, grad: Tensor, use_left: bool,
                        use_right: bool) -> tuple[int, tuple[float, ...] | None]:  # grad: (out, in)
        """(``_random_rank``, the energy each budget grid rank's basis captures; None without a budget)."""
        c, shape = self.cfg, tuple(grad.shape)
        max_rank = min(shape)
        ranks = valid_candidates(s.candidates, max_rank)
        if c.rank_fallback == "full" or not ranks:
            ranks = tuple(sorted(set(ranks) | {max_rank}))
        if is_fake(grad):
            return ranks[-1], None
        grid = self.budget.grid(s.name) if self.budget is not None else ()
        captured = {}
        for r in sorted(set(ranks) | set(grid)):
            b, _ = proj.random_basis(shape, r, use_left, use_right, s.seed, grad.device, grad.dtype)
            captured[r] = captured_energy(grad, b.left, b.right)
        rank = choose_rank_by_capture([captured[r] for r in ranks], ranks, c.tau)
        return rank, (tuple(captured[r] for r in grid) if grid else None)

    # ------------------------------------------------------------------------------------- device-side skipping
    def skipping(self, found_inf: Tensor | None) -> AbstractContextManager[None]:
        """Updates inside run under ``found_inf`` (() bool on the device; None: no skip decision): where it is True
        they leave weights and state as they were, with no host synchronization (``hmt_core.optim.skip``)."""
        return self.skip.under(found_inf)

    def _keep(self, s: Slot) -> Tensor | None:  # the writer's keep flag: decay, stochastic rounding, INT8 codes
        return self.skip.keep(self.cfg.weight_decay > 0 or self.writer.stochastic
                              or isinstance(s.param, QuantizedWeight))

    def reconcile(self) -> None:
        reconcile(self.slots)

    # ------------------------------------------------------------------------------------------------ updates
    def set_lr(self, lr: float) -> None:
        self.lr = lr
        for opt in self.dense8.values():
            for group in opt.param_groups:
                group["lr"] = lr

    def _begin_adam_step(self, s: Slot, like: Tensor, count: bool = True) -> None:  # like: the moments' gradient
        """Create the moments on first use (projected: ``state_dtype``; dense: ``dense_state_dtype``) and advance
        the step counters (``count`` False: the caller counts a skipped step, ``DeviceSkip.count_many``)."""
        if s.m is None:
            dtype = self.state_dtype if s.projected else (
                self.dense_state_dtype or (torch.bfloat16 if s.param.dtype == torch.bfloat16 else torch.float32))
            s.m = torch.zeros(like.shape, dtype=dtype, device=like.device)
            s.v = torch.zeros(like.shape, dtype=dtype, device=like.device)
        s.step += 1
        s.adam_t += 1
        if count:
            self.skip.count(s)  # taken off the counters when the host reads the flags (``reconcile``)

    def _adam(self, s: Slot, g: Tensor, for_scaling: bool = False) -> tuple[Tensor, float]:  # g: (a, b) fp32
        """Moments update; returns Adam's (D, step size), or APOLLO's unscaled (N, step size)."""
        self._begin_adam_step(s, g)
        return self._adam_moments(s, g, for_scaling)

    def _adam_moments(self, s: Slot, g: Tensor, for_scaling: bool = False) -> tuple[Tensor, float]:  # g: (a, b)
        """``_adam`` after ``_begin_adam_step``."""
        c = self.cfg
        old, factors, g = self._skippable_moments(s.m, s.v, g, fusable=not for_scaling)
        if not for_scaling:  # fused Triton Adam, or exactly adam_moments_ + adam_step
            d, step_size = kops.adam_step(s.m, s.v, g, s.adam_t, lr=self.lr, beta1=c.beta1, beta2=c.beta2,
                                          eps=c.eps, style=c.adam_style, backend=self.kernels, factors=factors)
        else:
            m, v = upd.adam_moments_(s.m, s.v, g, c.beta1, c.beta2, c.adam_style, factors)
            d, step_size = upd.adam_direction(m, v, s.adam_t, lr=self.lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                                              style=c.adam_style)
        s.born = upd.retire_born(s.born, s.adam_t, c.beta1, c.beta2)
        if s.born is not None:  # rank indices added by a rank increase: their own bias-correction clock
            groups = upd.clock_groups(self._clock_index(s, d.device), s.adam_t)
            upd.fresh_clock_(d, s.m, s.v, groups, step_size=step_size, lr=self.lr, beta1=c.beta1, beta2=c.beta2,
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
        factors = self.skip.moment_factors(self.cfg.beta1, self.cfg.beta2)
        return None, factors, (g if factors is None else self.skip.zero(g))

    def _clock_index(self, s: Slot, device: torch.device) -> tuple[upd.ClockGroup, ...]:
        """``s.born``'s index tensors, built when ``born`` changes (a refresh, a retirement), else the cached ones."""
        key = (s.born, device)
        if s.clock is None or s.clock[0] != key:
            left, right = proj.which_sides(s.full_shape, self.cfg.sides)
            s.clock = (key, upd.clock_index(s.born, left=left, right=right, device=device))
        return s.clock[1]

    def _dense_adam_rows(self, s: Slot, grad: Tensor, rows: int) -> None:  # grad: (out, in) full gradient
        """Dense AdamW ``rows`` rows at a time: element-wise the same as the whole-tensor update (bit for bit),
        but only one chunk of fp32 gradient / moments / direction is alive instead of ~6 weight-sized ones. With
        8-bit moments (``moments8``) each chunk's moments are read as fp32, stepped, and stored back."""
        c = self.cfg
        eight = None
        if c.dense_8bit and isinstance(s.param, QuantizedWeight):
            if s.name not in self.moments8:
                self.moments8[s.name] = Moments8(tuple(grad.shape), grad.device)
            eight = self.moments8[s.name]
        if eight is None:
            self._begin_adam_step(s, grad)
        else:
            s.step, s.adam_t = s.step + 1, s.adam_t + 1
            self.skip.count(s)
        for a in range(0, grad.shape[0], rows):
            b = min(a + rows, grad.shape[0])
            m, v = (s.m[a:b], s.v[a:b]) if eight is None else eight.read(slice(a, b))
            old, factors, g = self._skippable_moments(m, v, grad[a:b].float(), fusable=True)
            d, step_size = kops.adam_step(m, v, g, s.adam_t, lr=self.lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps,
                                          style=c.adam_style, backend=self.kernels, factors=factors)
            if eight is None:
                self.skip.restore(old, m, v)
            else:
                eight.write(slice(a, b), m, v, self.skip.flag)
            d = self.skip.zero(d)
            with self.writer.rows(s.param.data, s.master, slice(a, b), self._keep(s)) as w:
                upd.apply_update_(w, d, step_size=step_size, lr=self.lr, weight_decay=c.weight_decay,
                                  style=c.adam_style)

    def _apply(self, s: Slot, full_update: Tensor, step_size: float) -> None:  # full_update: (out, in)
        for index in self.writer.spans(s.param, s.master, like=full_update):
            with self.writer.rows(s.param.data, s.master, index, self._keep(s)) as w:
                upd.apply_update_(w, full_update[index], step_size=step_size, lr=self.lr,
                                  weight_decay=self.cfg.weight_decay, style=self.cfg.adam_style)

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
                self._write_fused(s, index, torch.matmul(a, b), step_size * self.cfg.scale)
                continue
            with self.writer.rows(s.param.data, s.master, index, self._keep(s)) as w:
                kops.lowrank_update(w, d, basis, scale=self.cfg.scale, step_size=step_size, lr=self.lr,
                                    weight_decay=self.cfg.weight_decay, style=self.cfg.adam_style,
                                    backend=self.kernels)

    def _write_fused(self, s: Slot, index: Any, update: Tensor, step_size: float) -> None:  # update: rows of W
        self.writer.write_update(s.param.data, index, update.float(), step_size=step_size, lr=self.lr,
                                 weight_decay=self.cfg.weight_decay, style=self.cfg.adam_style, keep=self._keep(s))

    @torch.no_grad()
    def update_full(self, s: Slot, grad: Tensor, coef: Tensor | None = None, *,  # grad: (out, in) full gradient
                    reduce: Callable[[Tensor], Tensor] | None = None, grad_norm: Tensor | None = None) -> None:
        """Dense AdamW, Mode A (projects ``grad`` itself) or Mode B (``mode_b_coefficient``). ``reduce`` (Mode B on a
        row shard, ``hmt_core.optim.sharded``: a sum over ranks, in place): a left-sided R = Σ_k P_kᵀ G_k and the
        tensor-scaling and limiter norms are summed; the update touches this rank's rows."""
        c = self.cfg
        if coef is not None and not (s.projected and c.mode == "B"):
            grad = grad * coef
        if not s.projected:
            if s.name in self.dense8:
                if self.skip.on_host():
                    return  # bitsandbytes' AdamW8bit cannot skip on the device: one host read per step
                s.param.grad = grad
                self.dense8[s.name].step()
                return
            rows = chunk_rows_for(tuple(grad.shape), torch.float32, like=grad) if grad.dim() == 2 else grad.shape[0]
            if rows < grad.shape[0] or (c.dense_8bit and isinstance(s.param, QuantizedWeight)):
                # a large dense weight (embedding, lm_head): row chunks, same arithmetic; 8-bit moments: always
                self._dense_adam_rows(s, grad, rows)
                return
            direction, step_size = self._adam(s, grad.float())
            self._apply(s, direction, step_size)
            return
        low = kops.project(grad, s.local_basis(), backend=self.kernels)
        if self.cfg.mode == "A":
            self.update_low_rank(s, low)
            return
        coef, step_size, keep = self.mode_b_coefficient(s, low, grad, reduce=reduce, clip=coef, grad_norm=grad_norm)
        rows = chunk_rows_for(tuple(grad.shape), torch.float32, like=grad)  # bounds addcmul_'s casting temporaries
        spans = (row_spans(grad.shape[0], rows) if rows < grad.shape[0]
                 else self.writer.spans(s.param, s.master, like=grad))
        for index in spans:
            self.mode_b_rows(s, index, grad[index], coef, step_size, keep)

    def mode_b_coefficient(self, s: Slot, low: Tensor, grad: Tensor | None, *, reduce: Callable | None = None,
                           row_norms: Tensor | None = None, clip: Tensor | None = None,  # low: Pᵀ G; grad: (out, in)
                           grad_norm: Tensor | None = None) -> tuple[Tensor, float, Tensor | None]:
        """Mode B's moments step on ``clip·low``, APOLLO's coefficient of ``grad`` (``upd.apollo_coefficient``; its
        ``row_norms``, ``grad_norm``) → (coef: clip in, 0 if skipped; step size·√scale; the writer's keep flag)."""
        c = self.cfg
        if reduce is not None and s.basis.left is not None:
            low = reduce(low.float())  # Pᵀ G = Σ_k P_kᵀ G_k, replicated
        low = upd.fp32_clipped(low, clip)
        direction, step_size = self._adam(s, low, for_scaling=True)
        factor = upd.apollo_scaling(direction, low, right_sided=s.basis.right is not None and s.basis.left is None,
                                    kind=c.scaling, reduce=reduce)
        coef, s.limiter_prev = upd.apollo_coefficient(  # a skipped step: coef 0 (rows kept), the memory kept
            grad, factor if clip is None else factor * clip, prev_norm=s.limiter_prev, reduce=reduce,
            row_norms=row_norms, grad_norm=grad_norm, gamma=c.limiter_gamma if c.norm_limiter else None,
            found_inf=self.skip.flag)
        return coef, step_size * math.sqrt(c.scale), self._keep(s)

    def mode_b_rows(self, s: Slot, index: Any, g: Tensor, coef: Tensor, step_size: float,  # g: G[index], (rows, in)
                    keep: Tensor | None) -> None:
        """W[index] ← W[index] − step·(g ⊙ coef[index]) (``mode_b_coefficient``'s coef, step size and keep)."""
        # 0 · NaN is NaN: where the writer does not keep the rows, a skipped step's gradient rows are zeroed too
        g = g if keep is not None else self.skip.zero(g)
        if self.writer.fused(s.param.data, g):  # an INT8 weight: one kernel writes the rows
            self._write_fused(s, index, g * upd.rows_of(coef, index), step_size)
            return
        with self.writer.rows(s.param.data, s.master, index, keep) as w:
            upd.apply_scaled_update_(w, g, upd.rows_of(coef, index), step_size=step_size, lr=self.lr,
                                     weight_decay=self.cfg.weight_decay, style=self.cfg.adam_style)

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
                if s.projected and self.cfg.mode == "A":
                    self.update_low_rank(s, kops.project(s.param.grad, s.basis, backend=self.kernels), coef)
                else:
                    self.update_full(s, s.param.grad, coef)
        return torch.where(found_inf, math.nan, total)

    # ------------------------------------------------------------------------------------------------ state
    def state_tensors(self) -> Iterator[Tensor]:
        for s in self.slots:
            for t in (s.m, s.v, s.limiter_prev, s.master):
                if t is not None:
                    yield t
            if s.basis is not None:
                yield from (t for t in s.basis if t is not None)
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
        slots = {}
        for s in self.slots:
            slots[s.name] = {
                "m": s.m, "v": s.v, "step": s.step, "adam_t": s.adam_t, "seed": s.seed, "rank": s.rank,
                "limiter_prev": s.limiter_prev, "master": s.master,
                "born": list(s.born) if s.born is not None else None,
                "basis_left": s.basis.left if s.basis is not None else None,
                "basis_right": s.basis.right if s.basis is not None else None,
                "has_basis": s.basis is not None,
            }
        return {"slots": slots, "history": self.history.state_dict(), "refreshes": self.refreshes,
                "fallbacks": self.fallbacks, "lr": self.lr, "precision": self.writer.state_dict(),
                "budget": self.budget.state_dict() if self.budget is not None else None,
                "dense8": {name: opt.state_dict() for name, opt in self.dense8.items()},
                "moments8": {name: eight.state_dict() for name, eight in self.moments8.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        by_name = {s.name: s for s in self.slots}
        missing = set(by_name) - set(state["slots"])
        if missing:
            raise ValueError(f"hmt state_dict lacks parameters {sorted(missing)[:5]}")
        for name, st in state["slots"].items():
            s = by_name[name]
            dev = s.param.device

            def to(t):
                return None if t is None else t.detach().clone().to(dev)

            s.m, s.v, s.limiter_prev = to(st["m"]), to(st["v"]), to(st["limiter_prev"])
            s.step, s.adam_t, s.seed, s.rank = int(st["step"]), int(st["adam_t"]), int(st["seed"]), int(st["rank"])
            s.basis = proj.Basis(to(st["basis_left"]), to(st["basis_right"])) if st["has_basis"] else None
            s.pending = None
            s.born = tuple(int(b) for b in st["born"]) if st.get("born") is not None else None
            if st.get("master") is not None:
                s.master = to(st["master"])
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
