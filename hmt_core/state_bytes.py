"""Optimizer-state bytes a method holds, by device: the figures every ``Method.summary`` reports
(``optim/state_bytes``, ``optim/state_device_bytes``, ``optim/state_host_bytes``) and the memory meter's device test.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def iter_state_tensors(state: Any) -> Iterator[torch.Tensor]:
    """All tensors inside a (nested) optimizer-state structure."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from iter_state_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from iter_state_tensors(value)
    else:  # objects such as galore-torch's projectors keep tensors as attributes
        attrs = getattr(state, "__dict__", None)
        if attrs:
            yield from iter_state_tensors(attrs)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds for ``t``: a DTensor's local shard (its ``numel`` is the global one)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def same_device(device: torch.device, target: torch.device) -> bool:
    """``device`` is ``target``, or of its type when ``target`` names no index ("cuda" matches "cuda:0")."""
    return device.type == target.type and target.index in (None, device.index)


def state_bytes_summary(tensors: Iterable[torch.Tensor], device: torch.device | None) -> dict[str, int]:
    """A method's optimizer-state keys, bytes this process holds (``local_bytes``): ``optim/state_device_bytes``
    on the training ``device``, ``optim/state_host_bytes`` on every other device (the host: HMT's parked bases,
    ``method.offload_bases=true``), and ``optim/state_bytes``, the device figure (what must fit on the
    accelerator). ``device=None``, or a CPU run, where host and device are one memory: all of it is device."""
    on_device = host = 0
    for t in tensors:
        n = local_bytes(t)
        if device is None or same_device(t.device, device):  # a DTensor's device is its local shard's
            on_device += n
        else:
            host += n
    return {"optim/state_bytes": on_device, "optim/state_device_bytes": on_device, "optim/state_host_bytes": host}
