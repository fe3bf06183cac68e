"""The fake-CUDA tier's tools: ``device="cuda"`` fake tensors under ``FakeTensorMode`` on a machine without a GPU
(the CUDA build of torch; docs/testing.md, "fake-CUDA tier"), and what stands in for what needs the CUDA driver.

Under FakeTensorMode a CUDA tensor has a device, a shape and a dtype but no storage, and a host copy stays a CPU
tensor, so placement and bytes per device are what a CUDA run has. ``backward()`` cannot run here (autograd's
engine asks the CUDA driver for a context): ``fire_backward`` leaves what backward leaves behind by hand — every
trainable parameter's ``.grad`` (accumulated as autograd does), then its post-accumulate-grad hooks in reverse
parameter order. Used by tests/test_fake_cuda.py (placement) and ``benchmarks.host_device_memory --fake-cuda``
(device and host bytes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.dryrun import AssumedScalars


class Stream:
    """Stands in for a ``torch.cuda.Stream`` / ``Event`` (creating one needs the CUDA driver)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


@contextlib.contextmanager
def driver_stand_ins() -> Iterator[None]:
    """What needs the CUDA driver itself and has no fake implementation, replaced while inside: a seeded
    ``torch.Generator(device="cuda")`` (HMT's and apollo-torch's random projections) becomes a CPU generator (a
    fake ``randn`` ignores the generator's state, so the traced shapes, dtypes and devices are the same), and side
    streams, events and ``torch.cuda.synchronize`` (HMT's basis prefetch, bitsandbytes' step) become no-ops. The
    real objects run in the CUDA smoke tests (tests/test_cuda_smoke.py)."""
    real = torch.Generator

    class HostGenerator(real):
        def __new__(cls, device="cpu"):
            return real("cpu")

    patches = [(torch, "Generator", HostGenerator), (torch.cuda, "Stream", Stream), (torch.cuda, "Event", Stream),
               (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
               (torch.cuda, "current_stream", lambda device=None: Stream()),
               (torch.cuda, "synchronize", lambda device=None: None),  # bitsandbytes' per-step sync
               (torch.Tensor, "record_stream", lambda self, stream: None)]
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """Tensors created inside are fake. No default device is set: a tensor the code creates without an explicit
    device lands on the CPU. ``AssumedScalars`` (the dry run's) answers third-party ``.item()`` calls on fake
    values (bitsandbytes' optimizers); ``mode.assumed`` lists where it was asked (HMT's own code must not need it)."""
    assumed = AssumedScalars()
    with FakeTensorMode() as mode, assumed:
        mode.assumed = assumed.sites
        yield mode


def fire_backward(model: nn.Module) -> None:
    """What backward leaves behind, by hand: each trainable parameter's gradient accumulated into ``.grad``
    (in place when one exists, like autograd), then its post-accumulate-grad hooks, last parameter first."""
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        g = torch.randn(p.shape, dtype=p.dtype, device=p.device)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
        for hook in list((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
            hook(p)
