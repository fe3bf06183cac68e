"""Triton kernel: dequantization of an INT8 weight with one scale per block of ``block`` consecutive elements of a
row (Q-GaLore's weight format, Zhang et al., 2024, §3.3, symmetric here; ``hmt_core.int8_weights``):

    W^[i, j] = q[i, j] · s[i, ⌊j / block⌋]      q: (rows, cols) int8, s: (rows, ⌈cols / block⌉) fp32

computed in fp32 (one IEEE rounding) and stored in the output dtype by round-to-nearest-even, bit-identical to the
PyTorch fallback ``hmt_core.int8_weights.codec.dequantize_torch`` (the bf16 store works on the bit pattern,
``quant.store_f32``, since the interpreter's fp32→bf16 cast does not round to nearest even). Rows are independent,
so any row slice of a weight (an optimizer's row chunk) is dequantized by the same kernel.
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
