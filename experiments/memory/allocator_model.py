"""A replay of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, native backend, default
``PYTORCH_CUDA_ALLOC_CONF``) over a stream of storage allocations and frees, predicting what
``torch.cuda.max_memory_allocated`` and ``torch.cuda.max_memory_reserved`` would report for it.

The rules replayed (constants from ``c10/core/AllocatorConfig.h``; rules from ``DeviceCachingAllocator`` in
``CUDACachingAllocator.cpp``; the derivation with line-by-line references is in ``docs/gpu-memory-model.md``):

- ``round_size``: every request is rounded up to a multiple of ``kMinBlockSize`` = 512 bytes (at least 512);
  zero-byte requests take no memory;
- ``get_pool``: rounded sizes ≤ ``kSmallSize`` = 1 MiB go to the *small* pool, larger ones to the *large* pool;
  pools are per stream (a block freed on one stream is reused only by that stream);
- ``get_free_block``: the cached free block of the same pool and stream with the smallest size ≥ the request
  (ties: the lowest address; segments are numbered in creation order as a stand-in for addresses);
- ``get_allocation_size`` (a new segment, ``cudaMalloc``, when no cached block fits): 2 MiB (``kSmallBuffer``) for
  the small pool; 20 MiB (``kLargeBuffer``) for requests < 10 MiB (``kMinLargeAlloc``); larger requests rounded up
  to a multiple of 2 MiB (``kRoundLarge``);
- ``should_split``: a block larger than the request is split when the remainder is ≥ 512 bytes (small pool) or
  > 1 MiB (large pool; ``max_split_size`` is unlimited by default), otherwise the whole block is handed out (and
  counted as allocated);
- ``free_block``/``try_merge_blocks``: a freed block merges with free neighbours in its segment and is cached;
  segments are never returned (no ``empty_cache``), except on an out-of-memory retry when a device capacity is
  given: ``release_cached_blocks`` frees every cached segment that is entirely free, then the ``cudaMalloc`` is
  retried once.

With ``expandable_segments:True`` each pool and stream has one segment that grows by mapping pages (2 MiB for the
small pool, 20 MiB for the large one) at its end, merged with a free last block; every block splits when ≥ 512 bytes
remain; best fit passes over that last block when another cached block fits (it can grow).

Not modelled: ``max_split_size_mb``/``roundup_power2_divisions``/
``garbage_collection_threshold`` (all off by default), CUDA graph pools, and the delay ``record_stream`` adds
before a block used on another stream is reusable.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MiB = 2**20
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize
K_SMALL_SIZE = 1 * MiB  # kSmallSize: largest "small" allocation
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: segment of the small pool
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: segment for large requests below kMinLargeAlloc
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: rounding of larger segments

# (tick, +bytes for an allocation / -bytes for a free, storage key, device): experiments.memory.meter's event log
AllocEvent = tuple[int, int, int, str]


def round_size(nbytes: int) -> int:
    """``round_size``: the block size a request of ``nbytes`` occupies."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * -(-nbytes // K_MIN_BLOCK_SIZE)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc``'ed for a rounded request ``size`` no cached block fits."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)


def should_split(block_size: int, size: int) -> bool:
    """``should_split`` with the default (unlimited) ``max_split_size``."""
    remaining = block_size - size
    return remaining >= K_MIN_BLOCK_SIZE if size <= K_SMALL_SIZE else remaining > K_SMALL_SIZE


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    pool: tuple[int, bool]  # (stream, small)
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)  # BlockComparatorSize: size, then address


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    peak_allocated_bytes: int  # max_memory_allocated: sum of handed-out block sizes (rounded, unsplit remainders)
    peak_reserved_bytes: int  # max_memory_reserved: sum of segment sizes
    peak_requested_bytes: int  # the live bytes as requested (the meter's peak, for comparison)
    segments: int  # segments created (cudaMalloc calls)
    releases: int  # segments released by out-of-memory retries (capacity given)
    oom_tick: int | None  # the tick of the first allocation that did not fit the capacity (replay stops there)

    def to_dict(self) -> dict:
        return {"peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                "peak_requested_bytes": self.peak_requested_bytes, "segments": self.segments,
                "releases": self.releases, "oom_tick": self.oom_tick}


class _OutOfMemory(Exception):
    pass


class _Allocator:
    def __init__(self, capacity_bytes: int | None, expandable: bool) -> None:
        self.capacity = capacity_bytes
        self.expandable = expandable
        self.tail: dict[tuple[int, bool], _Block] = {}  # expandable: the last mapped block of each pool's segment
        self.pools: dict[tuple[int, bool], list[tuple[int, int, int]]] = {}
        self.cached: dict[tuple[int, int, int, tuple[int, bool]], _Block] = {}
        self.segment_heads: dict[int, tuple[_Block, int]] = {}  # segment -> (first block, segment size)
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.segments = self.releases = 0

    def _cache(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self.pools.setdefault(block.pool, []), block.key)
        self.cached[(*block.key, block.pool)] = block

    def _uncache(self, block: _Block) -> None:
        pool = self.pools[block.pool]
        del pool[bisect.bisect_left(pool, block.key)]
        del self.cached[(*block.key, block.pool)]

    def _new_segment(self, size: int, pool: tuple[int, bool]) -> _Block:
        seg_size = allocation_size(size)
        if self.capacity is not None and self.reserved + seg_size > self.capacity:
            self._release_free_segments()  # release_cached_blocks, then one retry
            if self.reserved + seg_size > self.capacity:
                raise _OutOfMemory
        self.segments += 1
        block = _Block(segment=self.segments, offset=0, size=seg_size, pool=pool, free=False)
        self.segment_heads[block.segment] = (block, seg_size)
        self.reserved += seg_size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _grow(self, size: int, pool: tuple[int, bool]) -> _Block:
        """``try_allocate_expandable_block``: map pages (2 MiB small pool, 20 MiB large; ``find_expandable_block``)
        at the end of the pool's one expandable segment, merged with a free tail, until ``size`` fits."""
        page = K_SMALL_BUFFER if pool[1] else K_LARGE_BUFFER
        tail = self.tail.get(pool)
        have = tail.size if tail is not None and tail.free else 0
        grow = page * -(-(size - have) // page)
        if self.capacity is not None and self.reserved + grow > self.capacity:
            raise _OutOfMemory  # (releasing free pages of an expandable segment is not modelled)
        self.reserved += grow
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if tail is None:
            self.segments += 1
            block = _Block(segment=self.segments, offset=0, size=grow, pool=pool, free=False)
        elif tail.free:
            self._uncache(tail)
            block, block.size, block.free = tail, tail.size + grow, False
        else:
            block = _Block(segment=tail.segment, offset=tail.offset + tail.size, size=grow, pool=pool, free=False,
                           prev=tail)
            tail.next = block
        self.tail[pool] = block
        return block

    def _release_free_segments(self) -> None:
        for segment, (head, seg_size) in list(self.segment_heads.items()):
            if head.free and head.size == seg_size:
                self._uncache(head)
                del self.segment_heads[segment]
                self.reserved -= seg_size
                self.releases += 1

    def malloc(self, nbytes: int, stream: int) -> _Block:
        size = round_size(nbytes)
        pool = (stream, size <= K_SMALL_SIZE)
        keys = self.pools.get(pool, [])
        i = bisect.bisect_left(keys, (size, -1, -1))
        if i + 1 < len(keys) and self.expandable and self.cached[(*keys[i], pool)] is self.tail.get(pool):
            i += 1  # get_free_block: the tail counts as big as it can grow; another fitting block is preferred
        if i < len(keys):
            block = self.cached[(*keys[i], pool)]
            self._uncache(block)
            block.free = False
        else:
            block = self._grow(size, pool) if self.expandable else self._new_segment(size, pool)
        if (block.size - size >= K_MIN_BLOCK_SIZE) if self.expandable else should_split(block.size, size):
            rest = _Block(segment=block.segment, offset=block.offset + size, size=block.size - size, pool=pool,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            if self.tail.get(pool) is block:
                self.tail[pool] = rest
            self._cache(rest)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:  # try_merge_blocks
                self._uncache(neighbour)
                if neighbour is block.prev:
                    block.offset, block.prev = neighbour.offset, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                    else:
                        self.segment_heads[block.segment] = (block, self.segment_heads[block.segment][1])
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                    if self.tail.get(block.pool) is neighbour:
                        self.tail[block.pool] = block
                block.size += neighbour.size
        self._cache(block)


def replay(events: Iterable[AllocEvent], *, prelude: Sequence[tuple[int, int]] = (),
           capacity_bytes: int | None = None, expandable_segments: bool = False) -> ReplayResult:
    """Replay ``events`` (in order) on one device's caching allocator, all on stream 0.

    ``prelude``: ``(bytes, stream)`` allocations made first and never freed (e.g. cuBLAS workspaces, which torch
    allocates through the caching allocator on each stream that runs a GEMM). ``capacity_bytes``: the memory the
    allocator may ``cudaMalloc`` in all (None: unlimited); a segment that would exceed it first releases the cached
    free segments, and if it still does not fit the replay stops with ``oom_tick`` set. ``expandable_segments``:
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (one growing segment per pool and stream)."""
    alloc = _Allocator(capacity_bytes, expandable_segments)
    live: dict[int, _Block] = {}
    requested = peak_requested = 0
    tick: int | None = -1
    try:
        for nbytes, stream in prelude:
            alloc.malloc(nbytes, stream)
            requested += nbytes
        peak_requested = requested
        for tick, delta, key, _device in events:
            if delta > 0:
                live[key] = alloc.malloc(delta, 0)
                requested += delta
                peak_requested = max(peak_requested, requested)
            elif delta < 0 and key in live:
                alloc.free(live.pop(key))
                requested += delta
        tick = None
    except _OutOfMemory:
        pass
    return ReplayResult(peak_allocated_bytes=alloc.peak_allocated, peak_reserved_bytes=alloc.peak_reserved,
                        peak_requested_bytes=peak_requested, segments=alloc.segments, releases=alloc.releases,
                        oom_tick=tick)
