"""Reference optimizers' state (galore-torch, apollo-torch) under FSDP2, made world-size free for checkpoints.

Under ``dist=fsdp2`` galore-torch's ``GaLoreAdamW`` and apollo-torch's ``APOLLOAdamW`` step the DTensor shards FSDP2
keeps, unchanged: DTensor's operator dispatch turns their whole-matrix code into collectives (the projection of a
``Shard(0)`` gradient G_k by a replicated right basis is local, a left basis' Pᵀ G becomes a partial sum all-reduced,
the basis SVD of galore-torch gathers G — DTensor's replicate-only strategy for ``linalg.svd`` — and APOLLO's
channel norms of a row-shard are local or all-reduced). Their state therefore holds DTensors in places DCP's
``get_optimizer_state_dict`` does not reach: inside projector objects (galore-torch's ``GaLoreProjector.ortho_matrix``)
and next to non-tensor entries (``projector``, ``seed``) that its optimizer-state initialisation does not restore.

So the checkpoint stores that state as one serialized entry with every DTensor gathered to its full value
(``Gathered``: the tensor and its placements), the same on every rank (written once by DCP, readable at any world
size); restoring puts each value back on this run's mesh with its placements (``distribute_tensor`` slices the
full value locally: no communication). The gathering costs the full low-rank moments (m × r or r × n per projected
weight, plus the dense parameters' moments) on every rank for the duration of a save — memory a checkpoint step
needs on top of training's, documented in docs/distributed.md.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class Gathered:
    """A DTensor's full value and placements, as saved (``placements``: ``Shard(d)``/``Replicate()`` objects)."""
    full: Tensor
    placements: tuple


def _map(obj: Any, fn, memo: dict[int, Any]) -> Any:
    """``obj`` with ``fn`` applied to every leaf (returns None to keep a leaf as is); dicts, lists, tuples and plain
    objects (projectors) are copied, never modified in place. ``memo``: objects shared by several entries (one
    projector object referenced twice) stay shared."""
    key = id(obj)
    if key not in memo:
        out = fn(obj)
        if out is None:
            out = _copy_children(obj, fn, memo)
        memo[key] = out
    return memo[key]


def _copy_children(obj: Any, fn, memo: dict[int, Any]) -> Any:
    if isinstance(obj, dict):
        return {k: _map(v, fn, memo) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn, memo) for v in obj)
    if isinstance(obj, (type, Tensor)) or not hasattr(obj, "__dict__"):
        return obj  # a plain tensor, a number, a string, a class
    out = copy.copy(obj)  # a projector object: a copy with its attributes mapped
    out.__dict__ = {k: _map(v, fn, memo) for k, v in obj.__dict__.items()}
    return out


def gather(state: Any) -> Any:
    """``state`` with every DTensor replaced by ``Gathered`` (its full value: one all-gather each, issued in the
    same traversal order on every rank, so every rank must call this with the same structure)."""
    from torch.distributed.tensor import DTensor

    def leaf(x):
        return Gathered(x.full_tensor(), tuple(x.placements)) if isinstance(x, DTensor) else None

    return _map(state, leaf, {})


def distribute(state: Any, mesh) -> Any:
    """The inverse of ``gather`` on this run's ``mesh`` (any size): each ``Gathered`` becomes a DTensor with its
    saved placements, this rank's part sliced from the full value locally."""
    from torch.distributed.tensor import distribute_tensor

    def leaf(x):
        if isinstance(x, Gathered):
            return distribute_tensor(x.full, mesh, list(x.placements), src_data_rank=None)
        return None

    return _map(state, leaf, {})


def to_full(state: Any) -> Any:
    """``state`` with every DTensor replaced by its full value as a plain tensor (collective, like ``gather``): the
    single-process form of a sharded optimizer's state."""
    return full_values(gather(state))


def full_values(state: Any) -> Any:
    """A ``gather``-ed state (e.g. read from a checkpoint) with each ``Gathered`` replaced by its full tensor."""
    return _map(state, lambda x: x.full if isinstance(x, Gathered) else None, {})
