"""Tracing the planner's missing cost samples: in this process, or over worker processes when they are long.

A cost sample is one dry-run trace (``experiments.planner.costs.trace_sample``) of a 1- or 2-layer model at full
width; at 7B width each takes seconds, and a shape without a committed cost table needs about 150 of them. Each trace
is independent and deterministic (a fake-tensor trace counts bytes, it computes nothing; ``trace_steps`` seeds its
own generator), so the same sample traced in another process gives the same bytes. The first missing sample is
traced here; if it took long enough that the rest would take over ``PARALLEL_MIN_S`` seconds, the rest go to
``workers`` spawned processes (each pays one import of torch and transformers), else they are traced here too.
Results are handed back one by one as they finish, so the caller caches each at once.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed

PARALLEL_MIN_S = 30.0  # below this much remaining tracing, starting processes (imports: ~5-10 s each) does not pay
MAX_WORKERS = 8  # each worker holds torch, transformers and a fake model: ~1 GiB of host memory


def default_workers() -> int:
    """The CPUs this process may run on, at most ``MAX_WORKERS``."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def trace_points(points: list[tuple[str, object]], trace: Callable[[object], dict], *, workers: int,
                 ready: Callable[[str], object] = lambda key: None) -> Iterator[tuple[str, dict]]:
    """``(key, trace(run))`` for each ``(key, run)`` of ``points``, as each finishes. ``ready(key)`` is called
    before a trace starts here (the cost table's lookup: a time-bounded table raises there to stop); with workers,
    before each is handed to them. ``trace`` must be a module-level function when workers are used."""
    if not points:
        return
    key, run = points[0]
    ready(key)
    start = time.perf_counter()
    yield key, trace(run)
    rest, first_s = points[1:], time.perf_counter() - start
    if workers <= 1 or len(rest) < 2 or first_s * len(rest) < PARALLEL_MIN_S:
        for key, run in rest:
            ready(key)
            yield key, trace(run)
        return
    yield from _pooled(rest, trace, min(workers, len(rest)), ready)


def _pooled(points: list[tuple[str, object]], trace, workers: int, ready) -> Iterator[tuple[str, dict]]:
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {}
        for key, run in points:
            ready(key)
            futures[pool.submit(trace, run)] = key
        for future in as_completed(futures):
            yield futures[future], future.result()
    finally:  # an interrupted caller keeps what finished; queued traces are dropped
        pool.shutdown(wait=True, cancel_futures=True)
