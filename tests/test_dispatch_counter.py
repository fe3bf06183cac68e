"""``experiments.dispatch_counter``: host syncs (with the line that caused them), ATen ops by phase, and collectives
(a 2-process gloo group)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from experiments.dispatch_counter import DispatchCounter

sys.path.insert(0, str(Path(__file__).parent))
from test_distributed import spawn_pair  # noqa: E402

_HERE = "tests/test_dispatch_counter.py"


def _line_of(marker: str) -> int:
    """The line of this file holding ``marker`` (so the expected sync sites follow edits)."""
    lines = Path(__file__).read_text().splitlines()
    (hit,) = [i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(f"# {marker}")]
    return hit


def test_each_kind_of_host_sync_is_counted_at_its_line():
    x = torch.randn(4)
    counter = DispatchCounter()
    with counter:
        x.sum().item()  # sync-item
        bool(x.sum() > 0)  # sync-bool
        float(x[0])  # sync-float
        _ = x[x > 0]  # sync-mask
        _ = torch.tensor([1.0, 2.0])  # sync-list
        _ = x.nonzero()  # sync-nonzero
        _ = torch.repeat_interleave(x, torch.ones(4, dtype=torch.long))  # sync-repeat
        _ = torch.repeat_interleave(x, 2)  # an int repeat: the size is known on the host
        _ = x[torch.arange(2)]  # integer indexing: no sync
        _ = torch.where(x > 0, x, 0.0)  # device-side select: no sync
    r = counter.report()
    expected = {f"{_HERE}:{_line_of(m)}": 1
                for m in ("sync-item", "sync-bool", "sync-float", "sync-mask", "sync-list", "sync-nonzero",
                          "sync-repeat")}
    assert r.sync_sites == expected, f"sync sites {r.sync_sites}, expected {expected}"
    assert r.host_syncs == 7, r.sync_ops
    assert r.sync_ops == {"aten._local_scalar_dense": 3, "aten.index": 1, "aten.lift_fresh": 1,
                          "aten.nonzero": 1, "aten.repeat_interleave": 1}, r.sync_ops


def test_device_side_code_has_no_sync_and_ops_are_counted_by_phase_without_views():
    x, w = torch.randn(8, 4), torch.randn(4, 4)
    counter = DispatchCounter()
    with counter:
        with counter.phase("forward"):
            y = x @ w.t()  # t: a view; mm: one op
            y = y.relu()
        with counter.phase("optimizer"):
            found_inf = (y.abs() > 1e30).any()  # abs, gt, any: 3 ops
            w.mul_(found_inf.logical_not())  # logical_not, mul_: 2 ops
        y.sum()  # outside any phase: "other"
        counter.counting = False
        y.sum().item()  # not counted
    r = counter.report()
    assert r.host_syncs == 0, r.sync_sites
    assert r.aten_ops == {"forward": 2, "optimizer": 5, "other": 1}, r.op_names
    assert r.view_ops == {"forward": 1}, r.view_ops
    assert r.op_names["forward"] == {"aten.mm": 1, "aten.relu": 1}, r.op_names


def test_syncs_of_a_host_phase_are_host_side():
    counter = DispatchCounter()
    order = torch.randperm(8)
    with counter:
        counter.set_phase("data")  # the loop's batch: host tensors in a CUDA run too
        rows = [int(order[i]) for i in range(2)]  # host-side
        counter.set_phase("forward")
        order.sum().item()  # sync-forward
    r = counter.report()
    assert r.host_side_sync_sites == {f"{_HERE}:{_line_of('host-side')}": 2}, r.host_side_sync_sites
    assert r.sync_sites == {f"{_HERE}:{_line_of('sync-forward')}": 1}, r.sync_sites
    assert r.aten_ops == {"data": 2, "forward": 2}, r.op_names  # data: 2 _local_scalar_dense (select: a view)
    assert len(rows) == 2


def test_reading_a_tensor_marked_host_resident_is_host_side():
    step, x = torch.zeros(()), torch.randn(3)
    counter = DispatchCounter()
    counter.mark_host([step])  # e.g. torch.optim's step count, kept on the CPU by a non-fused AdamW
    with counter:
        step.add_(1)
        beta_power = 0.9 ** step.item()  # host-read
        x.mul_(beta_power)
    r = counter.report()
    assert r.host_syncs == 0 and r.host_side_sync_sites == {f"{_HERE}:{_line_of('host-read')}": 1}, r


def test_reset_forgets_and_the_counter_nests_under_another_mode():
    from experiments.memory.meter import MemoryMeter

    counter, meter = DispatchCounter(), MemoryMeter()
    x = torch.randn(3)
    with counter, meter:
        (x + 1).sum().item()
        counter.reset()
        _ = x * 2
    r = counter.report()
    assert (r.host_syncs, r.aten_ops) == (0, {"other": 1}), (r.sync_ops, r.op_names)


def _collective_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from helpers import join_gloo

    join_gloo(rank, world, port)
    try:
        counter = DispatchCounter()
        t = torch.ones(10, dtype=torch.float32)
        with counter:
            dist.all_reduce(t)
            work = dist.all_reduce(torch.ones(3, dtype=torch.float64), async_op=True)
            work.wait()
            shard = torch.empty(5)
            dist.reduce_scatter_tensor(shard, torch.ones(10))
            full = torch.empty(8, dtype=torch.bfloat16)
            dist.all_gather_into_tensor(full, torch.ones(4, dtype=torch.bfloat16), async_op=True).wait()
            dist.broadcast(t, src=0)
        result = {"collectives": [c.to_dict() for c in counter.report().collectives], "sum": t[0].item()}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_gloo_collectives_are_counted_with_bytes_and_async(tmp_path):
    results = spawn_pair(_collective_worker, tmp_path)
    for rank, result in results.items():
        assert result["sum"] == 2.0, result  # the all_reduce really ran: 1 + 1 over 2 ranks
        ops = [(c["op"], c["bytes"], c["async"]) for c in result["collectives"]]
        assert ops == [("c10d.allreduce_", 40, False), ("c10d.allreduce_", 24, True),
                       ("c10d._reduce_scatter_base_", 40, False), ("c10d._allgather_base_", 8, True),
                       ("c10d.broadcast_", 40, False)], f"rank {rank}: {ops}"


def test_backward_follows_forward_and_hook_work_counts_as_optimizer():
    """``set_phase("forward")`` only: the autograd engine's ops are backward, a hook's ops (a frame of
    ``hook_files``, here ``tests/helpers.py``) optimizer work."""
    import helpers

    w = torch.randn(3, 3, requires_grad=True)
    counter = DispatchCounter(hook_files=("tests/helpers.py",))
    w.register_post_accumulate_grad_hook(helpers.sgd_hook)
    with counter:
        counter.set_phase("forward")
        loss = (w * 2).sum()  # mul, sum
        loss.backward()  # engine: mul (sum's backward is an expand, a view); hook: sgd_hook's ops
        counter.set_phase("optimizer")
    r = counter.report()
    # backward()'s seed gradient (ones_like) is made in Python before the engine starts: still forward
    assert r.op_names["forward"] == {"aten.mul": 1, "aten.sum": 1, "aten.ones_like": 1}, r.op_names
    assert r.op_names["optimizer"] == {"aten.add_": 1, "aten.mul": 1}, r.op_names  # sgd_hook: mul + add_
    assert r.op_names["backward"] == {"aten.mul": 1}, r.op_names
    assert r.host_syncs == 0, r.sync_sites
