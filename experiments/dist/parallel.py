"""Multi-process training on PyTorch's own engine, launched by ``torchrun``: ``dist=ddp`` (``torch.nn.parallel.
DistributedDataParallel``) or ``dist=fsdp2`` (``torch.distributed.fsdp.fully_shard`` per decoder layer + root).

Each rank reads torchrun's environment and joins the default process group (gloo on CPU, nccl on CUDA);
``train.batch_size`` is the global batch, rank r training on its rows of each global batch; rank 0 alone writes
the results. The semantics and the collectives each method issues per step are in docs/distributed-collectives.md.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from experiments.checkpoint.dcp import DistCheckpointer
from experiments.config import ModelConfig
from experiments.dist import meta_init
from experiments.dist.checks import check_launch, resolve_backend
from experiments.dist.comm import CommCounter, GradAverager, MIB, StepBytes, row_sparse_names
from experiments.errors import UserError
from experiments.models import build_model, model_source
from hmt_core.int8_weights import is_phantom
from hmt_core.optim.sharded import ShardedEngine, rank_from_root

GIB = 2**30


@dataclass
class DistContext:
    """This process's place in the job, and the reductions the loop needs."""

    mode: str
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    lowrank_comm: bool = False  # dist.lowrank_comm: per-layer hmt reduces Ĝ between refreshes
    comm: CommCounter | None = None  # bytes handed to collectives (experiments.dist.comm), installed by setup
    mesh: object | None = None  # fsdp2's DeviceMesh (None: fully_shard builds the default one)
    refresh: str = "gather"  # dist.refresh: fsdp2 + hmt basis refresh, "gather" | "sketch" (hmt_core.optim.sharded)
    bucket_mb: float = 25.0  # dist.bucket_mb: ddp + per-layer hmt's gradient buckets (experiments.dist.comm)

    def __post_init__(self) -> None:
        self.step_bytes = StepBytes(self.comm) if self.comm is not None else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _control(self):
        """The loop's own collectives are counted apart from gradient traffic."""
        return self.counted_as("control")

    def counted_as(self, scope: str):
        """Collectives inside are counted under ``scope`` (``experiments.dist.comm``), not as training traffic."""
        return self.comm.scope(scope) if self.comm is not None else contextlib.nullcontext()

    def barrier(self) -> None:
        dist.barrier()

    def count_step(self) -> None:
        """The loop calls it once per step: how ``comm/grad_bytes_per_step`` counts steps (host only)."""
        if self.step_bytes is not None:
            self.step_bytes.step()

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of ``values`` (1-D: each rank's loss figures, whose mean is the global batch's), on
        the device: one all-reduce, no host read (the loop reads the result with its other values)."""
        t = values.detach().to(self.device, torch.float64, copy=True)
        with self._control():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.div_(self.world_size)

    def any_rank(self, value: bool) -> bool:
        flag = torch.tensor([float(value)], device=self.device)
        with self._control():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def gather_floats(self, value: float) -> list[float]:
        """Every rank's ``value`` (a logged step's figure): a fill kernel, not a host-to-device copy, and one read."""
        t = torch.full((1,), float(value), dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        with self._control():
            dist.all_gather(out, t)
        return torch.cat(out).tolist()

    def memory_metrics(self, peak_bytes: float) -> dict[str, float]:
        """The per-rank figures of a logged step: peak memory over ranks, and (counted) gradient bytes per step
        since the previous logged step (``comm/grad_bytes_per_step``, ``comm/grad(MiB)``)."""
        peaks = self.gather_floats(peak_bytes)
        out = {"memory/peak_max(GiB)": max(peaks) / GIB, "memory/peak_mean(GiB)": sum(peaks) / len(peaks) / GIB}
        if self.step_bytes is not None:
            out.update(self.step_bytes.metrics())
        return out

    def max_int(self, value: int) -> int:
        """The largest of the ranks' ``value`` (e.g. the start-up peak bytes)."""
        return int(max(self.gather_floats(value)))

    def memory_summary(self, peak_bytes: int) -> dict:
        peaks = [int(p) for p in self.gather_floats(peak_bytes)]
        return {"peak_bytes_by_rank": peaks, "peak_max_bytes": max(peaks), "peak_mean_bytes": sum(peaks) // len(peaks)}

    def summary(self) -> dict:
        out = {"mode": self.mode, "world_size": self.world_size, "backend": self.backend,
               "batch_semantics": "global", "device": str(self.device), "lowrank_comm": self.lowrank_comm,
               "refresh": self.refresh}
        if self.step_bytes is not None:
            out["comm"] = self.step_bytes.summary()
        return out


# ---- launch ------------------------------------------------------------------------------------------------
def setup(run, device: torch.device) -> DistContext | None:
    """Validate the launch, then join the process group (None for ``dist=none``)."""
    check_launch(run, device)
    if run.dist.mode == "none":
        return None
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    backend = resolve_backend(run.dist.backend, device)
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=run.dist.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return DistContext(mode=run.dist.mode, rank=rank, world_size=world, local_rank=local, backend=backend,
                       device=device, lowrank_comm=run.dist.lowrank_comm, comm=CommCounter().install(),
                       refresh=run.dist.refresh, bucket_mb=run.dist.bucket_mb)


def teardown(ctx: DistContext | None) -> None:
    if ctx is not None and ctx.comm is not None:
        ctx.comm.uninstall()
    if ctx is not None:
        release_process_groups()


def release_process_groups() -> None:
    """Destroys the process groups and collects what still holds them (DDP reducers and FSDP2 states sit in
    reference cycles), so gloo's worker threads are joined now, while the interpreter is alive. Left to the
    interpreter's final collection, a worker thread that drops the last reference to a collective's tensor needs
    the GIL during finalization and aborts the process (SIGABRT, "terminate called without an active exception")
    after a run that succeeded."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


@contextlib.contextmanager
def rank_zero_first(ctx: DistContext | None):
    """Rank 0 runs the body first (it builds the token cache and tokenizer), the others after it (cache hits)."""
    if ctx is None:
        yield
        return
    if not ctx.is_main:
        ctx.barrier()
    yield
    if ctx.is_main:
        ctx.barrier()


def for_rank(train_cfg, ctx: DistContext | None):
    """The loop's train config on this rank: progress bar on rank 0 only."""
    return train_cfg if ctx is None or ctx.is_main else replace(train_cfg, progress=False)


# ---- data --------------------------------------------------------------------------------------------------
class RankShard:
    """This rank's rows of every global batch of a ``PackedTokens`` stream (validation batches are whole)."""

    def __init__(self, tokens, rank: int, world_size: int) -> None:
        if tokens.batch_size % world_size:
            raise ValueError(f"batch size {tokens.batch_size} not divisible by world size {world_size}")
        self.tokens, self.rank, self.world_size = tokens, rank, world_size
        self.rows = tokens.batch_size // world_size

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int) -> torch.Tensor:  # -> (batch_size / world_size, seq_len) int64
        return self.tokens.batch(step)[self.rank * self.rows:(self.rank + 1) * self.rows]

    def fixed_batches(self, count: int) -> list[torch.Tensor]:
        return self.tokens.fixed_batches(count)


def shard_corpus(corpus, ctx: DistContext | None):
    if ctx is None:
        return corpus
    return replace(corpus, train=RankShard(corpus.train, ctx.rank, ctx.world_size))


# ---- model -------------------------------------------------------------------------------------------------
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the longest ``nn.ModuleList`` in the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def shard_model(model: nn.Module, ctx: DistContext | None, *, build: meta_init.BuildRecord | None = None) -> nn.Module:
    """``dist=fsdp2``: ``fully_shard`` each decoder layer, then the root (embeddings, final norm, lm_head), with the
    weights computed in their own dtype and the gradients reduce-scattered in fp32 (``reduce_dtype``: a bf16 model's
    unit gradients are copied into an fp32 reduce-scatter input, summed and averaged in fp32, then cast back). A model
    built on meta (``build``: its recorded RNG draws, ``experiments.dist.meta_init``) then gets its shards on
    ``ctx.device`` (``to_empty``) filled with the single-process values, torchtitan's order."""
    if ctx is None or ctx.mode != "fsdp2":
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)  # weights as they are; gradients summed in fp32
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=ctx.mesh, mp_policy=policy)
    fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    if any(p.device.type == "meta" for p in model.parameters()):
        model.to_empty(device=ctx.device)
        if build is not None:
            meta_init.replay(model, build, ctx.device)
    return model


def prepared(method, model: nn.Module) -> nn.Module:
    """``method.prepare(model)``; a ``ValueError`` (the method's settings do not fit this model: qlora's
    ``target_modules`` matching nothing, ...) is the user's input and says so in one line."""
    try:
        return method.prepare(model)
    except ValueError as e:
        raise UserError(str(e)) from None


def build_sharded(cfg: ModelConfig, method, ctx: DistContext | None, *, vocab_size: int | None,
                  device: torch.device, values: bool = True) -> nn.Module:
    """The model to train, prepared by ``method`` and sharded as ``ctx`` says. ``dist=fsdp2`` with random init
    (no weights at ``model.path``): built on meta and initialised shard by shard (start-up peak: this rank's
    shards + one module at full size; ``values=False``, a dry run's fake tensors: the shards are left empty);
    otherwise built whole on ``device`` (FSDP2 from weights: loaded whole, then sharded)."""
    if ctx is None or ctx.mode != "fsdp2" or model_source(cfg) == "weights":
        return shard_model(prepared(method, build_model(cfg, vocab_size=vocab_size, device=device)), ctx)
    if not values:
        return shard_model(prepared(method, build_model(cfg, vocab_size=vocab_size, device="meta")), ctx)
    try:
        model, record = meta_init.record_build(lambda: build_model(cfg, vocab_size=vocab_size, device="meta"))
        return shard_model(prepared(method, model), ctx, build=record)
    except meta_init.UnreplayableInit as e:
        raise UserError(f"dist=fsdp2 cannot start this model on the meta device: {e}; use dist=ddp") from None


@contextlib.contextmanager
def dryrun_context(run):
    """``mode=dryrun`` with ``dist=ddp|fsdp2``: rank 0's ``DistContext`` in one process. Joins PyTorch's fake
    process group (``world_size=dist.world_size``: collectives return at once, tensors keep their shapes), unless
    a group already exists (a real multi-process trace, which is how the fake figures are validated). The FSDP2
    mesh is built here, before the caller enters ``FakeTensorMode`` (``DeviceMesh`` reads values)."""
    if run.dist.mode == "none":
        yield None
        return
    own = not dist.is_initialized()
    if own:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=run.dist.world_size)
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        if run.dist.world_size is not None and world != run.dist.world_size:
            raise UserError(f"dist.world_size={run.dist.world_size} but the process group has {world} ranks")
        mesh = None
        if run.dist.mode == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
        yield DistContext(mode=run.dist.mode, rank=rank, world_size=world, local_rank=rank,
                          backend=dist.get_backend(), device=torch.device("cpu"), mesh=mesh, refresh=run.dist.refresh,
                          bucket_mb=run.dist.bucket_mb)
    finally:
        if own:
            dist.destroy_process_group()


def wrap_for_forward(model: nn.Module, method, ctx: DistContext | None, *, init_sync: bool = True,
                     rebuild_buckets: bool = True) -> nn.Module:
    """The module the loop calls forward on. ``ddp``: a ``DistributedDataParallel`` wrapper, except for per-layer
    HMT, whose engine all-reduces each gradient in its own hook (see the module docstring). ``init_sync=False``
    (a dry run on fake tensors, which have no values to compare or broadcast): skip the initial broadcast of
    rank 0's weights, an in-place copy that allocates nothing. ``rebuild_buckets=False`` (the dry run, on real
    and fake tensors alike): keep the construction-time gradient buckets; DDP's re-bucketing in the second forward
    reads bucket indices that a fake tensor has no values for. ``fsdp2`` + hmt: the model itself; the sharded
    engine is told ``dist.refresh``."""
    if ctx is not None and ctx.mode == "fsdp2" and ctx.refresh != "gather":
        engine = getattr(method, "engine", None)
        if not isinstance(engine, ShardedEngine):  # check_launch refuses it first; a direct caller gets a message
            raise ValueError(f"dist.refresh={ctx.refresh} needs method=hmt on FSDP2 shards (its sharded engine)")
        engine.refresh_mode = ctx.refresh
    if ctx is None or ctx.mode != "ddp":
        return model
    engine = getattr(method, "engine", None)  # hmt with per_layer=true
    setup_scope = ctx.comm.scope("setup") if ctx.comm is not None else contextlib.nullcontext()
    if engine is not None:
        if init_sync:
            with setup_scope:
                broadcast_module(model)
        sparse = row_sparse_names(model) if ctx.backend == "gloo" else frozenset()  # NCCL: no sparse all-reduce
        engine.opt.agree_rank = rank_from_root()  # one rank decision for every process (lowrank_comm's shapes)
        engine.reduce_grad = GradAverager(ctx.world_size, lowrank=ctx.lowrank_comm, row_sparse=sparse,
                                          bucket_bytes=int(ctx.bucket_mb * MIB))
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


def checkpointer_class(ctx: DistContext | None, single):
    """``single`` (``experiments.checkpoint.manager.Checkpointer``) or, under torchrun, the DCP one."""
    if ctx is None:
        return single
    import functools

    return functools.partial(DistCheckpointer, ctx=ctx)


# ---- results -----------------------------------------------------------------------------------------------
class NullRunDir:
    """Ranks other than 0 write nothing: the same interface as ``experiments.results.RunDir``, doing nothing."""

    def __init__(self, run_dir) -> None:
        self.path, self.run_id = run_dir.path, run_dir.run_id

    def start(self, config: dict, *, keep_metrics_before: int | None = None) -> None: ...

    def set_status(self, status: str) -> None: ...

    def log(self, metrics: dict) -> None: ...

    def flush(self) -> None: ...

    def finish(self, summary: dict) -> None: ...

    def preempt(self) -> None: ...

    def fail(self, message: str) -> None: ...


def rank_run_dir(run_dir, ctx: DistContext | None):
    return run_dir if ctx is None or ctx.is_main else NullRunDir(run_dir)


def is_peer_failure(error: BaseException, ctx: DistContext | None) -> bool:
    """A collective failed because another rank died or hung (gloo: connection closed; nccl: DistBackendError)."""
    if ctx is None:
        return False
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "Timed out", "timed out",
        "Broken pipe", "ProcessGroup"))


def peer_failure_message(error: BaseException, ctx: DistContext, last_checkpoint: str | None) -> str:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return (f"rank {ctx.rank} of {ctx.world_size}: a collective failed, another rank died or hung ({first}); "
            f"last checkpoint: {last_checkpoint or 'none written'}; the same torchrun command resumes from it")
