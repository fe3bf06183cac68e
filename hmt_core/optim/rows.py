"""How the optimizer splits a weight's rows: a rank's share under FSDP2's ``Shard(0)`` (``rank_rows``) and
memory-bounded chunks of rows (``row_spans``, sized by ``hmt_core.precision.chunk_rows_for``)."""

from __future__ import annotations


def rank_rows(rows: int, world: int, rank: int) -> slice:
    """Rows [a, b) of ``rank`` when ``rows`` are cut like ``torch.chunk`` (FSDP2's ``Shard(0)``): ⌈rows/W⌉ each,
    the last ranks shorter or empty."""
    size = -(-rows // world)
    a = min(rank * size, rows)
    return slice(a, min(a + size, rows))


def row_spans(rows: int, chunk: int) -> list[slice]:
    """[0, rows) in consecutive slices of ``chunk`` rows (the last one shorter)."""
    return [slice(a, min(a + chunk, rows)) for a in range(0, rows, chunk)]
