"""The caching-allocator replay (``experiments.memory.allocator_model``) against sequences worked out by hand from
``CUDACachingAllocator.cpp``'s rules, and the meter's event log that feeds it. All figures are exact integers: no
tolerance is involved."""

from __future__ import annotations

import torch

from experiments.memory.allocator_model import allocation_size, replay, round_size
from experiments.memory.meter import MemoryMeter

MiB = 2**20


def _events(*ops: tuple[str, int, int]) -> list[tuple[int, int, int, str]]:
    """``("a", key, bytes)`` allocates, ``("f", key, bytes)`` frees; one tick each."""
    return [(t, n if op == "a" else -n, key, "cuda:0") for t, (op, key, n) in enumerate(ops)]


def _check(result, allocated: int, reserved: int, **extra) -> None:
    got = {"allocated": result.peak_allocated_bytes, "reserved": result.peak_reserved_bytes,
           **{k: getattr(result, k) for k in extra}}
    assert got == {"allocated": allocated, "reserved": reserved, **extra}, got


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (0, 1, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    assert allocation_size(512) == allocation_size(MiB) == 2 * MiB  # small pool: 2 MiB segments
    assert allocation_size(MiB + 512) == allocation_size(10 * MiB - 512) == 20 * MiB  # < 10 MiB: 20 MiB segments
    assert allocation_size(10 * MiB) == 10 * MiB and allocation_size(11 * MiB + 512) == 12 * MiB  # 2 MiB multiples


def test_small_pool_splits_one_segment():
    # 100 B -> a 512 B block split from a new 2 MiB segment; 1 MiB (still small) fits the 2 MiB - 512 B remainder
    _check(replay(_events(("a", 1, 100), ("a", 2, MiB))), allocated=512 + MiB, reserved=2 * MiB, segments=1)


def test_large_remainder_of_one_mib_or_less_is_not_split():
    # 3 MiB from a 20 MiB segment (17 MiB remain, > 1 MiB: split); 16.5 MiB takes the 17 MiB block whole (0.5 MiB
    # remainder is not split), so allocated counts 3 + 17 = 20 MiB though 19.5 MiB were asked for
    r = replay(_events(("a", 1, 3 * MiB), ("a", 2, 33 * MiB // 2)))
    _check(r, allocated=20 * MiB, reserved=20 * MiB, segments=1, peak_requested_bytes=39 * MiB // 2)
    # >= 10 MiB: 11 MiB + 1 B rounds to 11 MiB + 512 B, its segment to 12 MiB; the 1 MiB - 512 B rest stays inside
    _check(replay(_events(("a", 1, 11 * MiB + 1))), allocated=12 * MiB, reserved=12 * MiB, segments=1)


def test_best_fit_reuses_the_smallest_cached_block():
    # two segments (12 and 30 MiB) cached; 11 MiB takes the 12 MiB block (best fit), not the 30 MiB one, and no
    # new segment is made: reserved stays 42 MiB
    r = replay(_events(("a", 1, 12 * MiB), ("a", 2, 30 * MiB), ("f", 1, 12 * MiB), ("f", 2, 30 * MiB),
                       ("a", 3, 11 * MiB), ("a", 4, 29 * MiB)))
    _check(r, allocated=42 * MiB, reserved=42 * MiB, segments=2)


def test_freed_neighbours_merge_back_into_the_whole_segment():
    # 4 + 4 MiB split from one 20 MiB segment, both freed: they merge with the 12 MiB rest into 20 MiB, which then
    # serves 19 MiB (a 1 MiB remainder is not split) without a second segment
    r = replay(_events(("a", 1, 4 * MiB), ("a", 2, 4 * MiB), ("f", 1, 4 * MiB), ("f", 2, 4 * MiB),
                       ("a", 3, 19 * MiB)))
    _check(r, allocated=20 * MiB, reserved=20 * MiB, segments=1)
    # freed in the other order (the middle block first) they merge all the same
    r = replay(_events(("a", 1, 4 * MiB), ("a", 2, 4 * MiB), ("f", 2, 4 * MiB), ("f", 1, 4 * MiB),
                       ("a", 3, 19 * MiB)))
    _check(r, allocated=20 * MiB, reserved=20 * MiB, segments=1)


def test_fragmentation_needs_a_new_segment():
    # a 4 MiB block stays live in the middle of a 20 MiB segment: the free 4 MiB before it and 12 MiB after it
    # cannot serve 14 MiB, so a 14 MiB segment is added (reserved 34 MiB for 18 MiB live)
    r = replay(_events(("a", 1, 4 * MiB), ("a", 2, 4 * MiB), ("f", 1, 4 * MiB), ("a", 3, 14 * MiB)))
    _check(r, allocated=18 * MiB, reserved=34 * MiB, segments=2)


def test_capacity_releases_cached_segments_then_retries():
    ops = _events(("a", 1, 12 * MiB), ("f", 1, 12 * MiB), ("a", 2, 30 * MiB))
    # unlimited: the free 12 MiB segment stays cached (42 MiB reserved)
    _check(replay(ops), allocated=30 * MiB, reserved=42 * MiB, releases=0, oom_tick=None)
    # 40 MiB: 12 + 30 would exceed it, so the entirely free 12 MiB segment is released and the 30 MiB one fits
    _check(replay(ops, capacity_bytes=40 * MiB), allocated=30 * MiB, reserved=30 * MiB, releases=1, oom_tick=None)
    # 29 MiB: even after the release 30 MiB does not fit: out of memory at the third event (tick 2)
    assert replay(ops, capacity_bytes=29 * MiB).oom_tick == 2


def test_pools_are_per_stream():
    # a cuBLAS-like workspace (8 MiB + 128 KiB) on stream 1 leaves ~11.9 MiB free in its 20 MiB segment, which a
    # 5 MiB request on stream 0 cannot use: a second 20 MiB segment
    r = replay(_events(("a", 1, 5 * MiB)), prelude=((8 * MiB + 128 * 1024, 1),))
    _check(r, allocated=13 * MiB + 128 * 1024, reserved=40 * MiB, segments=2)


def test_meter_event_log_replays_to_the_meters_peak():
    """The meter's log pairs every allocation with its free, and the running sum of requested bytes reaches exactly
    the meter's own peak (both are taken after each op's outputs are registered)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    meter = MemoryMeter()
    meter.track(model.parameters(), "params")
    with meter:
        loss = model(torch.randn(32, 64)).square().mean()
        loss.backward()
        del loss
    allocs = {key: n for _, n, key, _ in meter.events if n > 0}
    frees = {key: -n for _, n, key, _ in meter.events if n < 0}
    assert frees and all(allocs[k] == n for k, n in frees.items()), (allocs, frees)
    assert all(d == "cpu" for *_, d in meter.events)
    rep = meter.report()
    r = replay(meter.events)
    assert r.peak_requested_bytes == rep.peak_bytes, (r.peak_requested_bytes, rep.peak_bytes)
    assert r.peak_reserved_bytes >= r.peak_allocated_bytes >= rep.peak_bytes, r


def test_expandable_segments_grow_one_segment_by_pages():
    ex = {"expandable_segments": True}
    # 3 MiB maps one 20 MiB page; 16.5 MiB takes 16.5 of the free 17 (every remainder >= 512 B splits):
    # allocated counts the requests, 19.5 MiB, where the native allocator counted the whole 17 MiB block (20 MiB)
    r = replay(_events(("a", 1, 3 * MiB), ("a", 2, 33 * MiB // 2)), **ex)
    _check(r, allocated=39 * MiB // 2, reserved=20 * MiB, segments=1)
    # >= 10 MiB still maps 20 MiB pages: 11 MiB + 1 B reserves 20 MiB (native: a 12 MiB segment)
    _check(replay(_events(("a", 1, 11 * MiB + 1)), **ex), allocated=11 * MiB + 512, reserved=20 * MiB)
    # the fragmentation case: 4 MiB live at offset 4, free 4 MiB before it and a free 12 MiB tail; 14 MiB grows the
    # tail by one 20 MiB page (12 + 20 = 32 >= 14) instead of a new segment: 40 MiB reserved in one segment
    r = replay(_events(("a", 1, 4 * MiB), ("a", 2, 4 * MiB), ("f", 1, 4 * MiB), ("a", 3, 14 * MiB)), **ex)
    _check(r, allocated=18 * MiB, reserved=40 * MiB, segments=1)
    # freed blocks merge back into the tail, which then serves a larger request after growing by one page only
    r = replay(_events(("a", 1, 15 * MiB), ("f", 1, 15 * MiB), ("a", 2, 35 * MiB)), **ex)
    _check(r, allocated=35 * MiB, reserved=40 * MiB, segments=1)
