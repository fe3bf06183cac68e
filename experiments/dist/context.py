"""This process's place in a training job: ``DistContext`` (mode ``none``/``ddp``/``fsdp2``, rank, world size,
device, the collectives the loop reduces with) and the launch that builds it, torchrun's environment joined to the
default process group (gloo on CPU, nccl on CUDA). One process is world size 1 (``DistContext.single``)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from experiments.checkpoint.dcp import DistCheckpointer
from experiments.checkpoint.manager import Checkpointer
from experiments.dist.checks import check_launch, resolve_backend
from experiments.dist.comm import CommCounter, StepBytes
from experiments.errors import UserError

GIB = 2**30


@dataclass
class DistContext:
    """This process's place in the job (``mode="none"``: one process, world size 1, ``DistContext.single``), the
    reductions the loop needs, and the per-rank choices of the trainer (which corpus rows, results directory and
    checkpointer this rank gets): the one place the train path asks whether it runs alone."""

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

    @classmethod
    def single(cls, device: torch.device) -> DistContext:
        """One process (``dist=none``): world size 1, no process group."""
        return cls(mode="none", rank=0, world_size=1, local_rank=0, backend="none", device=device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mode != "none"

    @property
    def loop_sync(self) -> DistContext | None:
        """What the loop reduces its figures with (``experiments.loop.run_training``'s ``sync``): None alone."""
        return self if self.distributed else None

    def _control(self):
        """The loop's own collectives are counted apart from gradient traffic."""
        return self.counted_as("control")

    def counted_as(self, scope: str):
        """Collectives inside are counted under ``scope`` (``experiments.dist.comm``), not as training traffic."""
        return self.comm.scope(scope) if self.comm is not None else contextlib.nullcontext()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    @contextlib.contextmanager
    def rank_zero_first(self):
        """Rank 0 runs the body first (it builds the token cache and tokenizer), the others after it (cache hits)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    # ---- per-rank components ----------------------------------------------------------------------------
    def shard(self, corpus):
        """This rank's rows of each global training batch (validation batches are whole)."""
        if not self.distributed:
            return corpus
        return replace(corpus, train=RankShard(corpus.train, self.rank, self.world_size))

    def run_dir(self, run_dir):
        """Rank 0 writes the results; the others get a ``NullRunDir``."""
        return run_dir if self.is_main else NullRunDir(run_dir)

    def train_config(self, train_cfg):
        """The loop's train config on this rank: progress bar on rank 0 only."""
        return train_cfg if self.is_main else replace(train_cfg, progress=False)

    def checkpointer(self, root, **kwargs) -> Checkpointer:
        """One process: ``Checkpointer`` (torch.save); under torchrun the collective DCP one."""
        return DistCheckpointer(root, ctx=self, **kwargs) if self.distributed else Checkpointer(root, **kwargs)

    def teardown(self) -> None:
        if self.comm is not None:
            self.comm.uninstall()
        if self.distributed:
            release_process_groups()

    def is_peer_failure(self, error: BaseException) -> bool:
        """A collective failed because another rank died or hung (gloo: connection closed; nccl: DistBackendError)."""
        if not self.distributed:
            return False
        if isinstance(error, dist.DistError):
            return True
        text = str(error)
        return isinstance(error, RuntimeError) and any(s in text for s in (
            "Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "Timed out", "timed out",
            "Broken pipe", "ProcessGroup"))

    def peer_failure_message(self, error: BaseException, last_checkpoint: str | None) -> str:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        return (f"rank {self.rank} of {self.world_size}: a collective failed, another rank died or hung ({first}); "
                f"last checkpoint: {last_checkpoint or 'none written'}; the same torchrun command resumes from it")

    def count_step(self) -> None:
        """The loop calls it once per step: how ``comm/grad_bytes_per_step`` counts steps (host only)."""
        if self.step_bytes is not None:
            self.step_bytes.step()

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of ``values`` (1-D: each rank's loss figures, whose mean is the global batch's), on
        the device: one all-reduce, no host read (the loop reads the result with its other values)."""
        if not self.distributed:
            return values
        t = values.detach().to(self.device, torch.float64, copy=True)
        with self._control():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.div_(self.world_size)

    def any_rank(self, value: bool) -> bool:
        if not self.distributed:
            return value
        flag = torch.tensor([float(value)], device=self.device)
        with self._control():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def gather_floats(self, value: float) -> list[float]:
        """Every rank's ``value`` (a logged step's figure): a fill kernel, not a host-to-device copy, and one read."""
        if not self.distributed:
            return [float(value)]
        t = torch.full((1,), float(value), dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        with self._control():
            dist.all_gather(out, t)
        return torch.cat(out).tolist()

    def memory_metrics(self, peak_bytes: float) -> dict[str, float]:
        """The per-rank figures of a logged step: peak memory over ranks, and (counted) gradient bytes per step
        since the previous logged step (``comm/grad_bytes_per_step``, ``comm/grad(MiB)``)."""
        if not self.distributed:
            return {}
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

    def summary_block(self, peak_bytes: int, startup_peak_bytes: int) -> dict:
        """The summary's ``dist`` block (peaks over ranks); none for one process."""
        if not self.distributed:
            return {}
        return {"dist": {**self.summary(), **self.memory_summary(peak_bytes),
                         "startup_peak_max_bytes": self.max_int(startup_peak_bytes)}}

    def summary(self) -> dict:
        out = {"mode": self.mode, "world_size": self.world_size, "backend": self.backend,
               "batch_semantics": "global", "device": str(self.device), "lowrank_comm": self.lowrank_comm,
               "refresh": self.refresh}
        if self.step_bytes is not None:
            out["comm"] = self.step_bytes.summary()
        return out


def setup(run, device: torch.device) -> DistContext:
    """Validate the launch, then join the process group (``dist=none``: ``DistContext.single``)."""
    check_launch(run, device)
    if run.dist.mode == "none":
        return DistContext.single(device)
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
    if ctx is not None:
        ctx.teardown()


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
    return corpus if ctx is None else ctx.shard(corpus)


def for_rank(train_cfg, ctx: DistContext | None):
    """The loop's train config on this rank: progress bar on rank 0 only."""
    return train_cfg if ctx is None else ctx.train_config(train_cfg)


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

    def fail(self, message: str, *, status: str = "failed") -> None: ...
