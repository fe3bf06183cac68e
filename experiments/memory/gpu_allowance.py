"""What a CUDA training run holds on its GPU beside the live tensors the dry run traces: a typed allowance, one line
per item, each with its bytes and the source it comes from (the sources and the reasoning are in
``docs/gpu-memory-model.md``).

Two kinds of line:

- *replayed* lines are allocations torch makes through the caching allocator (cuBLAS/cuBLASLt workspaces): they
  are fed to ``experiments.memory.allocator_model.replay`` as a prelude on their stream, so they land in the predicted
  ``max_memory_reserved`` with the allocator's rounding;
- the other lines are memory outside the replayed pool: the CUDA context with the kernels and libraries a step
  loads (measured on an H200), NCCL's communication buffers, and the cached pools of side streams (FSDP2's all-gather and
  reduce-scatter streams, the basis cache's copy stream), bounded by what those streams allocate.

The dry run judges "fits on an N GiB GPU" as ``predicted reserved + outside lines <= N GiB``
(``experiments.dryrun``); the planner budgets with the same lines (``reserve_gib``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.fsdp import FSDPModule

from experiments.memory.allocator_model import AllocEvent, replay
from experiments.config import GPU_ARCHS, RunConfig

GIB = 2**30

# The CUDA context and the kernels and libraries a training step loads (cuBLAS/cuBLASLt, cuSOLVER, Triton modules),
# outside the caching allocator, measured: NVML "used" minus torch.cuda.max_memory_reserved at the end of a run, the
# most of 14 runs on an H200 (torch 2.11.0+cu130, driver 580.159.04; 1.449-1.562 GiB, the idle device at 0 MiB;
# results/gpu/nvidia-h200-2026-11-26*). The estimate it replaces (the largest published bare context, 426 MiB, plus
# a bound of torch's lazily loaded kernels, 362 MiB) was 0.77 GiB: half of it. No other generation has been measured;
# they use this figure as their bound.
_OUTSIDE_MEASURED_BYTES = 1_677_590_528
_OUTSIDE_SOURCE = ("measured on an H200, torch 2.11.0+cu130: NVML used - max_memory_reserved, most of 14 runs "
                   "(results/gpu/nvidia-h200-2026-11-26*)")
# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: ":4096:2:16:8" (2 x 4096 KiB + 8 x 16 KiB),
# 32 MiB ("4096 * 8 * 1024") for compute capability 9.x-12.x; parseCUDABlasLtWorkspaceSize: 1024 KiB.
_CUBLAS_WORKSPACE = {"ampere": 4096 * 1024 * 2 + 16 * 1024 * 8, "ada": 4096 * 1024 * 2 + 16 * 1024 * 8,
                     "hopper": 4096 * 8 * 1024, "blackwell": 4096 * 8 * 1024}
_CUBLASLT_WORKSPACE = 1024 * 1024
# NCCL src/init.cc: DEFAULT_BUFFSIZE (Simple) 1 << 22, DEFAULT_LL128_BUFFSIZE 120*640*8*8, DEFAULT_LL_BUFFSIZE
# 8*512*8*16 bytes per connection and channel.
_NCCL_PROTOCOL_BYTES = (1 << 22) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
_CUBLAS_SRC = "aten/src/ATen/cuda/CublasHandlePool.cpp"


@dataclass(frozen=True, kw_only=True)
class AllowanceLine:
    name: str
    bytes: int
    source: str
    replayed: bool = False  # allocated through the caching allocator: part of the replay's predicted reserved
    stream: int = 0  # the stream whose pool a replayed line is allocated from

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "source": self.source, "replayed": self.replayed,
                "stream": self.stream}


@dataclass(frozen=True, kw_only=True)
class GpuTarget:
    """The CUDA run a dry run stands for: the GPU generation and what the run adds streams and buffers for."""

    arch: str = "hopper"
    world_size: int = 1
    dist_mode: str | None = None  # None, "ddp" or "fsdp2"
    gemm_threads: int = 2  # threads issuing GEMMs on the compute stream: the main thread + autograd's device thread
    fsdp_unit_bytes: int = 0  # the largest fully_shard unit's unsharded parameter bytes (fsdp2)
    fsdp_unit_reduce_bytes: int | None = None  # its fp32 reduce-scatter input (reduce_dtype); None: as the weights
    basis_cache_device_bytes: int = 0  # peak device bytes the basis cache held (method.offload_bases=true)
    nccl_channels: int = 32  # NCCL's MAXCHANNELS: an upper bound on the channels it opens per communicator

    def __post_init__(self) -> None:
        if self.arch not in GPU_ARCHS:
            raise ValueError(f"dryrun.gpu_arch must be one of {', '.join(GPU_ARCHS)}, got {self.arch!r}")


@dataclass(frozen=True, kw_only=True)
class GpuAllowance:
    lines: tuple[AllowanceLine, ...]

    @property
    def outside_bytes(self) -> int:
        """Bytes of the lines not replayed (added on top of the predicted reserved)."""
        return sum(line.bytes for line in self.lines if not line.replayed)

    @property
    def replayed_bytes(self) -> int:
        return sum(line.bytes for line in self.lines if line.replayed)

    def prelude(self) -> tuple[tuple[int, int], ...]:
        """The replayed lines as ``experiments.memory.allocator_model.replay``'s prelude: ``(bytes, stream)``."""
        return tuple((line.bytes, line.stream) for line in self.lines if line.replayed)

    def to_dict(self) -> dict:
        return {"lines": [line.to_dict() for line in self.lines], "outside_bytes": self.outside_bytes,
                "replayed_bytes": self.replayed_bytes}


def allowance_for(target: GpuTarget) -> GpuAllowance:
    source = _OUTSIDE_SOURCE if target.arch == "hopper" else f"no {target.arch} measurement: Hopper's, {_OUTSIDE_SOURCE}"
    lines = [AllowanceLine(name="CUDA context and the kernels and libraries a step loads", bytes=_OUTSIDE_MEASURED_BYTES,
                           source=source)]
    for thread in range(target.gemm_threads):
        who = "main thread" if thread == 0 else "autograd device thread"
        lines.append(AllowanceLine(name=f"cuBLAS workspace ({who}, compute stream)",
                                   bytes=_CUBLAS_WORKSPACE[target.arch], replayed=True,
                                   source=f"{_CUBLAS_SRC}: parseChosenWorkspaceSize, one per (handle, stream)"))
        lines.append(AllowanceLine(name=f"cuBLASLt workspace ({who}, compute stream)", bytes=_CUBLASLT_WORKSPACE,
                                   replayed=True, source=f"{_CUBLAS_SRC}: parseCUDABlasLtWorkspaceSize (1024 KiB)"))
    if target.world_size > 1 and target.dist_mode is not None:
        lines.append(AllowanceLine(
            name=f"NCCL buffers ({target.nccl_channels} channels x ring connection, Simple + LL128 + LL)",
            bytes=target.nccl_channels * _NCCL_PROTOCOL_BYTES,
            source="NCCL src/init.cc DEFAULT_BUFFSIZE/DEFAULT_LL128_BUFFSIZE/DEFAULT_LL_BUFFSIZE; NCCL_BUFFSIZE "
                   "(docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)"))
    if target.dist_mode == "fsdp2" and target.world_size > 1:
        lines.append(AllowanceLine(
            name="FSDP2 all-gather + reduce-scatter stream pools (bound: 2 units unsharded + 1 unit's fp32 "
                 "reduce-scatter input)",
            bytes=2 * target.fsdp_unit_bytes + (target.fsdp_unit_bytes if target.fsdp_unit_reduce_bytes is None
                                                else target.fsdp_unit_reduce_bytes),
            source="torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: all-gather output (current + "
                   "prefetched unit) and reduce-scatter input (reduce_dtype=fp32, experiments.dist.parallel."
                   "shard_model) allocated on their own streams"))
    if target.basis_cache_device_bytes:
        lines.append(AllowanceLine(
            name="basis-cache copy stream pool (bound: its peak device bytes)", bytes=target.basis_cache_device_bytes,
            source="hmt_core/basis_cache.py: prefetches allocated on a side stream (cache/device_bytes_peak)"))
    return GpuAllowance(lines=tuple(lines))


def fsdp_unit_bytes(model) -> int:
    """The largest ``fully_shard`` unit's unsharded parameter bytes (a DTensor's ``numel`` is its global size): the
    parameters a unit manages are its own less those of the units nested in it. 0 for a model without units."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    best = 0
    for unit in units:
        nested = {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)
                  for p in sub.parameters()}
        best = max(best, sum(p.numel() * p.element_size() for p in unit.parameters() if id(p) not in nested))
    return best


def fsdp_unit_reduce_bytes(model) -> int:
    """The largest ``fully_shard`` unit's reduce-scatter input: its unsharded parameters' elements in fp32 (the
    ``reduce_dtype`` of ``experiments.dist.parallel.shard_model``). 0 for a model without units."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    best = 0
    for unit in units:
        nested = {id(p) for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)
                  for p in sub.parameters()}
        best = max(best, sum(p.numel() * 4 for p in unit.parameters() if id(p) not in nested))
    return best


def modeled_verdicts(event_logs: list[list[AllocEvent]], allowance: GpuAllowance, sizes_gib: tuple[int, ...], *,
                     expandable_segments: bool = False) -> dict:
    """Replay each meter's event log (the step's, the activation probe's) with the allowance's replayed lines as
    prelude; a GPU of N GiB fits when the larger predicted reserved peak plus the lines outside the replay is at
    most N GiB, or, failing that, when a replay capped at N GiB less those lines never runs out of memory (the
    allocator releases its cached free segments and retries before it fails)."""
    prelude, ex = allowance.prelude(), expandable_segments
    replays = [replay(log, prelude=prelude, expandable_segments=ex) for log in event_logs if log]
    best = max(replays, key=lambda r: r.peak_reserved_bytes)
    verdicts = {}
    for size in sizes_gib:
        capacity = size * GIB - allowance.outside_bytes
        peak = best.peak_reserved_bytes
        if peak > capacity:  # the allocator would release its cached free segments and retry before failing
            capped = [replay(log, prelude=prelude, capacity_bytes=capacity, expandable_segments=ex)
                      for log in event_logs if log]
            if all(r.oom_tick is None for r in capped):
                peak = max(r.peak_reserved_bytes for r in capped)
        verdicts[f"{size}GiB"] = {"fits": peak <= capacity, "headroom_bytes": int(capacity - peak)}
    return {"predicted": best.to_dict(), "verdicts": verdicts}


def target_of(run: RunConfig, *, dist: dict | None = None, fsdp_unit: int = 0, fsdp_reduce: int | None = None,
              basis_cache_bytes: int = 0) -> GpuTarget:
    """The GPU run ``run`` stands for: ``dist`` is a dry run's traced ``{"mode", "world_size"}`` (default: from
    ``run.dist``, as the planner knows it before any trace)."""
    if dist is None and run.dist.mode != "none":
        dist = {"mode": run.dist.mode, "world_size": run.dist.world_size or 1}
    return GpuTarget(arch=run.dryrun.gpu_arch, world_size=dist["world_size"] if dist else 1,
                     dist_mode=dist["mode"] if dist else None, fsdp_unit_bytes=fsdp_unit,
                     fsdp_unit_reduce_bytes=fsdp_reduce, basis_cache_device_bytes=basis_cache_bytes)


def reserve_bytes(run: RunConfig) -> int:
    """What a budget keeps off the step's bytes (``step_bytes``): ``dryrun.reserve=flat``: ``cuda_context_gib``;
    ``modeled``: the allowance lines (outside and replayed) of the run as known before a trace."""
    if run.dryrun.reserve == "flat":
        return int(run.dryrun.cuda_context_gib * GIB)
    allowance = allowance_for(target_of(run))
    return allowance.outside_bytes + allowance.replayed_bytes


def outside_allocator_bytes(run: RunConfig) -> int:
    """The part of ``reserve_bytes(run)`` the caching allocator never holds (context, libraries, NCCL): what a
    per-process memory fraction does not cap. ``flat``: all of ``cuda_context_gib``."""
    if run.dryrun.reserve == "flat":
        return reserve_bytes(run)
    return allowance_for(target_of(run)).outside_bytes


def step_bytes(dryrun_summary: dict, run: RunConfig) -> int:
    """A dry run's bytes to hold against ``budget − reserve_bytes(run)``, so that it fits exactly when the dry run's
    own verdict for a ``budget`` GPU says so: ``flat``: the live verdict peak; ``modeled``: predicted reserved + the
    lines outside the replay − ``reserve_bytes(run)`` (the allocator's slack beyond the live bytes stays in)."""
    d = dryrun_summary
    if d.get("reserve", "flat") == "flat":
        return int(d["verdict_peak_bytes"])
    return int(d["predicted"]["peak_reserved_bytes"] + d["allowance"]["outside_bytes"] - reserve_bytes(run))


def reserve_label(run: RunConfig) -> str:
    if run.dryrun.reserve == "flat":
        return f"dryrun.cuda_context_gib={run.dryrun.cuda_context_gib:g}"
    return f"GPU allowance ({run.dryrun.gpu_arch}, docs/gpu-memory-model.md)"


def allowance_of_trace(run: RunConfig, traced: dict) -> GpuAllowance:
    """The allowance for a traced run (``experiments.dryrun.trace_steps``'s result): its process group, its
    largest FSDP2 unit and the basis cache's device peak as traced."""
    cache = int(traced["method_summary"].get("cache/device_bytes_peak", 0))
    return allowance_for(target_of(run, dist=traced["dist"], fsdp_unit=traced["fsdp_unit_bytes"],
                                   fsdp_reduce=traced.get("fsdp_unit_reduce_bytes"), basis_cache_bytes=cache))


def traced_step_bytes(run: RunConfig, traced: dict) -> int:
    """``step_bytes`` of a dry run's summary, computed from the trace itself (the planner's capacity traces)."""
    live = max(traced["report"].peak_bytes, traced["probe_peak_bytes"] or 0)
    if run.dryrun.reserve == "flat":
        return int(live)
    allowance = allowance_of_trace(run, traced)
    predicted = modeled_verdicts(traced["alloc_events"], allowance, (),
                                 expandable_segments=run.dryrun.expandable_segments)["predicted"]
    return int(predicted["peak_reserved_bytes"] + allowance.outside_bytes - reserve_bytes(run))
