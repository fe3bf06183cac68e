"""A training method's parallel context: what a method needs to know about the other processes of a job, handed
to it by ``Method.set_parallel`` (``hmt_core.method``) after ``attach``. One process is world size 1
(``SINGLE_PROCESS``), which every method accepts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

RankAgreement = Callable[[int, int, torch.device], tuple[int, int]]  # (rank, τ-rank, device) -> the agreed pair
REPLICATED = "hmt_replicated"  # attribute of a parameter a sharding wrapper must leave whole on every rank


class GradReducer(Protocol):
    """Averages gradients across ranks in place (set by ``experiments.dist.parallel``; None single-process). It may
    defer (bucket, communicate asynchronously): ``done`` runs once the tensor holds the mean, in the order the
    tensors were handed over, at the latest in ``flush``."""

    lowrank: bool  # Mode A weights between refreshes: reduce Ĝ = project(G_local) instead of G

    def full(self, grad: Tensor, name: str, done: Callable[[], None]) -> None: ...  # grad: any parameter's shape

    def projected(self, low: Tensor, done: Callable[[], None]) -> None: ...  # low: Ĝ, (out, r) | (r, in) | (r, r)

    def flush(self) -> None: ...  # every tensor handed over is reduced and its ``done`` has run

    world_size: int

    def rows(self, ids: Tensor, values: Tensor) -> tuple[Tensor, Tensor]: ...  # (N,), (N, d): every rank's, gathered


def mark_replicated(*params: nn.Parameter) -> None:
    """Tag ``params`` to be held whole on every rank (FSDP2 leaves them out of its shards,
    ``experiments.dist.parallel.shard_model``): a table updated by rows, INT8 codes and scales."""
    for p in params:
        setattr(p, REPLICATED, True)


def is_replicated(p: torch.Tensor) -> bool:
    return bool(getattr(p, REPLICATED, False))


@dataclass(frozen=True, kw_only=True)
class ParallelContext:
    """``world_size``: processes training the one model (1: a single process). ``refresh_mode``: how a method on
    row-sharded weights (FSDP2) refreshes a projection basis, ``"gather"`` (the full gradient, gathered) or
    ``"sketch"`` (a distributed range finder; ``hmt_core.optim.sharded``). ``reduce_grad``: a gradient reducer a
    method may take charge of (the mean over ranks inside backward, ``GradReducer``); None
    where the caller's wrapper (DDP) reduces the gradients. Under FSDP2 it is given too: FSDP2 reduces the sharded
    parameters, the method the ones left whole on every rank (``is_replicated``: a row-sparse embedding's gathered
    rows, an INT8 table's gradient). ``agree_rank``: makes a dynamic-rank decision
    the same on every process (rank 0's, ``hmt_core.optim.sharded.rank_from_root``)."""

    world_size: int = 1
    refresh_mode: str = "gather"
    reduce_grad: GradReducer | None = None
    agree_rank: RankAgreement | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be at least 1")
        if self.refresh_mode not in ("gather", "sketch"):
            raise ValueError(f"refresh_mode={self.refresh_mode!r} is not one of 'gather', 'sketch'")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


SINGLE_PROCESS = ParallelContext()
