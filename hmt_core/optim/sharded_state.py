"""HMT's optimizer state on FSDP2 row shards as ``torch.distributed.checkpoint`` (DCP) tensors.

Under ``hmt_core.optim.sharded`` a parameter W (m × n) keeps rows [a, b) on each rank (``Shard(0)``, cut like
``torch.chunk``), and so do the moments that live in W's row space: a right-sided weight's Adam moments M, V of
Ĝ = G Q ((b−a) × r: the local rows of the global m × r moments, GaLore Eq. 3 applied row by row) and a dense
parameter's element-wise AdamW moments (rows of W's shape). Everything else is replicated, identical on every rank:
bases P (m × r) and Q (n × r), a left-sided weight's r × n moments, step counters, rank history.

``split_state`` turns the state dict into (a) the replicated part, with a placeholder (global shape, dtype) where each
row-sharded moment was — identical on every rank, so DCP writes it once as one serialized entry — and (b) those
moments as DTensors with placement ``Shard(0)`` on the parameter's mesh and their global shape, which DCP writes
shard by shard (each rank its rows) and reads back with any world size (it reshards by global offsets).
``row_templates`` builds, from the placeholders, this rank's empty DTensors for ``dcp.load`` to fill in place;
``join_state`` puts their local rows back where the placeholders were, for ``LowRankOptimizer.load_state_dict``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hmt_core.optim.rows import rank_rows

PLACEHOLDER = "sharded_rows"  # {"sharded_rows": [global shape], "dtype": "torch.float32"}
MOMENTS = ("m", "v")


def _row_sharded(s, st: dict) -> bool:
    """Whether slot ``s``'s moments are row shards: a sharded parameter whose state is dense or right-sided."""
    return s.shard is not None and st["m"] is not None and st["basis_left"] is None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _dtensor(local: Tensor, mesh, global_shape: tuple[int, ...]) -> Tensor:
    """``local`` (this rank's ``rank_rows`` of dim 0) as a ``Shard(0)`` DTensor of ``global_shape``."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape),
                              stride=_contiguous_stride(global_shape))


def split_state(state: dict[str, Any], slots) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(replicated state with placeholders, {"<param>/<m|v>": Shard(0) DTensor}); ``state`` is left unchanged."""
    by_name = {s.name: s for s in slots}
    out = {**state, "slots": {}}
    tensors: dict[str, Tensor] = {}
    for name, st in state["slots"].items():
        s = by_name[name]
        st = dict(st)
        if _row_sharded(s, st):
            mesh = s.shard.grad_param.device_mesh
            for key in MOMENTS:
                local = st[key]  # (b−a, ...) this rank's rows
                shape = (s.full_shape[0], *local.shape[1:])
                tensors[f"{name}/{key}"] = _dtensor(local, mesh, shape)
                st[key] = {PLACEHOLDER: list(shape), "dtype": str(local.dtype).removeprefix("torch.")}
        out["slots"][name] = st
    return out, tensors


def row_templates(state: dict[str, Any], slots) -> dict[str, Tensor]:
    """Empty ``Shard(0)`` DTensors, this rank's rows of every placeholder in ``state`` (``dcp.load`` fills them)."""
    by_name = {s.name: s for s in slots}
    out: dict[str, Tensor] = {}
    for name, st in state["slots"].items():
        for key in MOMENTS:
            held = st.get(key)
            if not (isinstance(held, dict) and PLACEHOLDER in held):
                continue
            s = by_name[name]
            mesh = s.shard.grad_param.device_mesh
            shape = tuple(held[PLACEHOLDER])
            rows = rank_rows(shape[0], mesh.size(), mesh.get_local_rank())
            local = torch.empty((rows.stop - rows.start, *shape[1:]), dtype=getattr(torch, held["dtype"]),
                                device=s.param.device)
            out[f"{name}/{key}"] = _dtensor(local, mesh, shape)
    return out


def join_state(state: dict[str, Any], tensors: dict[str, Tensor]) -> dict[str, Any]:
    """``state`` with each placeholder replaced by the local rows of its (loaded) DTensor."""
    out = {**state, "slots": {}}
    for name, st in state["slots"].items():
        st = dict(st)
        for key in MOMENTS:
            if isinstance(st.get(key), dict) and PLACEHOLDER in st[key]:
                st[key] = tensors[f"{name}/{key}"].to_local()
        out["slots"][name] = st
    return out
