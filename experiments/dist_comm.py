"""Gradient communication for multi-process training: the per-layer HMT reducer (full or low-rank) and a byte
counter wrapped around the collectives.

Low-rank gradient communication (``dist.lowrank_comm=true``, per-layer HMT Mode A under ``dist=ddp``): GaLore's
projection ``R_t = P_tᵀ G_t`` (Zhao et al. 2024, Eq. 2) is linear, so with a basis P that is identical on every
rank, ``mean_k Pᵀ G_k = Pᵀ mean_k G_k``: each rank projects its *local* gradient and only the r × n projection is
all-reduced instead of the m × n gradient (the idea of PowerSGD, Vogels et al. 2019, with GaLore's basis in place
of a power-iteration one). Refreshes still all-reduce the full gradient (the basis is computed from it); see
``hmt_core.optim.hooks``.

Bytes communicated are counted by wrapping ``torch.distributed``'s collective functions (the ones the harness,
HMT's reducer and DDP's default comm hook call) and by a DDP comm hook that counts each bucket, then runs PyTorch's
default ``allreduce_hook`` uncounted (so a bucket is counted once). A count is the *payload*: the bytes of the
tensor handed to the collective (all-reduce, broadcast: the tensor; all-gather: the gathered output; reduce-scatter:
the input), not the bytes on the wire (a ring all-reduce sends ≈ 2(W−1)/W of the payload per rank). Each count goes
to the current scope: ``grad`` (the default: gradient traffic), ``control`` (the loop's loss mean, finite flag and
memory gather), ``setup`` (the initial parameter broadcast). FSDP2's own collectives are not counted.
"""

from __future__ import annotations

import contextlib
import functools

import torch.distributed as dist
from torch import Tensor

MIB = 2**20
COUNTED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "reduce_scatter", "all_to_all_single")


def _nbytes(t) -> int:
    if isinstance(t, Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def payload_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """The payload of one collective call (see the module docstring): its first tensor argument (output lists
    for ``all_gather``, the output tensor for ``all_gather_into_tensor``, the input for reduce-scatter)."""
    if name == "reduce_scatter_tensor":
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input"))
    if name == "reduce_scatter":
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("input_list"))
    return _nbytes(args[0] if args else next(iter(kwargs.values()), None))


class CommCounter:
    """Bytes handed to collectives, by scope; ``install`` wraps ``torch.distributed``'s functions until
    ``uninstall``. One per process."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {"grad": 0, "control": 0, "setup": 0}
        self.calls: dict[str, int] = {k: 0 for k in self.bytes}
        self._scope: str | None = "grad"
        self._originals: dict[str, object] = {}

    # ---- scopes
    @contextlib.contextmanager
    def scope(self, name: str | None):
        """Count what runs inside under ``name`` (None: not at all)."""
        before, self._scope = self._scope, name
        try:
            yield
        finally:
            self._scope = before

    def add(self, nbytes: int) -> None:
        if self._scope is not None:
            self.bytes[self._scope] = self.bytes.get(self._scope, 0) + int(nbytes)
            self.calls[self._scope] = self.calls.get(self._scope, 0) + 1

    # ---- wrapping torch.distributed
    def install(self) -> CommCounter:
        for name in COUNTED:
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals = {}

    def _wrap(self, name: str, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.add(payload_bytes(name, args, kwargs))
            return original(*args, **kwargs)

        return counted

    # ---- DDP
    def ddp_hook(self, state, bucket):  # bucket: dist.GradBucket -> Future[Tensor] (DDP checks real annotations)
        """DDP comm hook: count the bucket, then PyTorch's default (divide by W, all-reduce SUM) uncounted."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.add(_nbytes(bucket.buffer()))
        with self.scope(None):
            return allreduce_hook(state, bucket)

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)


class GradAverager:
    """Per-layer HMT's ``reduce_grad`` (``hmt_core.optim.hooks.GradReducer``): DDP's arithmetic, divide by W,
    then all-reduce SUM, in place — on the full gradient, or (``lowrank``) on a Mode A weight's projection."""

    def __init__(self, world_size: int, *, lowrank: bool = False) -> None:
        self.world_size, self.lowrank = world_size, lowrank

    def full(self, grad: Tensor) -> None:  # grad: (out, in) or any parameter's shape
        grad.div_(self.world_size)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)

    def projected(self, low: Tensor) -> None:  # low: Ĝ = project(G_local), (out, r) | (r, in) | (r, r) fp32
        low.div_(self.world_size)
        dist.all_reduce(low, op=dist.ReduceOp.SUM)


class StepBytes:
    """Gradient bytes per step from a counter: the loop calls ``DistContext.mean`` once per step (``step``)."""

    def __init__(self, counter: CommCounter) -> None:
        self.counter, self.steps = counter, 0
        self._mark_bytes, self._mark_steps = 0, 0

    def step(self) -> None:
        self.steps += 1

    def metrics(self) -> dict[str, float]:
        """Gradient bytes per step since the previous call (a logged step), in MiB and bytes."""
        grad, steps = self.counter.bytes["grad"], self.steps
        per = (grad - self._mark_bytes) / max(1, steps - self._mark_steps)
        self._mark_bytes, self._mark_steps = grad, steps
        return {"comm/grad_bytes_per_step": per, "comm/grad(MiB)": per / MIB}

    def summary(self) -> dict:
        c = self.counter
        return {"grad_bytes_total": c.bytes["grad"], "grad_bytes_per_step": c.bytes["grad"] // max(1, self.steps),
                "control_bytes_total": c.bytes["control"], "setup_bytes_total": c.bytes["setup"],
                "steps": self.steps, "counted": "payload bytes handed to collectives (not wire bytes)"}
