"""The `Method` seam: what a training method does to a model and to its optimization.

The training loop (``experiments.loop``) asks a method exactly these things and nothing else:

1. ``prepare(model)``: what it does to the model before training (quantize, add adapters, wrap modules);
   returns the module to train.
2. ``attach(model, max_grad_norm=...)``: build its optimizer and/or the hooks that update parameters inside
   backward. After ``attach`` a call to ``loss.backward()`` followed by ``step()`` performs one update, whether
   the update happens in ``step`` (ordinary optimizer) or inside backward (per-layer hooks): the loop does
   not care which.
3. ``set_parallel(context)`` (multi-process only; one process is world size 1, the state ``attach`` leaves): the
   job's ``hmt_core.parallel.ParallelContext``. The method takes what it uses (a gradient reducer it runs inside
   backward, a rank agreement, a refresh mode) and says whether it reduces the gradients itself; nothing outside
   a method reaches into its optimizer or engine.
4. ``metrics()`` / ``summary()``: what it reports, as flat dicts whose keys carry units
   (``optim/grad_norm``, ``rank/mean``), and ``state_tensors()`` so the memory meter can attribute optimizer
   state bytes.
5. Its capabilities, which the harness reads instead of asking which method it is: ``shrinks_weights`` and
   ``prepare_reads_values`` (how the model may be built before ``prepare``: on meta, sharded first),
   ``row_shard_slots()`` (which state a distributed checkpoint writes as row shards), ``materialize_weights()``
   (what it does before the weights are saved).

Every method has one frozen keyword-only dataclass ``Config`` (``MethodConfig``: its name, learning rate, whether
it steps FSDP2 shards, and the checks of its settings against the rest of the run); the one name -> Config and
name -> factory registry is ``experiments.methods``. Gradient clipping belongs to the method because a method that updates inside
backward must decide how (or whether) a *global* norm can be applied; ``step`` returns the pre-clip global
gradient norm when it computes one, as a device tensor.

Non-finite gradients: ``step`` itself leaves the weights and optimizer state as they were (and returns a non-finite
norm), on the device where the optimizer can (HMT's engine, torch's fused AdamW), else after one host read of the
norm. The loop seeds a non-finite loss's backward with NaN, so a non-finite loss reaches ``step`` as non-finite
gradients (``experiments.loop.train_step``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from hmt_core.parallel import ParallelContext


@runtime_checkable
class Method(Protocol):
    name: str

    def prepare(self, model: nn.Module, *, device: torch.device | None = None,
                materialize: Callable[[nn.Module], None] | None = None) -> nn.Module:
        """Transform the freshly built model (e.g. quantize + LoRA). Returns the module to train, on ``device`` when
        given (a model built elsewhere: moved as it is transformed), else where it was built. ``materialize`` (with
        ``device``; a model built on meta): makes and initialises one module's own tensors on ``device``; called on
        every module before its values are read."""
        ...

    def attach(self, model: nn.Module, *, max_grad_norm: float | None) -> None:
        """Create optimizer state / per-parameter hooks for the trainable parameters of ``model``."""
        ...

    def set_parallel(self, context: ParallelContext) -> bool:
        """After ``attach``: the job's parallel context. Returns True when the method takes charge of
        ``context.reduce_grad`` (it averages the gradients across ranks itself, inside backward: the caller must not
        wrap the model in DDP), False when the caller's wrapper (DDP, FSDP2) reduces them (under FSDP2 a method may
        still use ``context.reduce_grad`` for the parameters FSDP2 leaves whole on every rank). A context the method
        cannot honour (``refresh_mode="sketch"`` without row-sharded weights, ...) is a ``ValueError``."""
        ...

    def start_micro_batch(self, index: int, count: int) -> None:
        """Called before the backward of micro-batch ``index`` of ``count`` (gradient accumulation)."""
        ...

    def step(self) -> torch.Tensor | None:
        """Finish one optimizer step after the last micro-batch's backward. Returns the pre-clip global grad norm
        as a 0-dim fp32 tensor on the model's device (never a Python float: the caller reads it to the host only on
        a logging step), non-finite if non-finite gradients made the step a no-op, or None if it computes none."""
        ...

    def zero_grad(self) -> None: ...

    def set_lr_scale(self, scale: float) -> None:
        """Multiply every parameter group's base learning rate by ``scale`` (the loop's LR schedule)."""
        ...

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of optimizer state (moments, projection bases, quantization maps)."""
        ...

    def metrics(self) -> dict[str, float]:
        """Per-step scalars for metrics.jsonl; keys carry units."""
        ...

    def summary(self) -> dict[str, Any]:
        """Method-specific entries for summary.json (rank distribution, compression error, ...)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def torch_optimizer(self) -> torch.optim.Optimizer | None:
        """The ``torch.optim.Optimizer`` that holds all of this method's state, its base learning rates included
        (each group's ``initial_lr``, as torch's LR schedulers keep them), or None. A distributed checkpoint can
        then save and reshard it by ``torch.distributed.checkpoint.state_dict``; otherwise ``state_dict``."""
        ...

    @property
    def shrinks_weights(self) -> bool:
        """``prepare`` stores the weights in fewer bytes (INT8): a model whose full-precision weights exceed the
        device is built elsewhere (meta, or the host) and reaches the device through ``prepare(model, device=...)``."""
        ...

    @property
    def prepare_reads_values(self) -> bool:
        """``prepare`` reads the weights' values (INT8 tables quantized from them): the model is built with values
        and prepared before it is sharded, never started on meta and sharded first."""
        ...

    def row_shard_slots(self) -> list[Any] | None:
        """Under FSDP2: the slots whose moments are row shards of their parameters, which a distributed checkpoint
        writes rank by rank (``hmt_core.optim.sharded_state``); None when ``state_dict`` is one whole dict."""
        ...

    def materialize_weights(self) -> None:
        """Bring every weight up to date before it is read whole (saving the model); a no-op for most methods."""
        ...


class MethodConfig(Protocol):
    """A method's frozen ``Config``: what the harness asks of it before any model exists."""

    name: str
    lr: float
    fsdp2: ClassVar[bool]  # its optimizer steps FSDP2's sharded parameters (dist=fsdp2)

    def check(self, run: Any) -> None:
        """A ``ValueError`` naming the keys when these settings clash with the rest of the run (``run``: the
        harness's run config, its ``train`` and ``dist`` sections)."""
        ...

    def dist_error(self, dist: Any) -> str | None:
        """Why these settings cannot run under ``dist`` (its ``mode``, ``refresh``, ``lowrank_comm``), naming the
        keys; None when they can. Asked of a method that ``fsdp2`` allows under ``dist=fsdp2``."""
        ...


class NotTraceableError(RuntimeError):
    """Raised by a method whose code cannot run on FakeTensorMode's shape-only tensors (``mode=dryrun``): the dry
    run then records the method as untraceable instead of reporting a wrong number."""


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def named_trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
