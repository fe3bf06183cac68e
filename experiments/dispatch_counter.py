"""Dispatch counter: host syncs, ATen ops by phase and collectives of a training step, counted by a
TorchDispatchMode.

Every ATen op dispatched while the counter is active is seen once (``__torch_dispatch__``), on any device, so a
CPU run counts what a CUDA run would launch and where it would wait:

- **host syncs**: ops whose result the host must wait for, or that carry host data to the device —
  ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``, ``int(t)``), ``aten.nonzero``,
  ``aten.masked_select``, ``aten.unique*``, ``aten.equal``, ``aten.index``/``index_put`` with a bool index
  (boolean-mask indexing), ``aten.repeat_interleave`` without ``output_size``, ``aten.bincount``/``histc``,
  ``aten._linalg_check_errors`` (``torch.linalg.cholesky``/``inv``/``solve``' error check),
  ``aten.lift_fresh``/``lift_fresh_copy`` (a tensor built from host data, ``torch.tensor(list)``) and
  ``aten._to_copy``/``copy_`` between the CPU and another device (either way; never seen on a CPU run, nor
  ``tolist()``, which copies to the host without a Python-visible op on the CPU). Each is
  recorded with the ``file:line`` of the first project frame on the Python stack, and the library line under it
  (``hmt_core/fused_ce.py:229 <- transformers/masking_utils.py:761``; ``sync_sites``), so a test that expects
  none names the culprit;
- **ATen ops by phase** (a kernel-launch proxy): every op except pure metadata queries (``METADATA_OPS``, the memory
  meter's list) and view ops (``OpOverload.is_view``: ``view``, ``t``, ``transpose``, ``expand``, ``select``,
  ``slice``, ``detach``, ...; they launch no kernel), which are counted apart (``view_ops``). Host phases
  (``host_phases``, default ``data``: the loop's batch, built from host memory before it moves to the device)
  hold host tensors in a CUDA run as well: their syncs are recorded apart (``host_side_sync_sites``), not as host
  syncs; so is reading a tensor declared host-resident with ``mark_host`` (torch.optim's ``step`` counts, which
  torch keeps on the CPU unless the optimizer is fused or capturable). The phase is set with
  ``with counter.phase(name):`` or ``set_phase(name)`` (the memory meter's phases); ops outside any phase are
  counted under ``other``. Two rules follow the autograd engine: an op the engine runs (``loss.backward()``) while
  the phase is ``forward`` moves the phase on to ``backward`` (so a caller marks only where forward starts;
  ``backward()``'s seed gradient, made before the engine starts, stays in ``forward``), and
  an op the engine runs inside a method's per-parameter hook (a frame of ``hook_files`` on the stack: HMT's
  per-layer updates inside backward) counts as ``optimizer`` work;
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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from experiments.memory.meter import _METADATA_OPS

METADATA_OPS = frozenset(_METADATA_OPS)
OTHER_PHASE = "other"  # ops outside any ``phase(...)``
HOOK_FILES = ("hmt_core/optim/hooks.py",)  # HMT's per-layer updates inside backward
HOST_PHASES = ("data",)  # phases whose tensors live on the host in a CUDA run too

_aten = torch.ops.aten
_SYNC_PACKETS = {  # always a host sync: the host needs the result's value or size
    _aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten.equal, _aten.unique_dim,
    _aten._unique, _aten._unique2, _aten.unique_consecutive, _aten.lift_fresh, _aten.lift_fresh_copy,
    _aten._linalg_check_errors, _aten.bincount, _aten.histc,  # an error check / an output size read on the host
}
_INDEX_PACKETS = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}
_COPY_PACKETS = {_aten._to_copy, _aten.copy_}
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS_FILE = os.path.abspath(__file__)
_MACHINERY = tuple(os.path.join("torch", *f.split("/")) for f in (  # what torch calls a dispatch mode through
    "_compile.py", "_dynamo/eval_frame.py", "utils/_python_dispatch.py"))


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
    host_side_sync_sites: dict[str, int]  # the same, of the host phases' ops (not host syncs)
    aten_ops: dict[str, int]  # phase -> ops (views and metadata queries excluded)
    view_ops: dict[str, int]  # phase -> view ops
    op_names: dict[str, dict[str, int]]  # phase -> ATen op -> count
    collectives: list[Collective] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"host_syncs": self.host_syncs, "sync_ops": dict(self.sync_ops),
                "sync_sites": dict(self.sync_sites), "host_side_sync_sites": dict(self.host_side_sync_sites),
                "aten_ops": dict(self.aten_ops),
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
    if packet is _aten.repeat_interleave:  # the output size is read on the host unless given
        return func is not _aten.repeat_interleave.self_int and kwargs.get("output_size") is None
    if packet in _COPY_PACKETS:  # between the host and another device, either way
        src, dst = (args[1], args[0]) if packet is _aten.copy_ else (args[0], out)
        devices = {_device_type(src), _device_type(dst)}
        return "cpu" in devices and len(devices - {None, "meta"}) == 2
    return False


def _library_path(path: str) -> str:
    """A path under ``site-packages`` from the package on (``transformers/models/llama/modeling_llama.py``)."""
    marker = f"site-packages{os.sep}"
    return path.split(marker, 1)[1] if marker in path else path


def _installed(path: str) -> bool:
    """An installed package's file, even inside the repository (a ``.venv`` in the checkout, as the README's
    install makes): a library frame, never the project's."""
    return f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path


def sync_site() -> str:
    """Where a host sync comes from: ``path:line`` (relative to the repository) of the innermost Python frame in
    this project's code, followed by `` <- package/file.py:line`` when the op's caller is a library's (e.g.
    transformers', torch.optim's); the caller when no project frame is on the stack."""
    frame = sys._getframe(1)
    while frame is not None and (os.path.abspath(frame.f_code.co_filename) == _THIS_FILE
                                 or frame.f_code.co_filename.endswith(_MACHINERY)):
        frame = frame.f_back  # the mode's own frames and the wrappers torch calls it through
    library = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_REPO_ROOT + os.sep) and not _installed(path):
            site = f"{os.path.relpath(path, _REPO_ROOT)}:{frame.f_lineno}"
            return site if library is None else f"{site} <- {library}"
        library = library or f"{_library_path(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return library or "?"


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


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # wrapper subclasses without a storage
        return None


def _in_backward() -> bool:
    """Whether the autograd engine is running the current op (``loss.backward()``, its hooks included)."""
    return torch._C._current_graph_task_id() != -1


def _under(files: tuple[str, ...]) -> bool:
    """Whether a frame of ``files`` runs inside the autograd engine (between the op and the engine's entry,
    ``torch.autograd.graph._engine_run_backward``; the code that called ``backward()`` does not count)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != "_engine_run_backward":
        if frame.f_code.co_filename.endswith(files):
            return True
        frame = frame.f_back
    return False


class DispatchCounter(TorchDispatchMode):
    """Counts host syncs, ATen ops by phase and collectives. Use ``with counter:`` around the counted code.

    ``hook_files``: source files (path suffixes) whose code, run by the autograd engine, is optimizer work.
    ``host_phases``: phases whose syncs are host-side (see the module docstring)."""

    def __init__(self, *, hook_files: tuple[str, ...] = HOOK_FILES,
                 host_phases: tuple[str, ...] = HOST_PHASES) -> None:
        super().__init__()
        self.counting = True
        self.host_phases = host_phases
        self.hook_files = tuple(os.path.join(*f.split("/")) for f in hook_files)
        self._phase = OTHER_PHASE
        self._ops: dict[str, Counter] = {}
        self._views: Counter = Counter()
        self._sync_ops: Counter = Counter()
        self._sync_sites: Counter = Counter()
        self._host_side: Counter = Counter()
        self._host_storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._collectives: list[Collective] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def mark_host(self, tensors: Iterable[torch.Tensor]) -> None:
        """Declare ``tensors`` host-resident in a CUDA run too: reading their value is no host sync."""
        for t in tensors:
            storage = _storage(t)
            if storage is not None:
                self._host_storages[storage] = True

    def _host_side_read(self, func, args) -> bool:
        if func.overloadpacket is not _aten._local_scalar_dense or not isinstance(args[0], torch.Tensor):
            return False
        storage = _storage(args[0])
        return storage is not None and storage in self._host_storages

    def set_phase(self, name: str) -> None:
        """Count the following ops under ``name`` (until the next ``set_phase`` or ``phase``)."""
        self._phase = name

    def _current_phase(self) -> str:
        if self._phase in ("forward", "backward") and _in_backward():
            if self._phase == "forward":
                self._phase = "backward"
            if self.hook_files and _under(self.hook_files):
                return "optimizer"
        return self._phase

    def reset(self) -> None:
        """Forget everything counted so far (the mode may stay entered)."""
        self._ops.clear()
        self._views.clear()
        self._sync_ops.clear()
        self._sync_sites.clear()
        self._host_side.clear()
        self._collectives.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.counting and func not in METADATA_OPS:
            self._count(func, args, kwargs, out)
        return out

    def _count(self, func, args, kwargs, out) -> None:
        phase = self._current_phase()
        if is_host_sync(func, args, kwargs, out):  # before the view test: lift_fresh is an alias op
            if phase in self.host_phases or self._host_side_read(func, args):
                self._host_side[sync_site()] += 1
            else:
                self._sync_ops[str(func.overloadpacket)] += 1
                self._sync_sites[sync_site()] += 1
        if func.is_view:
            self._views[phase] += 1
            return
        self._ops.setdefault(phase, Counter())[str(func.overloadpacket)] += 1
        collective = _collective(func, args, kwargs)
        if collective is not None:
            self._collectives.append(collective)

    def report(self) -> DispatchCounts:
        return DispatchCounts(
            host_syncs=sum(self._sync_ops.values()), sync_ops=dict(self._sync_ops),
            sync_sites=dict(self._sync_sites.most_common()), host_side_sync_sites=dict(self._host_side.most_common()),
            aten_ops={p: sum(c.values()) for p, c in self._ops.items()}, view_ops=dict(self._views),
            op_names={p: dict(c.most_common()) for p, c in self._ops.items()}, collectives=list(self._collectives))
