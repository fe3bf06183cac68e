"""HMT's per-layer engine on FSDP2 row shards (``fully_shard``, ``Shard(0)``): GaLore's one-sided projection (Zhao et
al. 2024, Eq. 2-3 / Alg. 2) restricted to rows [a, b) of every weight. A right basis Q gives the local rows
Ĝ_k = G_k Q; a left basis P gives Ĝ = Σ_k P_kᵀ G_k (one r × n all-reduce). Bases are refreshed from the gathered
gradient or a row sketch (``hmt_core.optim.sharded_sketch``); Mode B's scaling and the clipping norm are sums over
ranks. Design notes, collectives and scope: docs/design/sharded.md."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from hmt_core.kernels import ops as kops
from hmt_core.optim.hooks import PerLayerEngine
from hmt_core.optim.optimizer import LowRankOptimizer, Slot
from hmt_core.optim.rows import rank_rows
from hmt_core.optim.sharded_sketch import RowSketch
from hmt_core.optim.slot import ShardRows
from hmt_core.parallel import ParallelContext


@contextlib.contextmanager
def off_reduce_scatter_stream(grad: Tensor) -> Iterator[None]:  # grad: the local gradient shard FSDP2 handed over
    """Runs the body on the device's default stream. FSDP2 calls post-accumulate-grad hooks on its reduce-scatter
    stream (``foreach_reduce``, inside ``device_handle.stream(post_reduce_stream)``); HMT's GEMMs, SVDs and
    collectives there would hold up the next unit's reduce-scatter. So: an event recorded on that stream, the
    default stream waits for it (the gradient is reduced), the gradient's storage is marked as used by the default
    stream (``record_stream``: the caching allocator must not hand the reduce-scatter output to a later
    reduce-scatter while the default stream still reads it), and the hook work is issued on the default stream,
    where torch's optimizer would run it. Anything but a CUDA tensor on a side stream: the body as it is."""
    if grad.device.type != "cuda":
        yield
        return
    side, main = torch.cuda.current_stream(grad.device), torch.cuda.default_stream(grad.device)
    if side == main:
        yield
        return
    reduced = side.record_event()
    main.wait_event(reduced)
    grad.record_stream(main)
    with torch.cuda.stream(main):
        yield


def is_sharded(param: Tensor) -> bool:
    """True for a DTensor parameter (FSDP2's sharded parameters)."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


class ShardedSettings(Protocol):
    """The keys of HMT's Config (``hmt_core.hmt_config.Config``) that decide whether it runs on row shards."""

    sides: str
    per_layer: bool
    weight_dtype: str
    embedding_dtype: str
    master_weights: bool
    stochastic_rounding: bool
    offload_bases: bool
    dense_8bit: bool


def sharded_config_error(cfg: ShardedSettings) -> str | None:
    """Why ``cfg`` (hmt's Config) cannot run on row-sharded weights, naming the key; None when it can."""
    if cfg.sides == "identity":
        return "method.sides=identity is not supported with sharded weights (dist=fsdp2): a test-only full-rank basis"
    fixed = (("per_layer", True, "the sharded engine is the per-layer one"),
             ("weight_dtype", "bf16", "INT8 weights are not FSDP2 parameters"),
             ("master_weights", False, "fp32 masters are not sharded"),
             ("stochastic_rounding", False, "not supported on shards"),
             ("offload_bases", False, "the basis cache is not sharded"),
             ("dense_8bit", False, "bitsandbytes' AdamW8bit does not step DTensor shards"))
    for key, want, why in fixed:
        if getattr(cfg, key) != want:
            return f"method.{key}={getattr(cfg, key)} is not supported with sharded weights (dist=fsdp2): {why}"
    return None


def take_parallel(engine: PerLayerEngine | None, opt: LowRankOptimizer, context: ParallelContext) -> bool:
    """``HMTMethod.set_parallel`` (``hmt_core.method``): row shards (FSDP2) take ``context.refresh_mode`` and
    ``context.reduce_grad`` for the parameters held whole on every rank, and leave the sharded gradients to FSDP2
    (False); the per-layer engine on whole weights takes ``context.reduce_grad`` and
    ``agree_rank`` (True: it averages every gradient across ranks inside backward); ``per_layer=false``: the
    caller's wrapper reduces (False)."""
    on_shards = isinstance(engine, ShardedEngine)
    if context.refresh_mode != "gather":
        if not on_shards:
            raise ValueError(f"dist.refresh={context.refresh_mode} needs method=hmt on FSDP2 shards "
                             "(its sharded engine)")
        engine.refresh_mode = context.refresh_mode
    if on_shards:
        engine.reduce_grad = context.reduce_grad  # replicated parameters' gradients, a row-sparse table's rows
        return False
    if engine is None or context.reduce_grad is None:
        return False
    opt.agree_rank = context.agree_rank
    engine.reduce_grad = context.reduce_grad
    return True


def rank_from_root(group=None):
    """``LowRankOptimizer.agree_rank`` across the ranks of ``group`` (None: the default group): group rank 0's
    (rank, τ-rank), broadcast (one 2-element int64 broadcast per refresh of a dynamic-rank weight). Every process
    computes its own SVD; near the τ threshold (or at a budget tie) two processes may pick different ranks from
    rounding-level differences of their inputs (another GPU's reduction order), and then the low-rank collectives
    that follow (a left-sided Ĝ all-reduce, ``lowrank_comm``'s) would disagree on shapes and hang. A dry run's fake
    values are not read (the local decision stands: one process)."""
    root = 0 if group is None else dist.get_global_rank(group, 0)

    def agree(rank: int, tau_rank: int, device: torch.device) -> tuple[int, int]:
        pair = torch.tensor([rank, tau_rank], dtype=torch.int64).to(device)  # (2,)
        dist.broadcast(pair, src=root, group=group)
        if is_fake(pair):
            return rank, tau_rank
        agreed = pair.tolist()  # the rank sets tensor shapes: read on the host, at refreshes only
        return int(agreed[0]), int(agreed[1])

    return agree


def shard_rows(param: Tensor) -> slice:
    """The global rows of a ``Shard(0)`` DTensor's local tensor on this rank (checked against its local length)."""
    from torch.distributed.tensor import Shard

    mesh = param.device_mesh
    if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(f"sharded HMT needs a 1-D mesh and Shard(0) placement, got {param.placements}")
    rows = rank_rows(param.shape[0], mesh.size(), mesh.get_local_rank())
    if rows.stop - rows.start != param._local_tensor.shape[0]:
        raise ValueError(f"local shard {tuple(param._local_tensor.shape)} is not rows {rows} of {tuple(param.shape)}")
    return rows


def sharded_slot(name: str, param: nn.Parameter, **kwargs) -> Slot:
    """A ``Slot`` whose updated tensor is the DTensor's local rows (the storage FSDP2 all-gathers from)."""
    return Slot(name=name, param=param._local_tensor, **kwargs,
                shard=ShardRows(rows=shard_rows(param), global_shape=tuple(param.shape), grad_param=param))


class ShardedEngine(PerLayerEngine):
    """``PerLayerEngine`` on FSDP2 shards: hooks read the local gradient rows (see the module docstring). A slot
    without a shard (a parameter FSDP2 leaves whole on every rank, ``hmt_core.parallel.is_replicated``) is handled
    as by the per-layer engine under DDP: its gradient averaged by ``reduce_grad``, a row-sparse table's rows
    gathered by it (``hmt_core.sparse_embedding``); its norm enters the global one once (rank 0's)."""

    def __init__(self, opt: LowRankOptimizer, *, max_grad_norm: float | None) -> None:
        super().__init__(opt, max_grad_norm=max_grad_norm)
        mesh = next((s.shard.grad_param.device_mesh for s in opt.slots if s.shard is not None), None)
        self.group = mesh.get_group() if mesh is not None else None
        self.refresh_mode = "gather"  # dist.refresh (set by take_parallel): "gather" | "sketch"
        self.replicated = frozenset(s.index for s in opt.slots if s.shard is None)
        self.first = self.group is None or dist.get_rank(self.group) == 0
        if self.group is not None:
            opt.agree_rank = rank_from_root(self.group)

    def _on_grad(self, s: Slot, param: Tensor) -> None:
        grad = param.grad
        if grad is None:
            return super()._on_grad(s, param)
        with off_reduce_scatter_stream(getattr(grad, "_local_tensor", grad)):
            super()._on_grad(s, param)

    @torch.no_grad()
    def _on_grad_body(self, s: Slot, param: Tensor) -> None:
        if s.shard is None:  # whole on every rank: reduced by ``reduce_grad``, as under DDP
            return super()._on_grad_body(s, param)
        g = param.grad  # DTensor: the averaged gradient's local rows (summed over this step's micro-batches so far)
        if g is None:
            return
        if self.nonfinite:  # decided on a gathered (identical) gradient: every rank skips alike
            param.grad = None
            return
        s.param = param._local_tensor  # FSDP2 may re-pad (reset_sharded_param): always the current storage
        local = g._local_tensor  # (b−a, n)
        last = self.index == self.count - 1
        if not s.projected:
            if not last:
                return  # FSDP2 accumulates the next micro-batch's shard into param.grad
            self.norms[s.index] = torch.linalg.vector_norm(local)  # a row shard: ‖G‖² = Σ_ranks ‖G_k‖²
            s.pending = local if local.untyped_storage().nbytes() == local.nbytes else local.clone()  # kept until
            self.deferred_dense.append(s)  # finish_step: a copy, unless it owns its storage (FSDP's RS buffer)
            param.grad = None
            return
        if not s.updater.takes_low_rank_gradient:  # Mode B
            if not last:
                return  # Mode B scales the full gradient: FSDP2 accumulates its shard until the last micro-batch
            self._mode_b_in_hook(s, g, local)
            param.grad = None
            return
        if self.count == 1:
            self.norms[s.index] = torch.linalg.vector_norm(local)
        low = self._refresh_if_due(s, g, local) if self.index == 0 else None
        if self.nonfinite:  # a refresh met a non-finite gradient: the step is skipped on every rank
            param.grad = None
            return
        if low is None or self.count > 1:  # accumulating: local partial projections, summed over ranks once
            low = kops.project(local, s.local_basis(), backend=self.opt.kernels).float()  # G_k Q, or P_kᵀ G_k
            if s.basis.left is not None and self.count == 1:
                self._sum(low)  # Pᵀ G = Σ_k P_kᵀ G_k: r × n
        s.pending = low.float() if s.pending is None else s.pending.add_(low)
        param.grad = None
        if not last:
            return
        if self.count > 1:
            if s.basis.left is not None:  # Σ_i Σ_k P_kᵀ G_ik: one r × n all-reduce per step, not per micro-batch
                self._sum(s.pending)
            self.norms[s.index] = self._accumulated_norm(s)
        self.deferred_low.append(s)  # updated in finish_step, after the global norm (clipping or not)

    def _mode_b_in_hook(self, s: Slot, g: Tensor, local: Tensor) -> None:
        """Mode B (APOLLO, Zhu et al. 2024, Alg. 1) in the hook, as the single-process per-layer engine does it:
        a due refresh from the gathered gradient, then ``s ⊙ G`` on this rank's rows, clipped by the previous
        step's coefficient (lagged clipping, ``hmt_core.optim.hooks`` rule 3). The global ‖G‖² is all-reduced first
        (one scalar): the skip decision for a non-finite gradient must be the same on every rank."""
        opt = self.opt
        norm = torch.linalg.vector_norm(local)
        self.norms[s.index] = norm
        total_sq = self._sum(norm.float().square())  # ‖G‖², summed: the same on every rank
        found_inf = self._flag(total_sq)
        if opt.refresh_due(s):
            if not self._finite(total_sq):  # on the host, identically on every rank: a refresh step synchronizes
                return
            full = g.full_tensor()  # (m, n): the seeded random basis (and a captured rank) as in one process
            opt.refresh(s, full)
            del full
        with opt.skipping(found_inf):  # R, the tensor and limiter norms: summed over ranks
            opt.update_full(s, local, self.lagged_coef, reduce=self._sum)

    def _sum(self, t: Tensor) -> Tensor:
        """``t`` summed over ranks, in place (what ``LowRankOptimizer.update_full`` needs on row shards)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def _refresh_if_due(self, s: Slot, g: Tensor, local: Tensor) -> Tensor | None:
        """A due basis refresh from this (first) micro-batch's gradient; returns Ĝ when the refresh produced it
        (a gathered left-sided one, or the sketch's), else None (also when the gradient is not finite, which
        ``self.nonfinite`` then records)."""
        opt = self.opt
        if not opt.refresh_due(s):
            return None
        if self.refresh_mode == "sketch":  # distributed range finder: G never gathered
            sketch = RowSketch(local, rows=s.shard.rows, shape=s.full_shape, group=self.group, kernels=opt.kernels)
            if not self._finite(sketch.energy):  # the all-reduced ‖G‖²: every rank skips alike
                return None
            opt.refresh(s, None, sketch=sketch)
            return sketch.low  # Ĝ as between refreshes (G_k Q, or the all-reduced Σ_k P_kᵀ G_k)
        full = g.full_tensor()  # (m, n): all-gather, then the single-process refresh on the global gradient
        if not self._finite(full):
            return None
        opt.refresh(s, full)
        return kops.project(full, s.basis, backend=opt.kernels) if s.basis.left is not None else None

    def _accumulated_norm(self, s: Slot) -> Tensor:  # (): this rank's share of ‖Σ_i Ĝ_i‖
        """With accumulation a Mode A weight contributes ‖Σ_i Ĝ_i‖ (``hmt_core.optim.hooks``, rule 4): Ĝ's rows
        are this rank's rows for a right-sided weight; a left-sided Ĝ is replicated, so only rank 0 counts it."""
        norm = torch.linalg.vector_norm(s.pending)
        if s.basis.left is not None and dist.get_rank(self.group) != 0:
            return torch.zeros_like(norm)
        return norm

    def _global_norm(self) -> Tensor:  # (): √(all-reduce SUM of Σ_p ‖G_p,k‖²)
        local = torch.stack([self.norms[i] if self.first or i not in self.replicated else self.norms[i] * 0.0
                             for i in sorted(self.norms)]).float()  # a replicated gradient's norm: rank 0's
        return self._sum(local.square().sum()).sqrt()
