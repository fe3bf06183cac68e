"""The LM head's Mode B update (APOLLO, Zhu et al., 2024, Alg. 1) by vocabulary block inside the fused loss's backward
(``method.head_update=in_loss``): the head's (V, d) gradient is never materialized. The loss walks the vocabulary
blocks twice (``fused_ce.HeadUpdate``): ``observe`` keeps R = G Qᵀ's rows and the row norms ‖G_v‖; ``prepare`` runs
the slot's ``ApolloScaling.coefficient`` (the moments step and APOLLO's coefficient, as ``update`` from the full
gradient); ``apply`` updates each block's rows from its recomputed gradient rows (``write_rows``). Design notes,
cost and what is refused: docs/design/hmt_core_notes.md."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from hmt_core import projection as proj
from hmt_core.fused_ce import IN_LOSS_UPDATE
from hmt_core.kernels import ops as kops
from hmt_core.optim.hooks import PerLayerEngine
from hmt_core.optim.optimizer import Slot
from hmt_core.optim.settings import Mode
from hmt_core.precision import chunk_rows_for


class Settings(Protocol):
    """The keys of HMT's Config (``hmt_core.hmt_config.Config``) that decide whether the head can be updated by block."""

    mode: str
    basis: str
    rank: int | None
    sides: str
    per_layer: bool
    offload_bases: bool
    head_update: str


def config_error(cfg: Settings) -> str | None:
    """Why ``cfg`` (HMT's Config) cannot update the head by block whatever the model, or None."""
    return ("it needs method.mode=B" if Mode(cfg.mode) is not Mode.APOLLO_SCALING
            else "it needs method.basis=random with a fixed method.rank (other bases read the whole gradient)"
            if cfg.basis != "random" or cfg.rank is None
            else "it needs method.sides=one_sided" if cfg.sides != "one_sided"
            else "it needs method.per_layer=true" if not cfg.per_layer
            else "it cannot be combined with method.offload_bases=true" if cfg.offload_bases else None)


def check_head_update(cfg: Settings, slot: Slot | None, *, tied: bool, sharded: bool) -> None:
    """ValueError (one line) naming why ``method.head_update=in_loss`` cannot update this head by block."""
    why = config_error(cfg) or (
        "the LM head's weight is not a trainable parameter" if slot is None
        else "the LM head is tied to the input embedding" if tied
        else "the LM head must be projected (lm_head in method.target_patterns)" if not slot.projected
        else f"it needs a right-sided basis: vocabulary >= hidden size (the head is {tuple(slot.param.shape)})"
        if proj.which_sides(tuple(slot.param.shape), cfg.sides) != (False, True)
        else "it cannot be combined with a sharded (FSDP2) model" if sharded else None)
    if why:
        raise ValueError(f"method.head_update=in_loss: {why}")


def install_head_update(model: nn.Module, engine: PerLayerEngine | None, cfg: Settings, *, sharded: bool) -> None:
    """Hand the LM head of ``model`` its ``InLossHeadUpdate`` (``cfg.head_update == "in_loss"``; the fused loss finds
    it on the module), or take an earlier one away; ValueError (``check_head_update``) if it cannot be done."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, IN_LOSS_UPDATE):
        delattr(head, IN_LOSS_UPDATE)
    if cfg.head_update != "in_loss":
        return
    if head is None or engine is None:
        check_head_update(cfg, None, tied=False, sharded=sharded)
    names = {id(m): n for n, m in model.named_modules()}
    slot = next((s for s in engine.opt.slots if s.name == f"{names.get(id(head))}.weight"), None)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = embedding is not None and getattr(embedding, "weight", None) is head.weight
    check_head_update(cfg, slot, tied=tied, sharded=sharded)
    setattr(head, IN_LOSS_UPDATE, InLossHeadUpdate(engine, slot))


class _RefreshRows:
    """``LowRankOptimizer.refresh``'s stand-in for the head's gradient (``sketch``): its shape, dtype and device,
    and the projection error measured row by row in the first walk."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, error: float) -> None:
        self.shape, self.dtype, self.device, self.error = shape, dtype, device, error

    def relative_error(self, basis, orthonormal: bool) -> float:
        return self.error


class InLossHeadUpdate:
    """``fused_ce.HeadUpdate`` for a Mode B head slot of ``engine``'s optimizer (see the module docstring)."""

    def __init__(self, engine: PerLayerEngine, slot: Slot) -> None:
        self.engine, self.slot = engine, slot
        self._clear()

    def _clear(self) -> None:
        self.low = self.row_norms = self.basis = self.ortho = self.residual = None
        self.coef = self.keep = self.flag = self.lag = None
        self.step_size, self.refresh, self.skip = 0.0, False, False

    @torch.no_grad()
    def begin(self) -> None:
        engine, s = self.engine, self.slot
        if engine.count != 1:
            raise RuntimeError("method.head_update=in_loss: gradient accumulation (train.grad_accum > 1) is refused")
        self._clear()
        self.skip = engine.nonfinite
        opt, shape = engine.opt, tuple(s.param.shape)
        self.refresh = opt.refresh_due(s)
        self.basis = s.basis
        if self.refresh:  # the basis the refresh will draw (a pure function of the seed), committed in prepare
            self.basis, _ = proj.random_basis(shape, opt.projection.rank, False, True, s.seed, s.param.device,
                                              s.param.dtype)
            self.ortho = torch.linalg.qr(self.basis.right.float().t()).Q.t()  # (r, d), orthonormal rows
            self.residual = torch.zeros((), dtype=torch.float32, device=s.param.device)
        self.lag = engine.lagged_coef
        self.row_norms = torch.empty(shape[0], dtype=torch.float32, device=s.param.device)  # (V,)
        self.low = None  # (V, r) fp32, allocated at the first block (the basis' rank)

    def _clipped(self, grad_rows: Tensor) -> Tensor:  # (Vb, d): the lagged clipping coefficient applied
        return grad_rows if self.lag is None else grad_rows * self.lag

    @torch.no_grad()
    def observe(self, start: int, grad_rows: Tensor) -> None:  # grad_rows: (Vb, d), rows [start, start + Vb)
        if self.skip:
            return
        end = start + grad_rows.shape[0]
        self.row_norms[start:end] = torch.linalg.vector_norm(grad_rows, dim=1, dtype=torch.float32)
        g = self._clipped(grad_rows)
        low = kops.project(g, self.basis, backend=self.engine.opt.kernels).float()  # (Vb, r)
        if self.low is None:
            self.low = torch.empty((self.slot.param.shape[0], low.shape[1]), dtype=torch.float32, device=low.device)
        self.low[start:end] = low
        if self.refresh:  # ‖G_v − G_v Q̃ᵀ Q̃‖², the rows' share of relative_projection_error's residual
            g32 = grad_rows.float()
            self.residual += torch.linalg.vector_norm(g32 - (g32 @ self.ortho.t()) @ self.ortho).square()

    @torch.no_grad()
    def prepare(self) -> None:
        engine, s, opt = self.engine, self.slot, self.engine.opt
        if self.skip or self.low is None:
            return
        norm = torch.linalg.vector_norm(self.row_norms)  # ‖G‖ (unclipped), as the in-hook path records it
        engine.norms[s.index] = norm
        if self.refresh:
            if not engine._finite(norm):  # a host read: refresh steps synchronize anyway
                self.skip = True
                return
            total = 0.0 if is_fake(norm) else float(norm)  # a dry run has no values: no error to measure
            error = 0.0 if total == 0 else float(self.residual.sqrt()) / total
            opt.refresh(s, None, sketch=_RefreshRows(tuple(s.param.shape), s.param.dtype, s.param.device, error))
        self.flag = engine._flag(norm)
        row_norms = self.row_norms if self.lag is None else self.row_norms * self.lag
        with opt.skipping(self.flag):
            self.coef, self.step_size, self.keep = s.updater.coefficient(opt, s, self.low, None, row_norms=row_norms)
        self.low = self.row_norms = self.residual = None

    @torch.no_grad()
    def apply(self, start: int, grad_rows: Tensor) -> None:  # grad_rows: (Vb, d)
        if self.skip or self.coef is None:
            return
        opt, g = self.engine.opt, self._clipped(grad_rows)
        rows = chunk_rows_for(tuple(self.slot.param.shape), torch.float32, like=g)  # bounds fp32 temporaries
        with opt.skipping(self.flag):
            for a in range(0, g.shape[0], rows):
                b = min(g.shape[0], a + rows)
                self.slot.updater.write_rows(opt, self.slot, slice(start + a, start + b), g[a:b], self.coef,
                                             self.step_size, self.keep)
