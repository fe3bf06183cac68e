"""Triton kernel: dequantization of an INT8 weight with one scale per block of ``block`` consecutive elements of a
row (Q-GaLore's weight format, Zhang et al., 2024, §3.3, symmetric here; ``hmt_core.int8_weights``):

    W^[i, j] = q[i, j] · s[i, ⌊j / block⌋]      q: (rows, cols) int8, s: (rows, ⌈cols / block⌉) fp32

computed in fp32 (one IEEE rounding) and stored in the output dtype by round-to-nearest-even, bit-identical to the
PyTorch fallback ``hmt_core.int8_weights.codec.dequantize_torch`` (the bf16 store works on the bit pattern,
``quant.store_f32``, since the interpreter's fp32→bf16 cast does not round to nearest even). Rows are independent,
so any row slice of a weight (an optimizer's row chunk) is dequantized by the same kernel.

``update_`` fuses an optimizer's write into one pass (Q-GaLore's update in high precision, then requantization by
stochastic rounding): dequantize, ``W ← W − c·U`` with decoupled weight decay, the block absmax and scale, and the
stochastic rounding ``⌊y⌋ + [u < f·2¹⁶ − 2¹⁵]`` from pre-drawn int16 noise u (the draws the PyTorch fallback
``codec.int8_update_torch`` makes from the same generator), instead of ~25 kernels per row chunk. One program per
(row tile, scale block): the block's absmax is a reduction inside the tile. Equal to the fallback up to the
fp32 rounding of ``W − c·U`` (a fused multiply-add on some CPUs' fallback, not in the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hmt_core.kernels.quant import _IN_KIND, store_f32


@triton.jit
def _weight_dequant_kernel(q_ptr, s_ptr, out_ptr, rows, cols, nb, block,  # q: (rows, cols), s: (rows, nb)
                           KIND: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    r = (tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)).to(tl.int64)
    c = (tl.program_id(1) * TILE_C + tl.arange(0, TILE_C)).to(tl.int64)
    m = (r[:, None] < rows) & (c[None, :] < cols)
    offs = r[:, None] * cols + c[None, :]
    code = tl.load(q_ptr + offs, mask=m, other=0)
    s = tl.load(s_ptr + r[:, None] * nb + (c // block)[None, :], mask=m, other=1.0)
    store_f32(out_ptr, offs, code.to(tl.float32) * s, m, KIND)


def dequant(q: Tensor, scale: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    # q: (rows, cols) int8, scale: (rows, nb) fp32 -> (rows, cols) dtype
    rows, cols = q.shape
    kdtype = dtype if dtype in _IN_KIND else torch.float32
    out = torch.empty((rows, cols), dtype=kdtype, device=q.device)
    if rows and cols:
        kind = _IN_KIND[kdtype]
        tile_r, tile_c = 16, 128
        grid = (triton.cdiv(rows, tile_r), triton.cdiv(cols, tile_c))
        _weight_dequant_kernel[grid](q.contiguous(), scale.contiguous(), out.view(torch.int16) if kind == 1 else out,
                                     rows, cols, scale.shape[1], block, KIND=kind, TILE_R=tile_r, TILE_C=tile_c)
    return out if kdtype == dtype else out.to(dtype)


@triton.jit
def _update_kernel(q_ptr, s_ptr, u_ptr, n_ptr, rows, cols, nb, block, s_um, step, keep, decay,
                   # q: (rows, cols) int8 and s: (rows, nb) fp32, in place; u: (rows, cols) fp32; n: int16 noise
                   DECAY_AFTER: tl.constexpr, HAS_DECAY: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    r = (tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)  # one scale block per program: its absmax is a row reduction of the tile
    j = tl.arange(0, TILE_C)
    c = k * block + j
    m = (r[:, None] < rows) & (c[None, :] < cols) & (j[None, :] < block)
    offs = r[:, None] * cols + c[None, :]
    s = tl.load(s_ptr + r * nb + k, mask=r < rows, other=1.0)
    w = tl.load(q_ptr + offs, mask=m, other=0).to(tl.float32) * s[:, None]  # dequantize: one rounding
    u = tl.load(u_ptr + r[:, None] * s_um + c[None, :], mask=m, other=0.0)
    if DECAY_AFTER:  # hf: W ← W − s·U, then W ← W − ηλ·W
        w = w + step * u
        if HAS_DECAY:
            w = w + decay * w
    else:  # torch: W ← (1 − ηλ)·W, then W ← W − s·U
        if HAS_DECAY:
            w = w * keep
        w = w + step * u
    absmax = tl.max(tl.where(m, tl.abs(w), 0.0), axis=1)  # (TILE_R,)
    scale = tl.where(absmax > 0, tl.math.div_rn(absmax, 127.0), 1.0)
    y = tl.math.div_rn(w, scale[:, None])
    low = tl.floor(y)
    threshold = (y - low) * 65536.0 - 32768.0  # f·2¹⁶ − 2¹⁵ (precision.stochastic_round_int)
    noise = tl.load(n_ptr + offs, mask=m, other=0).to(tl.float32)
    code = tl.minimum(tl.maximum(low + tl.where(noise < threshold, 1.0, 0.0), -127.0), 127.0)
    tl.store(q_ptr + offs, code.to(tl.int8), mask=m)
    tl.store(s_ptr + r * nb + k, scale, mask=r < rows)


def update_(codes: Tensor, scales: Tensor, update: Tensor, noise: Tensor, block: int, *, step_size: float,
            decay: float, decay_after: bool) -> None:
    """codes: (rows, cols) int8 and scales: (rows, nb) fp32, row-contiguous, updated in place; update: (rows, cols)
    fp32 (unit column stride); noise: (rows, cols) int16. Dequantize, apply W − step_size·U with decoupled decay,
    requantize by stochastic rounding: one pass over the rows (``codec.int8_update_torch``'s arithmetic)."""
    rows, cols = codes.shape
    if not (rows and cols):
        return
    if codes.stride() != (cols, 1) or scales.stride() != (scales.shape[1], 1) or update.stride(1) != 1:
        raise ValueError("int8 update kernel: codes and scales must be row-contiguous, the update unit-stride in cols")
    tile_c = triton.next_power_of_2(block)
    tile_r = max(1, min(16, 4096 // tile_c))
    grid = (triton.cdiv(rows, tile_r), scales.shape[1])
    _update_kernel[grid](codes, scales, update, noise.contiguous(), rows, cols, scales.shape[1], block,
                         update.stride(0), -float(step_size), 1.0 - float(decay), -float(decay),
                         DECAY_AFTER=decay_after, HAS_DECAY=(decay > 0.0) if decay_after else (decay != 0),
                         TILE_R=tile_r, TILE_C=tile_c)
