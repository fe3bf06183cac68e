"""Host-memory cache for HMT's projection bases (``method.offload_bases=true``): between its uses (the projection in
the backward hook, the update) a basis is parked in host memory and fetched just in time, the next layer's
prefetched in backward order on a side CUDA stream; host memory is bounded (previous bases evicted least-recently
used first). Design notes and the statistics: docs/design/hmt_core_notes.md."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from hmt_core.projection import Basis


def basis_bytes(b: Basis | None) -> int:
    if b is None:
        return 0
    return sum(t.numel() * t.element_size() for t in b if t is not None)


def _orthonormal_columns(b: Basis) -> list[Tensor]:
    out = []
    if b.left is not None:
        out.append(torch.linalg.qr(b.left.float()).Q)  # (out, r)
    if b.right is not None:
        out.append(torch.linalg.qr(b.right.float().t()).Q)  # (in, r)
    return out


def subspace_drift(old: Basis, new: Basis) -> float:
    """1 − ‖Q_oldᵀ Q_new‖_F² / min(r_old, r_new), averaged over sides: 0 = same subspace, 1 = orthogonal."""
    drifts = []
    for qo, qn in zip(_orthonormal_columns(old), _orthonormal_columns(new)):
        overlap = float(torch.linalg.matrix_norm(qo.t() @ qn) ** 2)
        drifts.append(1.0 - overlap / min(qo.shape[1], qn.shape[1]))
    return sum(drifts) / len(drifts) if drifts else 0.0


def _copy(b: Basis, device: torch.device, *, pin: bool = False, non_blocking: bool = False) -> Basis:
    def one(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        out = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
        return out.copy_(t, non_blocking=non_blocking)

    return Basis(one(b.left), one(b.right))


class BasisCache:
    def __init__(self, device: torch.device, capacity_bytes: int) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.capacity = int(capacity_bytes)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.parked: OrderedDict[str, Basis] = OrderedDict()  # current bases, host copies
        self.previous: OrderedDict[str, Basis] = OrderedDict()  # replaced bases, host copies (evictable)
        self.inflight: dict[str, tuple[Basis, Any]] = {}  # prefetched device copies (+ CUDA event)
        self.fetched: dict[str, Basis] = {}  # device copies handed out, by slot name
        self.resident: dict[str, int] = {}  # bases kept on the device (over budget / never parked): bytes
        self.drift: dict[str, float] = {}
        self.hits = self.misses = self.h2d_bytes = self.d2h_bytes = 0
        self.device_bytes = self.peak_device_bytes = 0

    # ---- accounting -------------------------------------------------------------------------------------
    def _device_delta(self, n: int) -> None:
        self.device_bytes += n
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def host_bytes(self) -> int:
        return sum(basis_bytes(b) for b in self.parked.values()) + sum(basis_bytes(b) for b in self.previous.values())

    # ---- moving bases -----------------------------------------------------------------------------------
    def prefetch(self, name: str) -> None:
        """Start copying ``name``'s parked basis to the device (async on CUDA)."""
        host = self.parked.get(name)
        if host is None or name in self.inflight or name in self.fetched:
            return
        if self.cuda:
            with torch.cuda.stream(self.stream):
                dev = _copy(host, self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            dev, event = _copy(host, self.device), None
        self.inflight[name] = (dev, event)
        self.h2d_bytes += basis_bytes(host)
        self._device_delta(basis_bytes(host))

    def fetch(self, name: str, current: Basis | None) -> Basis | None:
        """The device copy of the basis whose current value is ``current`` (a parked host copy, a device copy
        kept resident, or None before the first refresh)."""
        if current is None:
            return None
        if name in self.inflight and current is self.parked.get(name):
            dev, event = self.inflight.pop(name)
            if event is not None:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(event)
                for t in dev:
                    if t is not None:
                        t.record_stream(stream)
            self.hits += 1
        elif current is self.parked.get(name):
            dev = _copy(current, self.device)
            self.h2d_bytes += basis_bytes(current)
            self._device_delta(basis_bytes(current))
            self.misses += 1
        else:  # already on the device
            dev = current
            self.hits += 1
            if name not in self.resident:
                self.resident[name] = basis_bytes(dev)
                self._device_delta(basis_bytes(dev))
        self.fetched[name] = dev
        return dev

    def park(self, name: str, current: Basis | None) -> Basis | None:
        """After the use: the value to keep in the slot (the host copy, or the device copy if over budget)."""
        handed = self.fetched.pop(name, None)
        if current is None:
            return None
        if handed is not None:
            self._device_delta(-basis_bytes(handed))
        self.resident.pop(name, None)
        host = self.parked.get(name)
        if current is handed and host is not None:  # not refreshed: the host copy is still valid
            self.parked.move_to_end(name)
            return host
        need = basis_bytes(current)
        self._device_delta(need)  # a refreshed (or never parked) basis is on the device now
        new_host = _copy(current, torch.device("cpu"), pin=self.cuda)
        self.d2h_bytes += need
        if host is not None:  # replaced by a refresh: keep the old one as the previous basis
            self.drift[name] = subspace_drift(host, new_host)
            del self.parked[name]
            self.previous[name] = host
            self.previous.move_to_end(name)
        while self.previous and self.host_bytes() + need > self.capacity:
            self.previous.popitem(last=False)  # least recently used previous basis
        if self.host_bytes() + need > self.capacity:  # no room even for current bases: stay on the device
            self.resident[name] = need
            return current
        self.parked[name] = new_host
        self._device_delta(-need)
        return new_host

    # ---- reporting --------------------------------------------------------------------------------------
    def stats(self, all_bases_bytes: int) -> dict[str, float]:
        drift = list(self.drift.values())
        return {"cache/hits": float(self.hits), "cache/misses": float(self.misses),
                "cache/h2d_bytes": float(self.h2d_bytes), "cache/d2h_bytes": float(self.d2h_bytes),
                "cache/device_bytes_peak": float(self.peak_device_bytes),
                "cache/device_bytes_without_cache": float(all_bases_bytes),
                "cache/host_bytes": float(self.host_bytes()),
                **({"proj/subspace_drift_mean": sum(drift) / len(drift)} if drift else {})}
