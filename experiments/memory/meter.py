"""Memory meter: live tensor bytes by category, measured by a TorchDispatchMode.

Every tensor produced by an ATen op while the meter is active is registered by its *storage* (views share a
storage and are counted once); a weakref finalizer on the storage marks its release. The meter therefore
measures what is really alive, on any device, with real tensors (source ``tracker``) or shape-only fake tensors
under ``FakeTensorMode`` (source ``fake``). On CUDA the allocator's own peaks are recorded beside it
(``experiments.memory.gpu_stats``).

Categories (``CATEGORIES``):
- ``params``/``other``: tensors registered with ``track`` before the step (weights, buffers, input batches);
- ``activations``: tensors born in the forward phase and still alive when forward ends (saved for backward);
  forward-born tensors freed before then are ``temp``;
- ``grads``: ``.grad`` tensors of parameters (``watch_grads`` hooks mark them when accumulated);
- ``optimizer``: tensors the method lists as its state (``mark``) — moments, projection bases;
- ``temp``: everything else born during backward or the optimizer step (e.g. SVD workspace).

Categories are assigned *after the fact*: a storage created as ``temp`` during the first optimizer step and
later marked ``optimizer`` is counted as ``optimizer`` at the peak too, because the peak is kept as a time
(op index) and summed at report time over the storages alive then. Time-averaged bytes are averaged over
dispatched ops (op ticks), which is deterministic and equal for real and fake runs.

Device and host are counted apart (``MemoryMeter(device=...)``, the training device): a storage on that device
counts toward ``peak_bytes`` and the other device figures (what must fit on the accelerator), a storage on any
other device — in practice the host: HMT's parked bases (``method.offload_bases=true``), ``offload_cpu``
activations, refresh copies — toward the ``host_*`` figures, with its own peak, categories and phases. A
storage's device is its tensor's (a fake tensor's fake device, not its meta storage's), so a dry run with fake
CUDA tensors and a real run split alike. ``device=None`` (and a CPU run, where host and device are one memory)
counts everything as device. Design notes: ``docs/memory.md``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from experiments.memory.report import CATEGORIES, PHASES, SPACES, MemoryReport, PeakWindow, Record, Space
from hmt_core import streaming
from hmt_core.state_bytes import iter_state_tensors, same_device

_METADATA_OPS = {
    torch.ops.prim.device.default,
    torch.ops.prim.layout.default,
    torch.ops.aten.sym_size.default,
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.default,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format,
    torch.ops.aten.dim.default,
}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor`` (FSDP2's sharded parameters, their gradients and AdamW state) is a wrapper whose storage
    reports the *global* size; what this rank holds is its local shard (``_local_tensor``)."""
    while hasattr(t, "_local_tensor") and isinstance(t._local_tensor, torch.Tensor):
        t = t._local_tensor
    return t


def _storages(tensors: Iterable[torch.Tensor], *, skip_meta: bool = True
              ) -> Iterator[tuple[torch.UntypedStorage, torch.device]]:
    """Each tensor's storage with the tensor's device (a fake tensor's storage is a meta storage; its tensor
    reports the device it stands in for)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = _local(t)
            if skip_meta and t.device.type == "meta":  # a shape without memory (a model built on meta, before
                # to_empty); kept where the meter's own device is meta (the tests' stand-in for a second device)
                continue
            try:
                yield t.untyped_storage(), t.device
            except (NotImplementedError, RuntimeError):  # sparse / nested / wrapper tensors without storage
                continue


class MemoryMeter(TorchDispatchMode):
    """Categorized live-tensor-bytes tracker. Use ``with meter:`` around the measured steps."""

    def __init__(self, *, source: str = "tracker", device: torch.device | str | None = None,
                 cap_bytes: int | None = None) -> None:
        super().__init__()
        self.source = source
        # live training-device bytes allowed (``train.memory_cap_gib``): beyond them the meter raises
        # torch.OutOfMemoryError, standing in for a smaller device (checked wherever the meter sees memory grow)
        self.cap_bytes = cap_bytes
        self.device = None if device is None else torch.device(device)
        self._skip_meta = self.device is None or self.device.type != "meta"
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._live: dict[int, Record] = {}  # id(record) -> record, for storages still alive
        self._tick = 0
        self._phase: str | None = None
        self._spaces = {space: Space() for space in SPACES}
        self._start_tick: int | None = None
        self._in_op = False
        self.host_device_bytes = 0
        self._grad_hooks: list = []
        self._models: weakref.WeakSet = weakref.WeakSet()  # track_model's: their streamed weights' host copies
        # every allocation and free in order: (tick, +bytes / -bytes, storage serial, device), for
        # experiments.memory.allocator_model's replay of the CUDA caching allocator
        self.events: list[tuple[int, int, int, str]] = []

    # ---- registration -------------------------------------------------------------------------------
    def track(self, tensors: Iterable[torch.Tensor], category: str, *, space: str | None = None) -> None:
        """Register already-existing tensors (weights, buffers, batches) under ``category`` (``space``: "host" for
        a copy held off the device whatever its tensor's device, as a streamed weight's host copy)."""
        self._tick += 1
        for storage, device in _storages(tensors, skip_meta=self._skip_meta):
            self._register(storage, category, device, space=space)
        self._update_peaks()

    def track_model(self, model: torch.nn.Module) -> None:
        """Register a model before its step: weights and their quantization state (bitsandbytes' ``quant_state``)
        as ``params``, buffers as ``other``."""
        self.track(model.parameters(), "params")
        self.track(iter_state_tensors([getattr(p, "quant_state", None) for p in model.parameters()]), "params")
        self.track(model.buffers(), "other")
        self._models.add(model)

    def mark(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """(Re)classify tensors, registering them if unseen (e.g. optimizer state after a step)."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; expected one of {CATEGORIES}")
        self._tick += 1
        for storage, device in _storages(tensors, skip_meta=self._skip_meta):
            record = self._records.get(storage)
            if record is None:
                self._register(storage, category, device)
            else:
                record.category = category
        self._update_peaks()

    def watch_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Mark each parameter's gradient as ``grads`` the moment it is accumulated.

        Register this before a method's own post-accumulate hooks so the mark happens before an in-backward
        update frees the gradient.
        """
        for p in params:
            if p.requires_grad:
                self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.mark([p.grad], "grads")

    def remove_hooks(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()

    def space_of(self, device: torch.device) -> str:
        """"device" for the training device (any index when it names none), "host" for every other device."""
        return "device" if self.device is None or same_device(device, self.device) else "host"

    def _register(self, storage: torch.UntypedStorage, category: str, device: torch.device, *,
                  space: str | None = None) -> Record:
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; expected one of {CATEGORIES}")
        record = self._records.get(storage)
        if record is not None:
            return record
        record = Record(nbytes=int(storage.nbytes()), category=category, born=self._tick, phase=self._phase,
                         space=space or self.space_of(device), serial=len(self.events), device=str(device))
        if record.space == "device":  # the allocator model replays what the training device's allocator sees
            self.events.append((self._tick, record.nbytes, record.serial, record.device))
        self._records[storage] = record
        self._live[id(record)] = record
        self._spaces[record.space].total += record.nbytes
        weakref.finalize(storage, self._release, record)
        return record

    def _release(self, record: Record) -> None:
        if record.died is not None:
            return
        # alive through the current tick unless released inside the op that defines it
        record.died = self._tick if self._in_op else self._tick + 1
        self._live.pop(id(record), None)
        space = self._spaces[record.space]
        space.total -= record.nbytes
        if record.space == "device":
            self.events.append((self._tick, -record.nbytes, record.serial, record.device))
        start = self._start_tick if self._start_tick is not None else 0
        space.avg_accum[record.category] += record.nbytes * max(0, record.died - max(record.born, start))
        for window in space.windows.values():
            if record.born <= window.tick < record.died:
                window.died_after_peak.append(record)

    # ---- phases -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; expected one of {PHASES}")
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            if name == "forward":  # forward-born tensors still alive are what forward saved for backward
                for record in self._live.values():
                    if record.phase == "forward" and record.category == "temp":
                        record.category = "activations"
            self._phase = previous

    def storage_resized(self, storage: torch.UntypedStorage, device: torch.device, category: str | None = None) -> None:
        """A storage resized in place outside ATen (``UntypedStorage.resize_``): its old size is released and a
        non-empty new size registered as a new allocation of the same category. ``device``: its tensor's."""
        self._tick += 1
        old = self._records.get(storage)
        if old is not None:
            del self._records[storage]
            self._release(old)
        if storage.nbytes() > 0:
            self._register(storage, category or (old.category if old is not None else "temp"), device)
        self._update_peaks()

    @contextlib.contextmanager
    def _fsdp_storage_resizes(self) -> Iterator[None]:
        """FSDP2 frees each all-gathered (unsharded) weight after use by ``storage.resize_(0)`` and regrows it
        for the next gather (``torch.distributed.fsdp._fully_shard._fsdp_param.free_storage`` /
        ``alloc_storage``): no ATen op dispatches, and the storage object lives on, so neither the dispatch mode
        nor the weakref finalizer would see the free. While metering, those two functions report to
        ``storage_resized``."""
        import sys

        param_mod = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param")
        group_mod = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param_group")
        if param_mod is None:
            yield
            return
        free, alloc = param_mod.free_storage, param_mod.alloc_storage

        def metered(resize):
            def call(tensor: torch.Tensor) -> None:
                before = tensor.untyped_storage().nbytes()
                resize(tensor)
                if tensor.untyped_storage().nbytes() != before:
                    self.storage_resized(tensor.untyped_storage(), tensor.device)
            return call

        patched = [(param_mod, "free_storage", free), (param_mod, "alloc_storage", alloc)]
        if group_mod is not None and getattr(group_mod, "alloc_storage", None) is alloc:
            patched.append((group_mod, "alloc_storage", alloc))
        for module, name, original in patched:
            setattr(module, name, metered(original))
        try:
            yield
        finally:
            for module, name, original in patched:
                setattr(module, name, original)

    # ---- dispatch -----------------------------------------------------------------------------------
    def __enter__(self):
        if self._start_tick is None:
            self._start_tick = self._tick
        self._resizes = self._fsdp_storage_resizes()
        self._resizes.__enter__()
        self._catch_up()
        self._streamed = streaming.observe_resizes(lambda s, device: self.storage_resized(s, device, "params"))
        self._streamed.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._streamed.__exit__(None, None, None)
            self._resizes.__exit__(None, None, None)

    def _catch_up(self) -> None:
        """Weight streaming (``hmt_core.streaming``) between metered windows: storages resized while the meter was
        not watching (the streamer frees its weights at ``attach``, after ``track_model``) take their size now, and
        the streamed weights' host copies are host ``params``."""
        for storage, record in list(self._records.items()):
            if record.died is None and storage.nbytes() != record.nbytes:
                self.storage_resized(storage, torch.device(record.device))
        for model in list(self._models):
            self.track(streaming.host_tensors(model), "params", space="host")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_OPS:  # fake tensors route metadata queries through dispatch; they allocate nothing
            return func(*args, **kwargs)
        self._tick += 1
        self._in_op = True
        try:
            out = func(*args, **kwargs)
        finally:
            self._in_op = False
        self._count_device_moves(func, args, kwargs, out)
        flat_out, _ = tree_flatten(out)
        for storage, device in _storages(flat_out, skip_meta=self._skip_meta):
            if storage not in self._records:
                self._register(storage, "temp", device)
        self._update_peaks()
        return out

    def _count_device_moves(self, func, args, kwargs, out) -> None:
        if func not in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            return
        src = args[1] if func is torch.ops.aten.copy_.default else args[0]
        dst = args[0] if func is torch.ops.aten.copy_.default else out
        if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device != dst.device:
            self.host_device_bytes += src.numel() * src.element_size()

    def _update_peaks(self) -> None:
        for space in self._spaces.values():
            for key in ("all", self._phase):
                window = space.windows.get(key) if key else None
                if window is not None and space.total > window.bytes:
                    window.bytes, window.tick = space.total, self._tick
                    window.died_after_peak.clear()
        live = self._spaces["device"].total
        if self.cap_bytes is not None and live > self.cap_bytes:  # the peak above already counts this total
            raise torch.OutOfMemoryError(f"memory cap exceeded: {live:,} live bytes on the device > cap "
                                         f"{self.cap_bytes:,} bytes (train.memory_cap_gib)")

    # ---- reporting ----------------------------------------------------------------------------------
    def _by_category_at(self, space: str, window: PeakWindow) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        if window.tick < 0:
            return out
        live = [r for r in self._live.values() if r.space == space]
        for record in live + window.died_after_peak:
            if record.born <= window.tick and (record.died is None or window.tick < record.died):
                out[record.category] += record.nbytes
        return out

    def current_bytes(self) -> int:
        """Live bytes on the training device."""
        return self._spaces["device"].total

    def _space_figures(self, name: str) -> dict:
        """Peak, averages (over op ticks since the meter was first entered) and current bytes of one space."""
        space = self._spaces[name]
        start = self._start_tick if self._start_tick is not None else 0
        span = max(1, self._tick - start)
        accum = dict(space.avg_accum)
        current = dict.fromkeys(CATEGORIES, 0)
        for record in self._live.values():
            if record.space == name:
                accum[record.category] += record.nbytes * max(0, self._tick - max(record.born, start))
                current[record.category] += record.nbytes
        return {"peak_bytes": max(0, space.windows["all"].bytes), "avg_bytes": sum(accum.values()) // span,
                "peak_by_category_bytes": self._by_category_at(name, space.windows["all"]),
                "avg_by_category_bytes": {k: v // span for k, v in accum.items()},
                "peak_by_phase_bytes": {p: max(0, space.windows[p].bytes) for p in PHASES},
                "peak_by_phase_category_bytes": {p: self._by_category_at(name, space.windows[p]) for p in PHASES},
                "current_by_category_bytes": current}

    def report(self) -> MemoryReport:
        dev, host = self._space_figures("device"), self._space_figures("host")
        del host["peak_by_phase_category_bytes"]
        return MemoryReport(source=self.source, device=None if self.device is None else str(self.device), **dev,
                            host_device_bytes=self.host_device_bytes, **{f"host_{k}": v for k, v in host.items()})


class StartupPeak:
    """The peak bytes of the start-up (``with StartupPeak(device) as s:`` around building, sharding and
    initialising the model; then ``s.peak_bytes``): on CUDA the allocator's ``max_memory_allocated`` (reset on
    entry), elsewhere a ``MemoryMeter``'s live tensor bytes (tensors born inside the block)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes: int | None = None
        self._meter = None if device.type == "cuda" else MemoryMeter(source="tracker")

    def __enter__(self) -> StartupPeak:
        if self._meter is None:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._meter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._meter is None:
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        self._meter.__exit__(*exc)
        self.peak_bytes = self._meter.report().peak_bytes
