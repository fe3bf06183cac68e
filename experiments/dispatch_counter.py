"""Dispatch counter: host syncs, ATen ops by phase and collectives of a training step, counted by a
TorchDispatchMode.

Every ATen op dispatched while the counter is active is seen once (``__torch_dispatch__``), on any device, so a
CPU run counts what a CUDA run would launch and where it would wait:

- **host syncs**: ops whose result the host must wait for, or that carry host data to the device —
  ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``), ``aten.nonzero``,
  ``aten.masked_select``, ``aten.unique*``, ``aten.equal``, ``aten.index``/``index_put`` with a bool index
  (boolean-mask indexing), ``aten.lift_fresh``/``lift_fresh_copy`` (a tensor built from host data,
  ``torch.tensor(list)``) and ``aten._to_copy``/``copy_`` from the CPU to another device (host-to-device). Each is
  recorded with the ``file:line`` of the first project frame on the Python stack (``sync_sites``), so a test that
  expects none names the culprit;
- **ATen ops by phase** (a kernel-launch proxy): every op except pure metadata queries (``METADATA_OPS``, the memory
  meter's list) and view ops (``OpOverload.is_view``: ``view``, ``t``, ``transpose``, ``expand``, ``select``,
  ``slice``, ``detach``, ...; they launch no kernel), which are counted apart (``view_ops``). The phase is set with
  ``with counter.phase(name):`` (the memory meter's phases); ops outside any phase are counted under ``other``;
- **collectives**: ``c10d`` ops (what ``torch.distributed.all_reduce``/``reduce_scatter_tensor``/
  ``all_gather_into_tensor``/``broadcast`` dispatch, with their ``async_op`` flag from the op's arguments) and
  functional collectives (``_c10d_functional``, always asynchronous until ``wait_tensor``), each with its op name,
  the bytes of this rank's input tensors and ``async``.

The counter records only while ``counting`` is true (default), so one mode can stay entered through warm-up steps
and count one chosen step (``benchmarks.step_profile``). Results: ``report()`` (a ``DispatchCounts``).
Measurements: ``docs/step_profile.md``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from experiments.meter import _METADATA_OPS

METADATA_OPS = frozenset(_METADATA_OPS)
OTHER_PHASE = "other"  # ops outside any ``phase(...)``

_aten = torch.ops.aten
_SYNC_PACKETS = {  # always a host sync: the host needs the result's value or size
    _aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten.equal, _aten.unique_dim,
    _aten._unique, _aten._unique2, _aten.unique_consecutive, _aten.lift_fresh, _aten.lift_fresh_copy,
}
_INDEX_PACKETS = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}
_COPY_PACKETS = {_aten._to_copy, _aten.copy_}
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS_FILE = os.path.abspath(__file__)


@dataclass(frozen=True, kw_only=True)
class Collective:
    op: str  # e.g. "c10d.allreduce_", "_c10d_functional.all_reduce"
    bytes: int  # this rank's input tensors
    async_op: bool

    def to_dict(self) -> dict:
        return {"op": self.op, "bytes": self.bytes, "async": self.async_op}


@dataclass(frozen=True, kw_only=True)
class DispatchCounts:
    host_syncs: int
    sync_ops: dict[str, int]  # ATen op -> count
    sync_sites: dict[str, int]  # "path:line" of the first project frame -> count
    aten_ops: dict[str, int]  # phase -> ops (views and metadata queries excluded)
    view_ops: dict[str, int]  # phase -> view ops
    op_names: dict[str, dict[str, int]]  # phase -> ATen op -> count
    collectives: list[Collective] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"host_syncs": self.host_syncs, "sync_ops": dict(self.sync_ops),
                "sync_sites": dict(self.sync_sites), "aten_ops": dict(self.aten_ops),
                "view_ops": dict(self.view_ops), "collectives": [c.to_dict() for c in self.collectives]}


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _device_type(t) -> str | None:
    return t.device.type if isinstance(t, torch.Tensor) else None


def is_host_sync(func, args, kwargs, out) -> bool:
    """Whether one dispatched op makes the host wait for the device or carries host data to it."""
    packet = func.overloadpacket
    if packet in _SYNC_PACKETS:
        return True
    if packet in _INDEX_PACKETS:
        return _has_bool_index(args)
    if packet in _COPY_PACKETS:  # host-to-device: from the CPU to another device
        src, dst = (args[1], args[0]) if packet is _aten.copy_ else (args[0], out)
        return _device_type(src) == "cpu" and _device_type(dst) not in (None, "cpu", "meta")
    return False


def first_project_frame() -> str:
    """``path:line`` (relative to the repository) of the innermost Python frame in this project's code outside
    this module; the innermost frame outside torch when there is none (a test's own file is in the project)."""
    frame = sys._getframe(1)
    fallback = "?"
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _THIS_FILE:
            torch_code = f"{os.sep}torch{os.sep}" in path or "torch/utils/_python_dispatch" in path
            if path.startswith(_REPO_ROOT + os.sep) and not torch_code:
                return f"{os.path.relpath(path, _REPO_ROOT)}:{frame.f_lineno}"
            if fallback == "?" and not torch_code:
                fallback = f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback


def _collective(func, args, kwargs) -> Collective | None:
    namespace = func.namespace
    if namespace not in ("c10d", "_c10d_functional"):
        return None
    name = func.overloadpacket.__name__
    if namespace == "_c10d_functional" and name in ("wait_tensor",):
        return None
    schema_args = func._schema.arguments
    bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
             for i, a in enumerate(schema_args)}
    inputs = bound.get("input_tensor", bound.get("inputs", bound.get("input", bound.get("tensors"))))
    flat, _ = tree_flatten(inputs)
    nbytes = sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
    async_op = bool(bound.get("async_op", True)) if namespace == "c10d" else True
    return Collective(op=f"{namespace}.{name}", bytes=nbytes, async_op=async_op)


class DispatchCounter(TorchDispatchMode):
    """Counts host syncs, ATen ops by phase and collectives. Use ``with counter:`` around the counted code."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = True
        self._phase = OTHER_PHASE
        self._ops: dict[str, Counter] = {}
        self._views: Counter = Counter()
        self._sync_ops: Counter = Counter()
        self._sync_sites: Counter = Counter()
        self._collectives: list[Collective] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def reset(self) -> None:
        """Forget everything counted so far (the mode may stay entered)."""
        self._ops.clear()
        self._views.clear()
        self._sync_ops.clear()
        self._sync_sites.clear()
        self._collectives.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.counting and func not in METADATA_OPS:
            self._count(func, args, kwargs, out)
        return out

    def _count(self, func, args, kwargs, out) -> None:
        if is_host_sync(func, args, kwargs, out):  # before the view test: lift_fresh is an alias op
            self._sync_ops[str(func.overloadpacket)] += 1
            self._sync_sites[first_project_frame()] += 1
        if func.is_view:
            self._views[self._phase] += 1
            return
        self._ops.setdefault(self._phase, Counter())[str(func.overloadpacket)] += 1
        collective = _collective(func, args, kwargs)
        if collective is not None:
            self._collectives.append(collective)

    def report(self) -> DispatchCounts:
        return DispatchCounts(
            host_syncs=sum(self._sync_ops.values()), sync_ops=dict(self._sync_ops),
            sync_sites=dict(self._sync_sites.most_common()),
            aten_ops={p: sum(c.values()) for p, c in self._ops.items()}, view_ops=dict(self._views),
            op_names={p: dict(c.most_common()) for p, c in self._ops.items()}, collectives=list(self._collectives))
