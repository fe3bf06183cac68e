"""Bookkeeping shared by methods that update through an ordinary ``torch.optim.Optimizer`` step.

``OptimizerDriver`` clips the global gradient norm, steps, zeroes gradients, applies the loop's LR scale to
every group's base LR, and lists the optimizer's state tensors for the memory meter. ``OptimizerMethod`` is the
whole ``Method`` built on it from a baseline's ``prepare``/``build`` functions (composition, no inheritance).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from hmt_core.state_bytes import iter_state_tensors, state_bytes_summary


OPTIMIZER_IMPLS = ("fused", "foreach", "single")
IMPL_KEYS = ("fused", "foreach")  # torch.optim group options that choose the kernels


def torch_optimizer_impl(impl: str) -> dict[str, bool]:
    """``fused``/``foreach`` keyword arguments that pin a ``torch.optim`` optimizer's implementation to ``impl``.

    torch's default (``foreach=None``) picks by the tensors' type and device: multi-tensor kernels for real CUDA
    tensors, single-tensor loops on CPU and for any tensor subclass (FakeTensor included), so a dry run would trace
    another path than the CUDA run executes (docs/dryrun-cuda.md). ``fused``: one kernel per parameter group and
    dtype (CUDA and CPU); ``foreach``: multi-tensor ops (``_foreach_sqrt`` makes a transient copy of every second
    moment); ``single``: one parameter at a time."""
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer impl must be one of {OPTIMIZER_IMPLS}, got {impl!r}")
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


def clip_foreach(params: list[torch.Tensor]) -> bool:
    """``clip_grad_norm_``'s ``foreach``, explicit and decided by device: multi-tensor norms on CUDA (torch's choice
    there), per-tensor elsewhere (torch refuses ``foreach=True`` on CPU tensors, fake ones included, so a dry run
    traces the per-tensor path; both allocate one 0-d norm per gradient and scale the gradients in place)."""
    return bool(params) and all(p.is_cuda for p in params)


def _plain_tensors_replicated(params: list[torch.Tensor]):
    """Around a step of DTensor parameters (FSDP2's shards): DTensor's ``implicit_replication``, so a reference
    optimizer's own plain tensors (apollo-torch's seeded projection matrices, drawn identically on every rank)
    count as replicated; otherwise nothing."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in params):
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()
    return contextlib.nullcontext()


def device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips a step on the device: torch's Adam/AdamW with every group ``fused`` (their kernels
    take ``found_inf``; the foreach and single-tensor paths refuse it)."""
    return isinstance(optimizer, torch.optim.Adam) and all(g.get("fused") for g in optimizer.param_groups)


def _replicated(norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_``'s result as a plain tensor: a DTensor (FSDP2's sharded gradients) is all-reduced."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def restore_base_lrs(optimizer: torch.optim.Optimizer, base_lrs: list[float] | None) -> None:
    """Each group's ``initial_lr`` from ``base_lrs``, a checkpoint written before the groups carried it (which kept
    them beside the optimizer's state); None: the loaded groups carry their own."""
    if base_lrs is not None:
        for group, base in zip(optimizer.param_groups, base_lrs):
            group["initial_lr"] = base


def dist_error(name: str, dist: Any, *, fsdp2_refusal: str | None = None) -> str | None:
    """Why baseline ``name`` cannot run under ``dist`` (``hmt_core.method.MethodConfig.dist_error``): ``torch.optim``
    steps after backward, on gradients the caller's wrapper (DDP, FSDP2) has reduced, so it has no basis to refresh
    on shards (``dist.refresh``) and no gradient to project before the all-reduce (``dist.lowrank_comm``);
    ``fsdp2_refusal``: why its options cannot step FSDP2's shards (None: they can)."""
    if dist.refresh != "gather":
        return (f"dist.refresh={dist.refresh} needs method=hmt with method.basis=rsvd (got method={name}): the "
                "distributed sketch is the randomized SVD's; use dist.refresh=gather")
    if dist.mode == "fsdp2" and fsdp2_refusal is not None:
        return fsdp2_refusal
    if dist.lowrank_comm:
        return (f"dist.lowrank_comm=true needs method=hmt with per_layer=true and mode=A (got {name}): only "
                "per-layer Mode A projects a gradient before it is reduced")
    return None


class OptimizerDriver:
    def __init__(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None) -> None:
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        for group in optimizer.param_groups:  # the base rate, where torch's LR schedulers keep it: saved with
            group.setdefault("initial_lr", group["lr"])  # the groups (state_dict, DCP's get_optimizer_state_dict)

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self) -> torch.Tensor | None:
        """Clip to ``max_grad_norm``, then update unless the gradients are not finite. Returns the pre-clip global
        gradient norm, a 0-dim fp32 tensor on the gradients' device (non-finite: the step was skipped).

        The skip is decided on the device where the optimizer can take it there: torch's fused Adam/AdamW read
        ``optimizer.found_inf`` (as ``torch.amp.GradScaler`` hands it over) and leave weights, moments and step
        counters untouched when it is 1. Every other optimizer (AdamW foreach/single, ``PrecisionAdamW``,
        bitsandbytes, galore-torch, apollo-torch) has no such input: the decision costs one host read of the norm
        per step (docs/command_line.md, "A run that diverges")."""
        params = [p for p in self.params() if p.grad is not None]
        if not params:
            with _plain_tensors_replicated(params):
                self.optimizer.step()
            return None
        limit = self.max_grad_norm if self.max_grad_norm else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, limit, foreach=clip_foreach(params))
        norm = _replicated(norm).float()  # () fp32; FSDP2: the global norm on every rank
        with _plain_tensors_replicated(params):
            if device_skip(self.optimizer):
                self.optimizer.found_inf = torch.isfinite(norm).logical_not().float()  # () fp32, GradScaler's form
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.found_inf
            elif is_fake(norm) or bool(torch.isfinite(norm)):  # the one host sync (a fake tensor has no value)
                self.optimizer.step()
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr_scale(self, scale: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * scale

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from iter_state_tensors(self.optimizer.state)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}  # base rates: each group's initial_lr

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # torch restores every saved group option, the kernel choice too, and places each ``step`` counter by the
        # saved options (on the device for fused/capturable, else on the host): the run's choice (method.impl) is
        # written into the saved groups before loading, so a checkpoint written before the choice was explicit
        # (foreach=None) resumes with this run's kernels and its counters where those kernels need them
        saved, run = state["optimizer"], {k: self.optimizer.defaults[k] for k in IMPL_KEYS
                                          if k in self.optimizer.defaults}
        groups = [{**group, **run} for group in saved["param_groups"]]
        self.optimizer.load_state_dict({**saved, "param_groups": groups})
        restore_base_lrs(self.optimizer, state.get("base_lrs"))


class Built(NamedTuple):
    """What a baseline's build function returns: its optimizer and what it reports about it."""

    optimizer: torch.optim.Optimizer
    summary: dict[str, Any] = {}
    metrics: dict[str, float] = {}


class OptimizerMethod:
    """A whole ``Method`` for methods that update through one ``torch.optim`` step (the baselines).

    Composed from two functions — ``prepare(model) -> model`` and ``build(model) -> Built`` — so each baseline
    module holds only what is its own: its ``Config``, how it changes the model, which optimizer it builds.
    """

    def __init__(self, name: str, *, build: Callable[[nn.Module], Built],
                 prepare: Callable[[nn.Module], nn.Module] | None = None) -> None:
        self.name = name
        self._build = build
        self._prepare = prepare
        self.driver: OptimizerDriver | None = None
        self.built: Built | None = None
        self.device: torch.device | None = None  # the training device (the model's at attach)

    def prepare(self, model: nn.Module, *, device: torch.device | None = None,
                materialize: Callable[[nn.Module], None] | None = None) -> nn.Module:
        if materialize is not None:
            for module in model.modules():
                materialize(module)
        model = self._prepare(model) if self._prepare else model
        return model if device is None else model.to(device)

    def attach(self, model: nn.Module, *, max_grad_norm: float | None) -> None:
        self.device = next((p.device for p in model.parameters()), None)
        self.built = self._build(model)
        self.driver = OptimizerDriver(self.built.optimizer, max_grad_norm=max_grad_norm)

    def set_parallel(self, context: ParallelContext) -> bool:
        """Nothing to take: ``torch.optim`` steps after backward, on gradients the caller's wrapper (DDP, FSDP2)
        has reduced (False)."""
        if context.refresh_mode != "gather":
            raise ValueError(f"dist.refresh={context.refresh_mode} needs method=hmt on FSDP2 shards "
                             "(its sharded engine)")
        return False

    def start_micro_batch(self, index: int, count: int) -> None:
        pass  # gradients accumulate in .grad; the optimizer steps once after the last micro-batch

    def step(self) -> torch.Tensor | None:
        return self.driver.step()

    def zero_grad(self) -> None:
        self.driver.zero_grad()

    def set_lr_scale(self, scale: float) -> None:
        self.driver.set_lr_scale(scale)

    def state_tensors(self) -> Iterator[torch.Tensor]:
        return self.driver.state_tensors()

    def metrics(self) -> dict[str, float]:
        return dict(self.built.metrics) if self.built else {}

    def summary(self) -> dict[str, Any]:
        if self.built is None:
            return {}
        return {**self.built.summary, **state_bytes_summary(self.state_tensors(), self.device)}  # per rank (FSDP2)

    def torch_optimizer(self) -> torch.optim.Optimizer | None:
        return self.driver.optimizer if self.driver is not None else None

    shrinks_weights = False  # hmt_core.method.Method's capabilities: the weights keep their dtype,
    prepare_reads_values = False  # a model on meta can be sharded before prepare,

    def row_shard_slots(self) -> None:
        return None  # its state is the optimizer's (DCP shards torch AdamW's with the weights),

    def materialize_weights(self) -> None:
        pass  # and every weight is current after each step

    def state_dict(self) -> dict[str, Any]:
        return self.driver.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.driver.load_state_dict(state)
