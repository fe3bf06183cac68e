"""Gradient communication of multi-process training, 2 processes on gloo:

1. Per-layer HMT under DDP averages its gradients in asynchronous fp32 buckets (``experiments.dist.comm.
   GradAverager``); one step at a time from the single-process state, the weights equal the single-process global
   batch bit for bit whatever the bucket size: 0 (one all-reduce per gradient), 100 KiB (several buckets) and the
   25 MiB default (one bucket here) — Mode A with clipping and Mode B. Why exact: W = 2, so fl(a + b)/2 =
   fl(a/2 + b/2) (tests/test_distributed.py), and packing changes no sum. Low-rank communication and 2
   micro-batches are compared across bucket sizes (bit for bit).
2. The all-reduces of a step's gradients are asynchronous (``async_op=True``), fp32, one per bucket of consecutive
   hook tensors closed once it holds ≥ the cap, and the hook work of bucket k runs after bucket k + 1 is launched
   (the overlap), in hook order.
3. Averages are fp32 sums divided afterwards: fp16 gradients 2⁻²⁴ (the smallest subnormal) on both ranks average to
   2⁻²⁴, where dividing first (DDP's arithmetic, the old one) rounds 2⁻²⁵ to 0.
4. A dynamic rank is decided once: rank 1 is made to pick another rank for every weight (``choose_rank`` patched on
   rank 1 only); both ranks end the refresh with rank 0's choice and the step completes (FSDP2, both refresh modes,
   and DDP with low-rank communication, whose r × n all-reduces would otherwise disagree on shapes).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_distributed import _diffs, _method, _reference, micro_rows, spawn_pair  # noqa: E402

STEPS = 3  # refreshes at steps 0 and 2 (update interval 2)
SMALL_MB = 100 / 1024  # 100 KiB: several buckets for the tiny model (a 64 × 176 weight is 44 KiB in fp32)
BUCKETS_MB = (0.0, SMALL_MB, 25.0)
CASES = {
    "A": ({"name": "hmt", "rank": 8, "update_interval": 2}, False, 1),
    "B": ({"name": "hmt", "mode": "B", "rank": 8, "update_interval": 2}, False, 1),
    "A-accum": ({"name": "hmt", "rank": 8, "update_interval": 2}, False, 2),
    "A-lowrank": ({"name": "hmt", "rank": 8, "update_interval": 2}, True, 1),
}
DYNAMIC = {"name": "hmt", "rank": None, "rank_candidates": [4, 8, 16], "update_interval": 2, "tau": 0.5}


def _ctx(rank: int, mode: str = "ddp", **kw):
    from experiments.dist.parallel import DistContext

    return DistContext(mode=mode, rank=rank, world_size=2, local_rank=rank, backend="gloo",
                       device=torch.device("cpu"), **kw)


def _batches(x, rank: int, micro: int) -> list[torch.Tensor]:
    return [x[r] for r in micro_rows(rank, 2, x.shape[0] // 2, micro)]


def _train_step(forward, method, ctx, batches) -> None:
    from experiments.loop import train_step

    train_step(forward, method, batches, meter=None, autocast=contextlib.nullcontext, skip_nonfinite=True)


def _bucketed(rank: int, overrides: dict, lowrank: bool, micro: int, bucket_mb: float, data, snaps) -> dict:
    """Per step: the weights that differ from the single-process step (name -> [max|diff|, max|expected|]) and a
    digest of all weights after it."""
    import hashlib
    import io

    from experiments.dist import parallel as distributed
    from helpers import tiny_llama

    ctx = _ctx(rank, lowrank_comm=lowrank, bucket_mb=bucket_mb)
    model = tiny_llama(seed=1)
    method = _method("hmt", overrides, model)
    forward = distributed.wrap_for_forward(model, method, ctx)
    out = {"diffs": [], "digests": []}
    for x, snap in zip(data, snaps):
        model.load_state_dict(snap["weights"])
        method.load_state_dict(torch.load(io.BytesIO(snap["method"]), weights_only=False))
        _train_step(forward, method, ctx, _batches(x, rank, micro))
        out["diffs"].append(_diffs(model.state_dict(), snap["after"]))
        out["digests"].append(hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values()))
                              .hexdigest())
    return out


def _bucket_log(rank: int, data) -> dict:
    """One Mode A step with 100 KiB buckets: the tensors handed to the reducer (elements, in order), the
    all-reduces issued during backward, and how many bucket all-reduces were launched when each tensor's hook work
    ran."""
    import torch.distributed as dist

    from experiments.dist import parallel as distributed
    from experiments.dispatch_counter import DispatchCounter
    from experiments.loop import lm_loss
    from helpers import tiny_llama

    ctx = _ctx(rank, bucket_mb=SMALL_MB)
    model = tiny_llama(seed=1)
    method = _method("hmt", CASES["A"][0], model)
    forward = distributed.wrap_for_forward(model, method, ctx)
    reducer = method.engine.reduce_grad
    tensors, launches, done_at, syncs = [], [], [], []
    full, original = reducer.full, dist.all_reduce

    def record_full(grad, name, done):
        tensors.append(grad.numel())
        index = len(tensors) - 1
        full(grad, name, lambda: (done_at.append((index, len(launches))), done())[1])

    def record_all_reduce(tensor, *args, **kwargs):
        if tensors and len(done_at) < len(tensors):  # inside backward: between the first hook and the last done
            (launches if kwargs.get("async_op") else syncs).append([tensor.numel(), str(tensor.dtype)])
        return original(tensor, *args, **kwargs)

    reducer.full, dist.all_reduce = record_full, record_all_reduce
    try:
        with DispatchCounter() as counter:
            _train_step(forward, method, ctx, _batches(data[0], rank, 1))
    finally:
        dist.all_reduce = original
    dispatched = [[c.op, c.bytes, c.async_op] for c in counter.report().collectives]
    out = {"tensors": list(tensors), "launches": launches, "syncs": syncs, "done_at": list(done_at),
           "cap_bytes": int(SMALL_MB * 2**20), "dispatched": dispatched}
    method.start_micro_batch(0, 2)  # a first micro-batch's backward alone: nothing left queued when it returns
    lm_loss(forward, _batches(data[1], rank, 2)[0]).backward()
    out["handed_over"] = len(tensors) - len(out["tensors"])
    out["queued_after_backward"] = len(reducer._filling) + len(reducer._in_flight)
    out["done_after_backward"] = len(done_at) - len(out["done_at"])
    return out


def _fp16_average(rank: int) -> dict:
    import torch.distributed as dist

    from experiments.dist.comm import GradAverager

    tiny = 2.0 ** -24  # the smallest fp16 subnormal
    grad = torch.full((4,), tiny, dtype=torch.float16)
    ran = []
    reducer = GradAverager(2)
    reducer.full(grad, "w", lambda: ran.append(len(ran)))
    before_flush = (grad.tolist(), list(ran))  # queued in an unfilled bucket: nothing sent, nothing run
    reducer.flush()
    divided_first = torch.full((4,), tiny, dtype=torch.float16).div_(2)  # the old arithmetic: W first, then sum
    dist.all_reduce(divided_first)
    return {"averaged": grad.tolist(), "before_flush": before_flush, "divided_first": divided_first.tolist(),
            "ran": ran, "tiny": tiny}


def _forced_disagreement(rank: int, ctx, data) -> dict:
    """One step with a dynamic rank where rank 1's ``choose_rank`` answers another candidate than its own."""
    from experiments.dist import parallel as distributed
    from helpers import tiny_llama
    from hmt_core.optim import refresh as rf

    honest, chosen = rf.choose_rank, []

    def choose(*args, **kwargs):  # what this rank answers (rank 1: the next candidate after its own choice)
        r = honest(*args, **kwargs)
        if rank == 1:
            cands = kwargs["candidates"]
            r = cands[(cands.index(r) + 1) % len(cands)] if r in cands else cands[0]
        chosen.append(r)
        return r

    model = distributed.shard_model(tiny_llama(seed=1), ctx)
    method = _method("hmt", {**DYNAMIC, **({"basis": "rsvd"} if ctx.refresh == "sketch" else {})}, model)
    forward = distributed.wrap_for_forward(model, method, ctx)
    opt, refreshed = method.engine.opt, []
    refresh = opt.refresh

    def record_refresh(s, *args, **kwargs):
        refresh(s, *args, **kwargs)
        refreshed.append(s.name)

    rf.choose_rank, opt.refresh = choose, record_refresh
    try:
        _train_step(forward, method, ctx, _batches(data[0], rank, 1))
    finally:
        rf.choose_rank = honest
    assert len(chosen) == len(refreshed), (chosen, refreshed)
    ranks = {s.name: s.rank for s in opt.slots if s.projected}
    return {"chosen": dict(zip(refreshed, chosen)), "ranks": ranks}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from helpers import join_gloo, seeded_token_batches

    join_gloo(rank, world, port, timeout_s=60)  # a shape mismatch between ranks fails instead of hanging
    try:
        data = seeded_token_batches(STEPS)
        results = {"bucketed": {}}
        for case, (overrides, lowrank, micro) in CASES.items():
            snaps = _reference("hmt", overrides, data, micro=micro)
            for mb in BUCKETS_MB:
                results["bucketed"][f"{case} bucket_mb={mb:g}"] = _bucketed(rank, overrides, lowrank, micro, mb,
                                                                            data, snaps)
        results["log"] = _bucket_log(rank, data)
        results["fp16"] = _fp16_average(rank)
        results["agree"] = {
            "fsdp2-gather": _forced_disagreement(rank, _ctx(rank, "fsdp2"), data),
            "fsdp2-sketch": _forced_disagreement(rank, _ctx(rank, "fsdp2", refresh="sketch"), data),
            "ddp-lowrank": _forced_disagreement(rank, _ctx(rank, lowrank_comm=True), data),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> dict:
    return spawn_pair(_worker, tmp_path_factory.mktemp("dist_comm"))


EXACT = [c for c, (_, lowrank, micro) in CASES.items() if not lowrank and micro == 1]


@pytest.mark.parametrize("case", [f"{c} bucket_mb={mb:g}" for c in EXACT for mb in BUCKETS_MB])
def test_bucketed_async_averaging_equals_the_single_process_global_batch(spawned, case):
    for rank, res in spawned.items():
        for step, diffs in enumerate(res["bucketed"][case]["diffs"]):
            table = "\n".join(f"  {k}: max|diff| {d:.3e} (max|expected| {m:.3e})" for k, (d, m) in diffs.items())
            assert not diffs, f"{case}, rank {rank}, step {step}: weights differ from the reference:\n{table}"


@pytest.mark.parametrize("case", list(CASES))
def test_the_bucket_size_changes_no_weight(spawned, case):
    """Every bucket size gives the same weights bit for bit (packing changes no sum). For accumulation and low-rank
    communication this is the comparison: the single-process reference sums the micro-batches' gradients in
    another order ((a₀ + b₀) + (a₁ + b₁) against (a₀ + a₁) + (b₀ + b₁) for a dense parameter, measured 3e-9 on most
    weights after Adam), and low-rank communication clips by ‖Ĝ‖, not ‖G‖ (``hmt_core.optim.hooks``; its own
    bound against the full all-reduce: tests/test_dist_lowrank.py)."""
    for rank, res in spawned.items():
        runs = {mb: res["bucketed"][f"{case} bucket_mb={mb:g}"]["digests"] for mb in BUCKETS_MB}
        assert len({tuple(d) for d in runs.values()}) == 1, (rank, runs)


def test_buckets_are_async_fp32_all_reduces_of_consecutive_hook_tensors_that_overlap_the_hook_work(spawned):
    for rank, res in spawned.items():
        log = res["log"]
        expected, bucket, filled, owner = [], 0, 0, []  # the packing rule, re-derived from the hook order
        for numel in log["tensors"]:
            bucket += numel
            filled += numel * 4
            owner.append(len(expected))
            if filled >= log["cap_bytes"]:
                expected.append(bucket)
                bucket = filled = 0
        if bucket:
            expected.append(bucket)
        print(f"rank {rank}: {len(log['tensors'])} gradients -> buckets of {expected} elements; launched "
              f"{log['launches']}; synchronous all-reduces in backward: {log['syncs']}; dispatched collectives "
              f"of the step: {log['dispatched']}")
        assert len(expected) >= 3, expected  # the cap really splits the step (or the test shows nothing)
        assert [n for n, _ in log["launches"]] == expected, log
        assert all(dtype == "torch.float32" for _, dtype in log["launches"]), log["launches"]
        assert log["syncs"] == [], log["syncs"]
        # the same, as dispatched to c10d (experiments.dispatch_counter): the asynchronous all-reduces are the
        # buckets, in fp32 bytes
        assert [b for op, b, is_async in log["dispatched"] if is_async] == [4 * n for n in expected], log
        assert all(op == "c10d.allreduce_" for op, _, is_async in log["dispatched"] if is_async), log
        # the end of a backward flushes: every tensor handed over in it is reduced and its work done
        assert log["handed_over"] > 0 and log["done_after_backward"] == log["handed_over"], log
        assert log["queued_after_backward"] == 0, log
        order = [i for i, _ in log["done_at"]]
        assert order == list(range(len(log["tensors"]))), order  # hook work in hook order
        for i, launched in log["done_at"]:  # bucket k's work after bucket k + 1's launch (the last: at flush)
            k = owner[i]
            assert launched >= min(k + 2, len(expected)), (i, k, launched, log["done_at"])


def test_averaging_sums_in_fp32_then_divides(spawned):
    for rank, res in spawned.items():
        r = res["fp16"]
        print(f"rank {rank}: fp32 sum then /2 {r['averaged']}, /2 then fp16 sum {r['divided_first']}")
        assert r["before_flush"] == [[r["tiny"]] * 4, []], r
        assert r["averaged"] == [r["tiny"]] * 4 and r["ran"] == [0], r
        assert r["divided_first"] == [0.0] * 4, r  # the old order loses it: what this test tells apart


@pytest.mark.parametrize("case", ["fsdp2-gather", "fsdp2-sketch", "ddp-lowrank"])
def test_a_dynamic_rank_is_rank_0s_choice_on_every_rank(spawned, case):
    zero, one = spawned[0]["agree"][case], spawned[1]["agree"][case]
    print(f"{case}: rank 0 chose {zero['chosen']}, rank 1 answered {one['chosen']}; "
          f"ranks after the refresh: {zero['ranks']} / {one['ranks']}")
    assert zero["chosen"] and zero["chosen"].keys() == zero["ranks"].keys(), zero  # every weight refreshed
    assert all(one["chosen"][k] != v for k, v in zero["chosen"].items()), (zero, one)  # disagreement forced
    assert zero["ranks"] == one["ranks"] == zero["chosen"], (zero, one)


# ------------------------------------------------------------------------------------------------ bad settings
from test_bad_inputs import assert_one_line_error, results  # noqa: E402,F401  (the fixture: an earlier run)


def test_a_negative_bucket_size_fails_with_one_line(capsys, results):
    assert_one_line_error(capsys, results, ["dist=ddp", "dist.bucket_mb=-1"], "dist.bucket_mb must be >= 0", "-1")
