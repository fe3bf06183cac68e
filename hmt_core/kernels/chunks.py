"""The one row-chunk rule of every chunked update (stochastic-rounding and INT8 writes, the fused update's fallback,
Mode B, large dense weights): rows of a temporary that fit one chunk of ``chunk_budget`` bytes, larger on CUDA
(``hmt_core.kernels.on_cuda``). Re-exported by ``hmt_core.precision``."""

from __future__ import annotations

from typing import Any

import torch

from hmt_core import kernels

# Row-chunk budgets (bytes of one chunk of an update's temporaries: stochastic-rounding and INT8 writes, the fused
# update's fallback, Mode B, large dense weights). The host's is sized for CPU memory; on CUDA a 16 MiB chunk is
# streamed in ~10 µs at HBM bandwidth, no longer than its kernels' launch overhead, so CUDA chunks are 4x larger
# (a 7B MLP weight in 3 chunks instead of 11; docs/kernels.md).
CHUNK_BYTES = 16 << 20
CUDA_CHUNK_BYTES = 64 << 20


def chunk_budget(like: Any = None) -> int:
    """Bytes of one row chunk for tensors like ``like``: ``CUDA_CHUNK_BYTES`` on CUDA (fake tensors standing for
    CUDA ones in a ``dryrun.device=cuda`` trace included, ``hmt_core.kernels.on_cuda``), else ``CHUNK_BYTES``."""
    return CUDA_CHUNK_BYTES if like is not None and kernels.on_cuda(like) else CHUNK_BYTES


def chunk_rows_for(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, chunk_bytes: int = 0, *,
                   like: Any = None) -> int:
    """Rows of a (rows, ...) temporary of ``dtype`` that fit one chunk (``chunk_bytes``, 0: ``chunk_budget(like)``);
    the one row-chunk rule of every chunked update."""
    row_bytes = (int(torch.Size(shape).numel()) // max(1, shape[0])) * dtype.itemsize if shape and shape[0] else 1
    return max(1, (chunk_bytes or chunk_budget(like)) // max(1, row_bytes))
