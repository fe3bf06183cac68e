"""Meter-measured temporaries of one low-rank weight update, naive vs the row-chunked fallback
(the fused update's memory bound; used by ``benchmarks/kernel_bench.py`` and ``tests/test_kernels.py``)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.memory.meter import MemoryMeter
from hmt_core.kernels import ops
from hmt_core.projection import Basis


def update_temp_bytes(o: int, i: int, r: int, *, naive: bool, dtype: torch.dtype = torch.float32, fake: bool = True,
                      chunk_rows: int = 0) -> tuple[int, int]:
    """(peak temp bytes, peak total bytes) of one two-sided update W (o, i) ← W − lr·P U Qᵀ.

    ``naive``: ``W -= lr * (P @ U @ Q.T)``; else ``ops.lowrank_update`` on the PyTorch backend (row chunks of
    ``chunk_rows``, 0 = the default budget). ``fake``: under FakeTensorMode, so no real memory is used."""
    with FakeTensorMode() if fake else torch.no_grad():
        w, p, u, q = (torch.zeros(s, dtype=dtype) for s in ((o, i), (o, r), (r, r), (i, r)))
        meter = MemoryMeter(source="fake" if fake else "tracker")
        meter.track([w, p, u, q], "params")
        with meter:
            if naive:
                w -= 1e-3 * (p @ u @ q.T)
            else:
                ops.lowrank_update(w, u, Basis(p, q.T), scale=1.0, step_size=1e-3, lr=1e-3, weight_decay=0.0,
                                   style="torch", backend="torch", chunk_rows=chunk_rows)
        rep = meter.report()
        return rep.peak_by_category_bytes["temp"], rep.peak_bytes
