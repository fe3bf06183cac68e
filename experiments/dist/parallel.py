"""Building and wrapping the model to train across processes: ``dist=fsdp2`` shards it with
``torch.distributed.fsdp.fully_shard`` per decoder layer + root, ``dist=ddp`` wraps it in
``torch.nn.parallel.DistributedDataParallel`` unless the method reduces its own gradients (``Method.set_parallel``).
The process's place in the job is ``experiments.dist.context.DistContext``; design notes and measurements are in
docs/design/distributed.md."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from experiments.config import ModelConfig
from experiments.dist import meta_init
from experiments.dist.comm import GradAverager, MIB, row_sparse_names
from experiments.dist.context import (  # noqa: F401  (the launch API, reached through this module by its callers)
    DistContext, dryrun_context, for_rank, release_process_groups, setup, shard_corpus, teardown)
from experiments.errors import UserError
from experiments.models import build_model, model_source
from hmt_core.int8_weights import is_phantom
from hmt_core.optim.sharded import rank_from_root
from hmt_core.parallel import ParallelContext, is_replicated, mark_replicated


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the longest ``nn.ModuleList`` in the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def shard_model(model: nn.Module, ctx: DistContext | None, *, build: meta_init.BuildRecord | None = None) -> nn.Module:
    """``dist=fsdp2``: ``fully_shard`` each decoder layer, then the root (embeddings, final norm, lm_head), with the
    weights computed in their own dtype and the gradients reduce-scattered in fp32 (``reduce_dtype``: a bf16 model's
    unit gradients are copied into an fp32 reduce-scatter input, summed and averaged in fp32, then cast back).
    Parameters the method marked replicated (``hmt_core.parallel.is_replicated``: a table updated by rows, INT8
    codes and scales) are left out (``ignored_params``): whole on every rank, their gradients the method's to
    reduce (docs/distributed.md). A model built on meta (``build``: its recorded RNG draws,
    ``experiments.dist.meta_init``) then gets its shards on ``ctx.device`` (``to_empty``) filled with the
    single-process values, torchtitan's order."""
    if ctx is None or ctx.mode != "fsdp2":
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)  # weights as they are; gradients summed in fp32
    kept = [n for n, p in model.named_parameters() if is_replicated(p)]
    ignored = {model.get_parameter(n) for n in kept} or None
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=ctx.mesh, mp_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=ctx.mesh, mp_policy=policy, ignored_params=ignored)
    if any(p.device.type == "meta" for p in model.parameters()):
        model.to_empty(device=ctx.device)
        mark_replicated(*(model.get_parameter(n) for n in kept))  # to_empty made them new Parameters, untagged
        if build is not None:
            meta_init.replay(model, build, ctx.device)
    return model


def prepared(method, model: nn.Module, device: torch.device | None = None, materialize=None) -> nn.Module:
    """``method.prepare(model, device=device, materialize=materialize)``; a ``ValueError`` (the method's settings do
    not fit this model: qlora's ``target_modules`` matching nothing, ...) is the user's input and says so in one
    line."""
    try:
        return method.prepare(model, device=device, materialize=materialize)
    except ValueError as e:
        raise UserError(str(e)) from None


def build_sharded(cfg: ModelConfig, method, ctx: DistContext | None, *, vocab_size: int | None,
                  device: torch.device, values: bool = True) -> nn.Module:
    """The model to train, prepared by ``method`` and sharded as ``ctx`` says. ``dist=fsdp2`` with random init
    (no weights at ``model.path``): built on meta and initialised shard by shard (start-up peak: this rank's
    shards + one module at full size; ``values=False``, a dry run's fake tensors: the shards are left empty);
    otherwise built whole on ``device`` (an INT8 HMT model on CUDA: made module by module, ``quantizes_onto``;
    FSDP2 from weights: loaded whole, then sharded; a method that stores INT8 tables, ``method.embedding_dtype=int8``:
    quantized from the whole table, then sharded around it; a dry run with parameters left whole on every rank,
    ``hmt_core.parallel.is_replicated``)."""
    def whole() -> nn.Module:
        if not quantizes_onto(method, device):
            return shard_model(prepared(method, build_model(cfg, vocab_size=vocab_size, device=device)), ctx)
        if model_source(cfg) == "weights":  # loaded on the host, quantized onto the device
            return shard_model(prepared(method, build_model(cfg, vocab_size=vocab_size, device="cpu"), device), ctx)
        model = build_model(cfg, vocab_size=vocab_size, device="meta")
        return shard_model(prepared(method, model, device, meta_init.materializer(model, device)), ctx)

    if ctx is None or ctx.mode != "fsdp2" or model_source(cfg) == "weights" or method.prepare_reads_values:
        return whole()
    if not values:
        model = prepared(method, build_model(cfg, vocab_size=vocab_size, device="meta"))
        # a fake parameter left out of the shards cannot go through to_empty (torch swaps a fake tensor, whose
        # weakref forbids it): such a model is built whole
        return whole() if any(is_replicated(p) for p in model.parameters()) else shard_model(model, ctx)
    try:
        model, record = meta_init.record_build(lambda: build_model(cfg, vocab_size=vocab_size, device="meta"))
        return shard_model(prepared(method, model), ctx, build=record)
    except meta_init.UnreplayableInit as e:
        raise UserError(f"dist=fsdp2 cannot start this model on the meta device: {e}; use dist=ddp") from None


def quantizes_onto(method, device: torch.device) -> bool:
    """A CUDA model whose method stores its weights in INT8 (``Method.shrinks_weights``: HMT's ``weight_dtype`` /
    ``embedding_dtype``) is built on meta (random init; from weights: on the host) and made, initialised and
    quantized on the device one module at a time: its start-up peak is the INT8 model plus one full-precision module, not the full-precision model (an
    8B model's 16 GB of bf16 weights would not start on a 16 GiB GPU whose step fits)."""
    return device.type == "cuda" and method.shrinks_weights


def parallel_context(model: nn.Module, ctx: DistContext) -> ParallelContext:
    """What the method is told (``Method.set_parallel``): under ``ddp`` a gradient averager it may run inside
    backward (row-sparse embedding gradients travel sparse on gloo; NCCL has no sparse all-reduce) and rank 0's
    dynamic-rank decisions; under ``fsdp2`` the basis refresh mode and an averager for the parameters FSDP2 leaves
    whole (FSDP2 reduces the sharded gradients)."""
    if ctx.mode != "ddp":  # fsdp2: the reducer averages what FSDP2 leaves whole on every rank
        return ParallelContext(world_size=ctx.world_size, refresh_mode=ctx.refresh, reduce_grad=GradAverager(
            ctx.world_size, bucket_bytes=int(ctx.bucket_mb * MIB), group=ctx.mesh.get_group() if ctx.mesh else None))
    sparse = row_sparse_names(model) if ctx.backend == "gloo" else frozenset()
    return ParallelContext(world_size=ctx.world_size, refresh_mode=ctx.refresh, agree_rank=rank_from_root(),
                           reduce_grad=GradAverager(ctx.world_size, lowrank=ctx.lowrank_comm, row_sparse=sparse,
                                                    bucket_bytes=int(ctx.bucket_mb * MIB)))


def wrap_for_forward(model: nn.Module, method, ctx: DistContext | None, *, init_sync: bool = True,
                     rebuild_buckets: bool = True) -> nn.Module:
    """The module the loop calls forward on. ``ddp``: a ``DistributedDataParallel`` wrapper, except for per-layer
    HMT, whose engine all-reduces each gradient in its own hook (``Method.set_parallel`` says so). ``init_sync=False``
    (a dry run on fake tensors, which have no values to compare or broadcast): skip the initial broadcast of
    rank 0's weights, an in-place copy that allocates nothing. ``rebuild_buckets=False`` (the dry run, on real
    and fake tensors alike): keep the construction-time gradient buckets; DDP's re-bucketing in the second forward
    reads bucket indices that a fake tensor has no values for. ``fsdp2``: the model itself (already sharded); the
    method is told ``dist.refresh``."""
    if ctx is None or not ctx.distributed:
        return model
    setup_scope = ctx.comm.scope("setup") if ctx.comm is not None else contextlib.nullcontext()
    if method.set_parallel(parallel_context(model, ctx)):  # ddp + per-layer hmt: its engine reduces
        if init_sync:
            with setup_scope:
                broadcast_module(model)
        return model
    if ctx.mode != "ddp":
        return model
    if ctx.lowrank_comm:  # check_launch refuses it first; a direct caller gets the same message
        raise ValueError("dist.lowrank_comm=true needs per-layer hmt (its engine reduces the gradients)")
    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    frozen_4bit = any(type(p).__name__ == "Params4bit" for p in model.parameters())  # qlora (bitsandbytes NF4)
    phantoms = any(is_phantom(p) for p in model.parameters())  # INT8 weights: DDP's broadcast would write into one
    with setup_scope:  # element (see broadcast_module)
        if frozen_4bit and init_sync:  # DDP's broadcast cannot copy packed 4-bit weights (and their quant_state);
            for p in model.parameters():  # every rank quantized the same seeded base, so only the trainable
                if p.requires_grad:  # (LoRA) parameters are taken from rank 0, as DDP would
                    dist.broadcast(p.data, src=0)
        elif phantoms and init_sync:
            broadcast_module(model)
        wrapped = _DDP(model, device_ids=ids, forward_sync_buffers=False,  # identical buffers: no per-forward sync
                       init_sync=init_sync and not frozen_4bit and not phantoms)
    if ctx.comm is not None:  # counts each bucket, then DDP's default all-reduce (same arithmetic)
        wrapped.register_comm_hook(None, ctx.comm.ddp_hook)
    elif ctx.backend == "fake":
        wrapped.register_comm_hook(ctx.world_size, _fake_pg_allreduce_hook)
    if not rebuild_buckets:
        wrapped.reducer = _KeepBuckets(wrapped.reducer)
    return wrapped


class _KeepBuckets:
    """DDP's C++ reducer, answering "rebuilt the buckets?" with no (the rebuild never runs)."""

    def __init__(self, reducer) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)


def _fake_pg_allreduce_hook(world_size, bucket):  # bucket: dist.GradBucket -> Future[Tensor] (DDP checks real annotations)
    """DDP's default hook (divide by W, all-reduce in place) for the fake process group, whose asynchronous work
    completes with no value: the same in-place ops, then a future holding the bucket."""
    buffer = bucket.buffer()
    buffer.div_(world_size)
    dist.all_reduce(buffer)
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut


class _DDP(DistributedDataParallel):
    """DDP that hands out the wrapped model the way PEFT does (``get_base_model``), so the fused loss
    (``hmt_core.fused_ce.resolve_head``) finds the LM head while forward still goes through DDP."""

    def get_base_model(self) -> nn.Module:
        return self.module


@torch.no_grad()
def broadcast_module(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (what DDP does at construction). An INT8 layer's value is its
    codes and scales (parameters, broadcast like any); its phantom ``weight`` holds no value (a one-element storage
    expanded to the weight's shape, ``hmt_core.int8_weights``) and is skipped: a collective would write the full
    shape into that one element."""
    for t in [*model.parameters(), *model.buffers()]:
        if not is_phantom(t):
            dist.broadcast(t.data, src=0)


