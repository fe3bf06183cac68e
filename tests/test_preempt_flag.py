"""``experiments.checkpoint.dcp.PreemptFlag``: the preemption flag agreed across ranks without a per-step device
sync (an async all-reduce of a CPU tensor on its own gloo group, waited one poll later). Two spawned gloo ranks:
only rank 1 raises its flag, at its third poll; both ranks must see it at the same (the fourth) poll, not before,
and keep seeing it."""

from __future__ import annotations

import torch
from helpers import free_port, join_gloo, spawn_gloo

RAISED_AT, POLLS = 2, 6


def _worker(rank: int, port: int, out: str) -> None:
    from experiments.checkpoint.dcp import PreemptFlag

    join_gloo(rank, 2, port)
    flag = PreemptFlag()
    seen = [flag.poll(rank == 1 and k >= RAISED_AT) for k in range(POLLS)]
    flag.close()
    torch.save(seen, f"{out}/{rank}.pt")


def test_every_rank_sees_the_flag_at_the_same_poll_one_after_it_was_raised(tmp_path):
    spawn_gloo(_worker, (free_port(), str(tmp_path)), nprocs=2)
    expected = [k > RAISED_AT for k in range(POLLS)]
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"{rank}.pt")
        assert seen == expected, (rank, seen, expected)
