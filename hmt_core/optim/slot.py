"""One trainable parameter as ``LowRankOptimizer`` holds it: the ``Slot`` (identity and optimizer state), its
``StepClock`` (the refresh schedule and Adam's bias-correction counters) and, on FSDP2 row shards, its ``ShardRows``
(which rows of which whole weight, and where the gradient arrives)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hmt_core import projection as proj
from hmt_core.optim import update as upd


@dataclass(eq=False, kw_only=True)
class StepClock:
    """A basis is refreshed before the update whose index ``step`` satisfies ``step % update_interval == 0``
    (galore-torch's schedule: steps 0, T, 2T, ...). ``step`` counts updates; ``adam_t`` counts bias-correction steps
    (equal, except after a ``reset`` of the moments); ``born`` gives rank indices added by a rank increase their own
    bias-correction clock (``hmt_core.optim.update``, "Per-coordinate bias-correction clocks")."""

    step: int = 0
    adam_t: int = 0
    born: tuple[int, ...] | None = None  # (r,) adam step at which each rank index started; None: all at 0
    born_index: tuple[Any, tuple[upd.ClockGroup, ...]] | None = None  # (born, device) and its cached index tensors
    skipped: Tensor | None = None  # () int32 on the device: updates skipped on the device, not yet taken off
    #                                ``step``/``adam_t`` (``hmt_core.optim.skip.reconcile``)

    def index(self, left: bool, right: bool, device: torch.device) -> tuple[upd.ClockGroup, ...]:
        """``born``'s index tensors, built when ``born`` changes (a refresh, a retirement), else the cached ones."""
        key = (self.born, device)
        if self.born_index is None or self.born_index[0] != key:
            self.born_index = (key, upd.clock_index(self.born, left=left, right=right, device=device))
        return self.born_index[1]


@dataclass(frozen=True, kw_only=True)
class ShardRows:
    """FSDP2 (``hmt_core.optim.sharded``): the slot's ``param`` is the local shard, rows ``rows`` of the whole
    weight of ``global_shape``; hooks read the gradient of the DTensor ``grad_param``."""

    rows: slice
    global_shape: tuple[int, ...]
    grad_param: nn.Parameter


@dataclass(eq=False, kw_only=True)
class Slot:
    name: str
    param: nn.Parameter
    index: int  # 1-based position among trainable parameters: APOLLO's projection seed
    projected: bool
    candidates: tuple[int, ...] = ()
    shard: ShardRows | None = None
    lr_scale: float = 1.0  # its rate = the optimizer's (scheduled) rate × this (``LowRankOptimizer.lr_of``)
    clock: StepClock = field(default_factory=StepClock)
    basis: proj.Basis | None = None
    rank: int = 0
    seed: int = 0
    m: Tensor | None = None  # (a, b) low-rank (projected) or full (dense)
    v: Tensor | None = None
    limiter_prev: Tensor | None = None  # () Mode B norm-growth limiter memory
    master: Tensor | None = None  # fp32 master copy of a low-precision weight (master_weights)
    pending: Tensor | None = None  # low-rank gradient accumulated over micro-batches / awaiting clipping
    updater: Any = None  # how it is updated (``hmt_core.optim.updaters.Updater``), picked by the optimizer

    @property
    def full_shape(self) -> tuple[int, ...]:  # the layout (which side is projected) and rank follow it, not a shard's
        return self.shard.global_shape if self.shard is not None else tuple(self.param.shape)

    @property
    def grad_holder(self) -> nn.Parameter:  # the parameter whose ``.grad`` the hooks read
        return self.param if self.shard is None else self.shard.grad_param

    def local_basis(self) -> proj.Basis | None:  # P[a:b] for a sharded left basis (Qᵀ is shared by all rows)
        b = self.basis
        return b if self.shard is None or b is None or b.left is None else proj.Basis(b.left[self.shard.rows], b.right)

    def tensors(self) -> Iterator[Tensor]:  # the optimizer state it holds: moments, limiter, master, basis
        yield from (t for t in (self.m, self.v, self.limiter_prev, self.master) if t is not None)
        if self.basis is not None:
            yield from (t for t in self.basis if t is not None)

    def state_shape(self, basis: proj.Basis, shape: tuple[int, int]) -> tuple[int, int]:  # moments: local rows
        rows, cols = upd.low_rank_shape(basis, shape)  # when right-sided and sharded
        return (self.param.shape[0], cols) if self.shard is not None and basis.left is None else (rows, cols)


def slot_state(s: Slot) -> dict[str, Any]:
    """The slot's entry in ``LowRankOptimizer.state_dict`` (the checkpoint format)."""
    return {
        "m": s.m, "v": s.v, "step": s.clock.step, "adam_t": s.clock.adam_t, "seed": s.seed, "rank": s.rank,
        "limiter_prev": s.limiter_prev, "master": s.master,
        "born": list(s.clock.born) if s.clock.born is not None else None,
        "basis_left": s.basis.left if s.basis is not None else None,
        "basis_right": s.basis.right if s.basis is not None else None,
        "has_basis": s.basis is not None,
    }


def load_slot_state(s: Slot, st: dict[str, Any]) -> None:
    """``slot_state``'s inverse, onto the slot's device."""
    dev = s.param.device

    def to(t):
        return None if t is None else t.detach().clone().to(dev)

    s.m, s.v, s.limiter_prev = to(st["m"]), to(st["v"]), to(st["limiter_prev"])
    s.clock.step, s.clock.adam_t = int(st["step"]), int(st["adam_t"])
    s.seed, s.rank = int(st["seed"]), int(st["rank"])
    s.basis = proj.Basis(to(st["basis_left"]), to(st["basis_right"])) if st["has_basis"] else None
    s.pending = None
    s.clock.born = tuple(int(b) for b in st["born"]) if st.get("born") is not None else None
    if st.get("master") is not None:
        s.master = to(st["master"])
