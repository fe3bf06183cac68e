"""Codecs for tensors saved for backward: blockwise INT8, blockwise FP8, outlier-aware INT4/INT8.

Every codec is a pure ``Tensor -> Tensors`` function registered as a ``torch.library.custom_op`` with a fake
(meta) implementation, so output shapes depend only on input shapes and FakeTensorMode traces work. The blockwise
INT8/FP8 ops run bit-identical Triton kernels (``hmt_core.kernels.quant``) when ``hmt_core.kernels.use_triton``
says so (CUDA tensors under the default ``"auto"`` backend), else the PyTorch code below.

Blockwise absmax (CompAct-style storage of a compressed activation; HMT design, "BlockwiseInt8Compressor"):
the flattened tensor is cut into blocks of ``B`` elements (zero-padded at the tail), and per block
    s_b = max_i |x_i| / q_max,   q_i = round(x_i / s_b),   x^_i = q_i * s_b            (q_max = 127 for INT8)
FP8 uses the same per-block scale with q_max = the format's largest finite value (448 for e4m3, 57344 for
e5m2) and stores ``x / s_b`` cast to ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``.

Outlier-aware compression after Adacc (Chen et al. 2025, arXiv:2508.00806, Sec. "outlier-separated activation
compression"): with channels = last dim and m_c = max_rows |x[:, c]|, a channel is an outlier when
    z_c = (m_c - mean(m)) / std(m) > z_threshold   (default 3);
outlier channels are kept in BF16 together with their indices and the rest is quantized to INT4 (two codes per
byte) or INT8. Per block the quantizer is symmetric when the block holds both signs and asymmetric (min/max)
when it is one-sided, as Adacc does by sign distribution (we decide per block, a finer grain than per tensor):
    symmetric:  s = absmax / (2^(b-1) - 1),  code = round(x / s) + 2^(b-1),  x^ = code * s - 2^(b-1) * s
    asymmetric: s = (max - min) / (2^b - 1),  code = round((x - min) / s),   x^ = code * s + min
To keep shapes static the number of outlier slots is fixed, k = ceil(max_outlier_frac * channels): the top-k
channels by z are stored, and a slot whose z is not above the threshold is marked invalid (its channel is
quantized like the rest). Index encoding: idx >= 0 valid, ``-1 - idx`` invalid.

Non-finite input (NaN/Inf) is encoded, not refused, and without a host synchronization: a block holding one has
scale NaN (and offset NaN) and codes 0, so it decodes to NaN — the non-finite value propagates into backward as it
would from a BF16 copy (spread over its block), the gradients are non-finite and the optimizer skips the step on the
device (docs/host_syncs.md). The flag is taken from the per-block statistics, not a second pass over the data.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from hmt_core import kernels as _kernels

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def outlier_slots(channels: int, max_outlier_frac: float) -> int:
    return min(channels, max(1, math.ceil(max_outlier_frac * channels)))


def _check_block(block: int) -> None:
    if block <= 0:
        raise ValueError(f"block_size must be > 0, got {block}")


def _blocks(x: Tensor, block: int) -> Tensor:
    # x: (...)  ->  (nb, block) float32, zero-padded tail
    flat = x.detach().reshape(-1).float()
    pad = num_blocks(flat.numel(), block) * block - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block)


def _divided(xb: Tensor, x: Tensor, scale: Tensor) -> Tensor:  # xb: (nb, block) = _blocks(x); scale: (nb,)
    """xb / scale per block, in place where ``_blocks`` made a copy (a narrower ``x``, or a padded tail): one
    weight-sized fp32 allocation less per encode."""
    copied = x.dtype != torch.float32 or xb.numel() != x.numel()
    return xb.div_(scale[:, None]) if copied else xb / scale[:, None]


def _absmax(xb: Tensor) -> Tensor:  # xb: (nb, block) -> (nb,) max |x| per block, NaN where a block holds one
    return torch.maximum(xb.amax(dim=1), -xb.amin(dim=1))  # two reductions, no |x| temporary (the ∞-norm
    # reduction, one op, takes ~15x as long on CPU)


def _nonfinite_blocks(absmax: Tensor) -> Tensor:  # absmax: (nb,) ≥ 0, +Inf or NaN per block -> (nb,) bool
    return torch.lt(absmax, math.inf).logical_not_()  # not (a < ∞): two ops (~isfinite: abs, ne, eq, mul, not)


def _scale(absmax: Tensor, qmax: float, bad: Tensor) -> Tensor:  # absmax, bad: (nb,) -> (nb,) fp32
    """absmax / qmax per block; 1 for an all-zero block, NaN for a non-finite one (``bad``)."""
    return _kernels.div_rn(absmax, qmax).masked_fill_(absmax == 0, 1.0).masked_fill_(bad, math.nan)


def _unblock(xb: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    # xb: (nb, block) float32 -> shape, dtype
    n = math.prod(shape)
    return xb.reshape(-1)[:n].view(shape).to(dtype)


# ----------------------------------------------------------------------------------------------- INT8 blockwise
@torch.library.custom_op("hmt::int8_block_quant", mutates_args=())
def int8_block_quant(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    # x: (...)  ->  q: (nb, block) int8, scale: (nb,) float32,  nb = ceil(numel / block)
    _check_block(block)
    if _kernels.use_triton(x):  # bit-identical Triton kernel (hmt_core.kernels.quant)
        from hmt_core.kernels import quant  # imports triton: only where a Triton kernel runs (here and below)
        return quant.int8_block_quant(x, block)
    xb = _blocks(x, block)
    absmax = _absmax(xb)
    bad = _nonfinite_blocks(absmax)
    scale = _scale(absmax, 127.0, bad)
    q = _divided(xb, x, scale).round_().masked_fill_(bad[:, None], 0.0).to(torch.int8)  # |x / s| <= 127 by
    return q, scale  # construction of s; a non-finite block: codes 0, scale NaN (decodes to NaN)


@int8_block_quant.register_fake
def _(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    nb = num_blocks(x.numel(), block)
    return x.new_empty((nb, block), dtype=torch.int8), x.new_empty((nb,), dtype=torch.float32)


@torch.library.custom_op("hmt::int8_block_dequant", mutates_args=())
def int8_block_dequant(q: Tensor, scale: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    # q: (nb, block) int8, scale: (nb,)  ->  x^: shape, dtype
    if _kernels.use_triton(q, scale):
        from hmt_core.kernels import quant
        return quant.int8_block_dequant(q, scale, shape, dtype)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)  # int8 * f32, computed in f32, rounded once to dtype:
    return _unblock(torch.mul(q, scale[:, None], out=out), shape, dtype)  # one pass, no f32 temporary


@int8_block_dequant.register_fake
def _(q: Tensor, scale: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    return q.new_empty(shape, dtype=dtype)


# ------------------------------------------------------------------------------------------------ FP8 blockwise
@torch.library.custom_op("hmt::fp8_block_quant", mutates_args=())
def fp8_block_quant(x: Tensor, block: int, fmt: str) -> tuple[Tensor, Tensor]:
    # x: (...)  ->  q: (nb, block) float8 (e4m3fn | e5m2), scale: (nb,) float32
    _check_block(block)
    fp8 = FP8_DTYPES[fmt]
    if _kernels.use_triton(x):
        from hmt_core.kernels import quant
        return quant.fp8_block_quant(x, block, fmt)
    xb = _blocks(x, block)
    absmax = _absmax(xb)
    bad = _nonfinite_blocks(absmax)
    scale = _scale(absmax, torch.finfo(fp8).max, bad)
    q = _divided(xb, x, scale).clamp_(-torch.finfo(fp8).max, torch.finfo(fp8).max).masked_fill_(bad[:, None], 0.0)
    return q.to(fp8), scale  # a non-finite block: codes 0, scale NaN (decodes to NaN)


@fp8_block_quant.register_fake
def _(x: Tensor, block: int, fmt: str) -> tuple[Tensor, Tensor]:
    nb = num_blocks(x.numel(), block)
    return x.new_empty((nb, block), dtype=FP8_DTYPES[fmt]), x.new_empty((nb,), dtype=torch.float32)


@torch.library.custom_op("hmt::fp8_block_dequant", mutates_args=())
def fp8_block_dequant(q: Tensor, scale: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    # q: (nb, block) float8, scale: (nb,)  ->  x^: shape, dtype
    if _kernels.use_triton(q, scale):
        from hmt_core.kernels import quant
        return quant.fp8_block_dequant(q, scale, shape, dtype)
    return _unblock(q.float() * scale[:, None], shape, dtype)


@fp8_block_dequant.register_fake
def _(q: Tensor, scale: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    return q.new_empty(shape, dtype=dtype)


# --------------------------------------------------------------------------------------- outlier-aware INT4/INT8
def _rows_channels(shape: list[int]) -> tuple[int, int]:
    channels = shape[-1] if len(shape) else 1
    return (math.prod(shape) // channels if channels else 0), channels


@torch.library.custom_op("hmt::outlier_quant", mutates_args=())
def outlier_quant(
    x: Tensor, bits: int, block: int, z_threshold: float, slots: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # x: (..., c)  ->  codes: (nb, block*bits/8) uint8, scale: (nb,) f32, offset: (nb,) f32,
    #                  outliers: (rows, slots) bf16, idx: (slots,) int64   (idx < 0: slot unused)
    _check_block(block)
    if bits not in (4, 8) or block * bits % 8:
        raise ValueError(f"outlier_quant: bits must be 4 or 8 and block_size*bits a multiple of 8, got {bits}, {block}")
    rows, c = _rows_channels(list(x.shape))
    x2 = x.detach().reshape(rows, c).float()
    m = x2.abs().amax(dim=0) if rows else x2.new_zeros(c)  # (c,): non-finite m gives z = 0, no outlier slot
    std = m.std(correction=0) if c > 1 else m.new_zeros(())
    z = torch.where(std > 0, (m - m.mean()) / std.clamp_min(1e-30), torch.zeros_like(m))
    ztop, idx = torch.topk(z, slots)
    valid = ztop > z_threshold
    outliers = x2[:, idx].to(torch.bfloat16)  # (rows, slots)
    drop = torch.zeros(c, dtype=torch.bool, device=x2.device).scatter_(0, idx, valid)  # (c,): no mask indexing,
    rest = torch.where(drop, x2.new_zeros(()), x2) if rows else x2  # which would wait for the device (nonzero)
    xb = _blocks(rest, block)  # (nb, block)
    lo, hi = xb.amin(dim=1), xb.amax(dim=1)
    asym = (lo >= 0) | (hi <= 0)
    half = 2 ** (bits - 1)
    absmax = torch.maximum(lo.abs(), hi.abs())
    bad = _nonfinite_blocks(absmax)  # a non-finite block: codes 0, scale and offset NaN (decodes to NaN)
    scale = torch.where(asym, _kernels.div_rn(hi - lo, 2**bits - 1), _kernels.div_rn(absmax, half - 1))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).masked_fill_(bad, math.nan)
    offset = torch.where(asym, lo, -half * scale)
    codes = torch.round((xb - offset[:, None]) / scale[:, None]).clamp_(0, 2**bits - 1)
    codes = codes.masked_fill_(bad[:, None], 0.0).to(torch.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes, scale, offset, outliers, torch.where(valid, idx, -1 - idx)


@outlier_quant.register_fake
def _(x: Tensor, bits: int, block: int, z_threshold: float, slots: int):
    rows, _ = _rows_channels(list(x.shape))
    nb = num_blocks(x.numel(), block)
    return (
        x.new_empty((nb, block * bits // 8), dtype=torch.uint8),
        x.new_empty((nb,), dtype=torch.float32),
        x.new_empty((nb,), dtype=torch.float32),
        x.new_empty((rows, slots), dtype=torch.bfloat16),
        x.new_empty((slots,), dtype=torch.int64),
    )


@torch.library.custom_op("hmt::outlier_dequant", mutates_args=())
def outlier_dequant(
    codes: Tensor, scale: Tensor, offset: Tensor, outliers: Tensor, idx: Tensor, bits: int,
    shape: list[int], dtype: torch.dtype,
) -> Tensor:
    # codes: (nb, block*bits/8) uint8 ... idx: (slots,)  ->  x^: shape, dtype
    if bits == 4:
        codes = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(codes.shape[0], -1)
    xb = codes.float() * scale[:, None] + offset[:, None]
    rows, c = _rows_channels(shape)
    x2 = xb.reshape(-1)[: rows * c].view(rows, c).clone()
    valid = idx >= 0
    cols = torch.where(valid, idx, -1 - idx)
    x2[:, cols] = torch.where(valid, outliers.float(), x2[:, cols])
    return x2.view(shape).to(dtype)


@outlier_dequant.register_fake
def _(codes, scale, offset, outliers, idx, bits, shape, dtype):
    return codes.new_empty(shape, dtype=dtype)


# ----------------------------------------------------------------------------------- action-level encode/decode
class Packed(NamedTuple):
    """A compressed saved tensor: codec name, its tensors, and what is needed to rebuild the original."""

    codec: str
    tensors: tuple[Tensor, ...]
    shape: list[int]
    dtype: torch.dtype
    bits: int = 0


def encode(
    x: Tensor, codec: str, *, block: int, fp8_format: str = "e4m3", z_threshold: float = 3.0,
    max_outlier_frac: float = 1 / 32,
) -> Packed:
    """x: (...) floating -> Packed. ``codec`` in {"int8", "fp8", "int4_outlier", "int8_outlier"}."""
    shape = list(x.shape)
    if codec == "int8":
        return Packed(codec, int8_block_quant(x, block), shape, x.dtype)
    if codec == "fp8":
        return Packed(codec, fp8_block_quant(x, block, fp8_format), shape, x.dtype)
    if codec in ("int4_outlier", "int8_outlier"):
        bits = 4 if codec == "int4_outlier" else 8
        slots = outlier_slots(_rows_channels(shape)[1], max_outlier_frac)
        return Packed(codec, outlier_quant(x, bits, block, z_threshold, slots), shape, x.dtype, bits)
    raise ValueError(f"unknown codec {codec!r}")


def decode(p: Packed) -> Tensor:
    if p.codec == "int8":
        return int8_block_dequant(*p.tensors, p.shape, p.dtype)
    if p.codec == "fp8":
        return fp8_block_dequant(*p.tensors, p.shape, p.dtype)
    return outlier_dequant(*p.tensors, p.bits, p.shape, p.dtype)


def packed_nbytes(p: Packed) -> int:
    return sum(t.numel() * t.element_size() for t in p.tensors)
