"""Triton kernels for blockwise absmax INT8 / FP8 (de)quantization (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"), bit-identical to the PyTorch reference ops in ``hmt_core.activations.codecs``:

    s_b = max_i |x_i| / q_max  (1 if the block is all zero),   q_i = round_half_even(x_i / s_b)  (INT8, q_max=127)
    q_i = fp8_rne(clamp(x_i / s_b, ±q_max))  (FP8 e4m3fn q_max=448, e5m2 q_max=57344),      x^_i = q_i · s_b

Bit-exactness does not rely on Triton's float conversions (the interpreter's fp32→bf16/fp8 casts do not round
to nearest even): divisions use ``div_rn`` (IEEE), rounding to an integer uses floor plus a tie fix, and
fp32→fp8 / fp32→bf16 are computed on the bit patterns exactly as c10's ``fp8e4m3fn_from_fp32_value`` /
``fp8e5m2_from_fp32_value`` / ``round_to_nearest_even`` do. bf16 tensors are read and written through int16
views; fp8 codes are decoded through a 256-entry table built by torch itself. Non-finite input marks the
block's scale NaN and its codes 0, like the reference (it decodes to NaN; no host check).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# per format: (q_max, min-normal fp32 bits, denormal-trick constant, exponent re-bias, round constant, shift)
_FP8 = {"e4m3": (448.0, 121 << 23, 16384.0, 141 << 23, (7 - 127) << 23, 0x7FFFF, 20),
        "e5m2": (57344.0, 113 << 23, 128.0, 134 << 23, (15 - 127) << 23, 0xFFFFF, 21)}
_IN_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# ------------------------------------------------------------------------------------------- bit-level helpers
@triton.jit
def bf16_bits_to_f32(h):  # h: int16 tile (bf16 bit patterns) -> float32 tile, exact
    return ((h.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):  # x: float32 tile -> int16 bf16 bit patterns, round-to-nearest-even, NaN -> 0x7FC0
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, r).to(tl.int16)


@triton.jit
def load_f32(ptr, offs, mask, KIND: tl.constexpr):  # KIND 0: fp32, 1: bf16 via int16 view, 2: fp16
    v = tl.load(ptr + offs, mask=mask, other=0)
    if KIND == 1:
        return bf16_bits_to_f32(v)
    return v.to(tl.float32)


@triton.jit
def store_f32(ptr, offs, x, mask, KIND: tl.constexpr):  # KIND as in load_f32; rounds to nearest even
    if KIND == 1:
        tl.store(ptr + offs, f32_to_bf16_bits(x), mask=mask)
    elif KIND == 2:
        tl.store(ptr + offs, x.to(tl.float16), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _round_half_even(y):  # y: float32 tile, |y| < 2^22 -> nearest integer (ties to even), as torch.round
    f = tl.floor(y)
    d = y - f  # exact
    up = (d > 0.5) | ((d == 0.5) & (f - 2.0 * tl.floor(f * 0.5) != 0.0))
    return tl.where(up, f + 1.0, f)


@triton.jit
def _fp8_bits(y, MIN_NORMAL: tl.constexpr, DENORM_F: tl.constexpr, DENORM_BITS: tl.constexpr,
              REBIAS: tl.constexpr, ROUND: tl.constexpr, SHIFT: tl.constexpr):
    # y: float32 tile, finite, |y| <= q_max -> int32 fp8 bit patterns (c10's fp8*_from_fp32_value)
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    sub = (a.to(tl.float32, bitcast=True) + DENORM_F).to(tl.int32, bitcast=True) - DENORM_BITS
    nrm = (a + REBIAS + ROUND + ((a >> SHIFT) & 1)) >> SHIFT
    return tl.where(a < MIN_NORMAL, sub, nrm) | sign


# ------------------------------------------------------------------------------------------------- quantize
@triton.jit
def _block_quant_kernel(x_ptr, q_ptr, s_ptr, numel, nb, block,  # x: (numel,), q: (nb, block), s: (nb,)
                        QMAX: tl.constexpr, FP8: tl.constexpr, KIND: tl.constexpr,
                        MIN_NORMAL: tl.constexpr, DENORM_F: tl.constexpr, DENORM_BITS: tl.constexpr,
                        REBIAS: tl.constexpr, ROUND: tl.constexpr, SHIFT: tl.constexpr,
                        ROWS: tl.constexpr, CHUNK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,) block indices
    row_ok = rows < nb
    base = rows.to(tl.int64) * block
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    bad = tl.zeros((ROWS,), dtype=tl.float32)
    for c0 in range(0, block, CHUNK):  # pass 1: absmax and a non-finite flag per block
        cols = c0 + tl.arange(0, CHUNK)
        idx = base[:, None] + cols[None, :]
        m = row_ok[:, None] & (cols[None, :] < block) & (idx < numel)
        ax = tl.abs(load_f32(x_ptr, idx, m, KIND))
        amax = tl.maximum(amax, tl.max(tl.where(m, ax, 0.0), axis=1))
        bad = tl.maximum(bad, tl.max(tl.where(ax < float("inf"), 0.0, 1.0), axis=1))  # NaN and Inf -> 1
    scale = tl.where(amax > 0, tl.math.div_rn(amax, QMAX), 1.0)
    scale = tl.where(bad > 0, float("nan"), scale)
    tl.store(s_ptr + rows, scale, mask=row_ok)
    for c0 in range(0, block, CHUNK):  # pass 2: codes (the zero-padded tail of the last block included)
        cols = c0 + tl.arange(0, CHUNK)
        idx = base[:, None] + cols[None, :]
        col_ok = row_ok[:, None] & (cols[None, :] < block)
        y = tl.math.div_rn(load_f32(x_ptr, idx, col_ok & (idx < numel), KIND), scale[:, None])
        y = tl.where(bad[:, None] > 0, 0.0, y)  # a non-finite block: codes 0 (and scale NaN), as the reference
        if FP8:
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            code = _fp8_bits(y, MIN_NORMAL, DENORM_F, DENORM_BITS, REBIAS, ROUND, SHIFT).to(tl.uint8)
        else:
            code = _round_half_even(y).to(tl.int8)
        tl.store(q_ptr + idx, code, mask=col_ok)


def _geometry(block: int) -> tuple[int, int]:
    chunk = min(triton.next_power_of_2(block), 2048)
    return max(1, 2048 // chunk), chunk


def _as_kernel_input(x: Tensor) -> tuple[Tensor, int]:
    x = x.detach()
    if x.dtype not in _IN_KIND:
        x = x.float()  # same rounding as the reference's .float()
    kind = _IN_KIND[x.dtype]
    x = x.contiguous().reshape(-1)
    return (x.view(torch.int16) if kind == 1 else x), kind


def _quant(x: Tensor, block: int, fmt: str | None) -> tuple[Tensor, Tensor]:
    # x: (...) -> q: (nb, block) int8 | float8, scale: (nb,) float32
    numel = x.numel()
    nb = -(-numel // block)
    dtype = torch.int8 if fmt is None else FP8_DTYPES[fmt]
    q = torch.empty((nb, block), dtype=dtype, device=x.device)
    scale = torch.empty((nb,), dtype=torch.float32, device=x.device)
    if nb == 0:
        return q, scale
    flat, kind = _as_kernel_input(x)
    qmax, min_normal, denorm_f, denorm_bits, rebias, rnd, shift = _FP8[fmt or "e4m3"]
    rows, chunk = _geometry(block)
    _block_quant_kernel[(triton.cdiv(nb, rows),)](
        flat, q.view(torch.uint8) if fmt else q, scale, numel, nb, block,
        QMAX=127.0 if fmt is None else qmax, FP8=fmt is not None, KIND=kind, MIN_NORMAL=min_normal,
        DENORM_F=denorm_f, DENORM_BITS=denorm_bits, REBIAS=rebias, ROUND=rnd, SHIFT=shift, ROWS=rows, CHUNK=chunk)
    return q, scale  # a non-finite block: scale NaN, codes 0 (no host check: it would synchronize)


def int8_block_quant(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    # x: (...) -> q: (nb, block) int8, scale: (nb,) float32
    return _quant(x, block, None)


def fp8_block_quant(x: Tensor, block: int, fmt: str) -> tuple[Tensor, Tensor]:
    # x: (...) -> q: (nb, block) float8_e4m3fn | float8_e5m2, scale: (nb,) float32
    return _quant(x, block, fmt)


# ----------------------------------------------------------------------------------------------- dequantize
@triton.jit
def _block_dequant_kernel(q_ptr, s_ptr, lut_ptr, out_ptr, numel, block,  # q: (nb, block), s: (nb,), out: (numel,)
                          FP8: tl.constexpr, KIND: tl.constexpr, TILE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    m = offs < numel
    s = tl.load(s_ptr + offs // block, mask=m, other=1.0)
    code = tl.load(q_ptr + offs, mask=m, other=0)
    if FP8:
        v = tl.load(lut_ptr + code.to(tl.int32), mask=m, other=0.0)  # exact fp8 -> fp32 (torch's table)
    else:
        v = code.to(tl.float32)
    store_f32(out_ptr, offs, v * s, m, KIND)


_LUTS: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _fp8_lut(dtype: torch.dtype, device: torch.device) -> Tensor:
    key = (dtype, device)
    if key not in _LUTS:
        _LUTS[key] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().to(device)
    return _LUTS[key]


def _dequant(q: Tensor, scale: Tensor, shape: list[int], dtype: torch.dtype, fp8: bool) -> Tensor:
    # q: (nb, block), scale: (nb,) -> x^: shape, dtype
    numel = 1
    for d in shape:
        numel *= d
    kdtype = dtype if dtype in _IN_KIND else torch.float32
    out = torch.empty(numel, dtype=kdtype, device=q.device)
    if numel:
        kind = _IN_KIND[kdtype]
        lut = _fp8_lut(q.dtype, q.device) if fp8 else scale
        tile = 1024
        _block_dequant_kernel[(triton.cdiv(numel, tile),)](
            q.contiguous().view(torch.uint8) if fp8 else q.contiguous(), scale.contiguous(), lut,
            out.view(torch.int16) if kind == 1 else out, numel, q.shape[1], FP8=fp8, KIND=kind, TILE=tile)
    return out.view(shape).to(dtype)


def int8_block_dequant(q: Tensor, scale: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    # q: (nb, block) int8, scale: (nb,) float32 -> x^: shape, dtype
    return _dequant(q, scale, shape, dtype, fp8=False)


def fp8_block_dequant(q: Tensor, scale: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    # q: (nb, block) float8, scale: (nb,) float32 -> x^: shape, dtype
    return _dequant(q, scale, shape, dtype, fp8=True)
