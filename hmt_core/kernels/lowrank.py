"""Triton kernels for HMT's low-rank (GaLore-style) optimizer step (Zhao et al. 2024, "GaLore", Alg. 2):

- ``fused_update_``: reconstruction + decoupled weight decay + weight update in one pass over W,
      torch style (decay first):  W ← (1 − ηλ)·W − c·(A B)          hf style (decay after): W' = W − c·(A B); W ← W' − ηλ·W'
  with c = step size · α and (A, B) the factors of the reconstruction ``P U Qᵀ`` (two-sided: A = P, B = U Qᵀ;
  one-sided: (Ĝ-direction, Qᵀ) or (P, direction)). Each program computes one (BM, BN) tile of A B in registers
  and updates that tile of W, so the full-size update is never materialized (Loshchilov & Hutter 2019, Alg. 2,
  line 12 for the decay).
- ``matmul``: C = A B over arbitrary strides (transposes are free), the projection ``R = Pᵀ G`` / ``G Q``.
- ``adam_``: the bias-corrected Adam moment update and step direction in the low-rank space (Kingma & Ba 2015,
  Alg. 1) in one elementwise pass, same formulas as ``hmt_core.optim.update.adam_moments_`` + ``adam_step``.

All accumulation is fp32: ``tl.dot`` with ``input_precision="ieee"`` (no TF32), or on CUDA a bf16 tensor-core dot
when both operands are bf16 (products of bf16 values are exact in fp32, as in cuBLAS' bf16 GEMM); bf16 tensors
go through int16 views (see ``quant``). Results equal the PyTorch fallbacks up to fp32 summation order, not bit
for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hmt_core.kernels.quant import _IN_KIND, load_f32, store_f32


def _kind(t: Tensor) -> int:
    if t.dtype not in _IN_KIND:
        raise TypeError(f"Triton low-rank kernels support fp32/bf16/fp16 tensors, got {t.dtype}")
    return _IN_KIND[t.dtype]


def _ptr(t: Tensor) -> Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@triton.jit
def _dot_tile(a_ptr, b_ptr, rm, rn, M, N, K, s_am, s_ak, s_bk, s_bn,  # -> (BM, BN) fp32 tile of A @ B
              A_KIND: tl.constexpr, B_KIND: tl.constexpr, DOT_BF16: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = load_f32(a_ptr, rm[:, None] * s_am + rk[None, :] * s_ak, (rm[:, None] < M) & (rk[None, :] < K), A_KIND)
        b = load_f32(b_ptr, rk[:, None] * s_bk + rn[None, :] * s_bn, (rk[:, None] < K) & (rn[None, :] < N), B_KIND)
        if DOT_BF16:  # both operands hold bf16 values: exact back-conversion, tensor-core products are exact
            acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _update_kernel(w_ptr, a_ptr, b_ptr, M, N, K,  # w: (M, N), a: (M, K), b: (K, N)
                   s_wm, s_wn, s_am, s_ak, s_bk, s_bn, coef, decay,
                   DECAY_AFTER: tl.constexpr, W_KIND: tl.constexpr, A_KIND: tl.constexpr, B_KIND: tl.constexpr,
                   DOT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    acc = _dot_tile(a_ptr, b_ptr, rm, rn, M, N, K, s_am, s_ak, s_bk, s_bn, A_KIND, B_KIND, DOT_BF16, BM, BN, BK)
    offs = rm[:, None] * s_wm + rn[None, :] * s_wn
    m = (rm[:, None] < M) & (rn[None, :] < N)
    w = load_f32(w_ptr, offs, m, W_KIND)
    if DECAY_AFTER:
        w = w - coef * acc
        w = w - decay * w
    else:
        w = w * (1.0 - decay) - coef * acc
    store_f32(w_ptr, offs, w, m, W_KIND)


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,  # a: (M, K), b: (K, N), c: (M, N) contiguous
                   s_am, s_ak, s_bk, s_bn, A_KIND: tl.constexpr, B_KIND: tl.constexpr, C_KIND: tl.constexpr,
                   DOT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    acc = _dot_tile(a_ptr, b_ptr, rm, rn, M, N, K, s_am, s_ak, s_bk, s_bn, A_KIND, B_KIND, DOT_BF16, BM, BN, BK)
    store_f32(c_ptr, rm[:, None] * N + rn[None, :], acc, (rm[:, None] < M) & (rn[None, :] < N), C_KIND)


def _dot_bf16(a: Tensor, b: Tensor) -> bool:
    # tensor-core bf16 dot on GPU when both operands are bf16 (the interpreter keeps the exact fp32 path: its
    # fp32 -> bf16 casts are not trustworthy); fp32 operands always use IEEE fp32 (no TF32)
    return a.is_cuda and a.dtype == b.dtype == torch.bfloat16


def _tiles(t: Tensor) -> dict:
    if t.is_cuda:
        return dict(BM=64, BN=64, BK=32, num_warps=4)
    return dict(BM=32, BN=32, BK=16)  # interpreter: small tiles keep numpy temporaries small


def fused_update_(weight: Tensor, a: Tensor, b: Tensor, *, coef: float, decay: float, decay_after: bool) -> None:
    """weight: (out, in) updated in place;  a: (out, k);  b: (k, in).  W ← update(W, c·a@b, decay) as above."""
    (m, n), k = weight.shape, a.shape[1]
    if m == 0 or n == 0:
        return
    t = _tiles(weight)
    grid = (triton.cdiv(m, t["BM"]), triton.cdiv(n, t["BN"]))
    _update_kernel[grid](_ptr(weight), _ptr(a), _ptr(b), m, n, k, *weight.stride(), *a.stride(), *b.stride(),
                         float(coef), float(decay), DECAY_AFTER=decay_after, W_KIND=_kind(weight), A_KIND=_kind(a),
                         B_KIND=_kind(b), DOT_BF16=_dot_bf16(a, b), **t)


def matmul(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a: (M, K), b: (K, N) with any strides -> (M, N) contiguous in ``out_dtype`` (fp32 accumulation)."""
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m and n:
        if k == 0:
            return c.zero_()
        t = _tiles(a)
        grid = (triton.cdiv(m, t["BM"]), triton.cdiv(n, t["BN"]))
        _matmul_kernel[grid](_ptr(a), _ptr(b), _ptr(c), m, n, k, *a.stride(), *b.stride(), A_KIND=_kind(a),
                             B_KIND=_kind(b), C_KIND=_kind(c), DOT_BF16=_dot_bf16(a, b), **t)
    return c


def project(grad: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """grad: (out, in), left: (out, r) | None, right: (r, in) | None -> Pᵀ G (r, in) | G Q (out, r) | Pᵀ G Q (r, r)."""
    low = grad
    if left is not None:
        low = matmul(left.t(), low, grad.dtype)
    if right is not None:
        low = matmul(low, right.t(), grad.dtype)
    return low


@triton.jit
def _adam_kernel(m_ptr, v_ptr, g_ptr, d_ptr, n,  # m, v: state (n,), g: fp32 (n,), d: fp32 (n,) out
                 beta1, beta2, step, sqrt_bc2, eps,
                 HF: tl.constexpr, LERP_LOW: tl.constexpr, S_KIND: tl.constexpr, TILE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    msk = offs < n
    m = load_f32(m_ptr, offs, msk, S_KIND)
    v = load_f32(v_ptr, offs, msk, S_KIND)
    g = tl.load(g_ptr + offs, mask=msk, other=0.0)
    if HF:
        m = m * beta1 + g * (1.0 - beta1)
    elif LERP_LOW:  # torch.lerp(m, g, w): w < 0.5 -> m + w (g - m), else g - (g - m)(1 - w)
        m = m + (1.0 - beta1) * (g - m)
    else:
        m = g - (g - m) * beta1
    v = v * beta2 + (1.0 - beta2) * g * g
    store_f32(m_ptr, offs, m, msk, S_KIND)
    store_f32(v_ptr, offs, v, msk, S_KIND)
    if HF:  # N = m / (√v + ε)
        d = tl.math.div_rn(m, tl.sqrt_rn(v) + eps)
    else:  # D = (m · η/(1−β₁ᵗ)) / (√v / √(1−β₂ᵗ) + ε)
        d = tl.math.div_rn(m * step, tl.math.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps)
    tl.store(d_ptr + offs, d, mask=msk)


def adam_(m: Tensor, v: Tensor, g: Tensor, *, beta1: float, beta2: float, step: float, sqrt_bc2: float,
          eps: float, hf: bool) -> Tensor:
    """m, v: (a, b) contiguous state (fp32 | bf16) updated in place; g: (a, b) fp32 -> direction (a, b) fp32.
    ``step`` = η/(1−β₁ᵗ) (torch style, folded into the numerator) and is unused for hf."""
    g = g.float().contiguous()
    d = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    n = g.numel()
    if n:
        tile = 1024
        _adam_kernel[(triton.cdiv(n, tile),)](_ptr(m), _ptr(v), g, d, n, float(beta1), float(beta2), float(step),
                                              float(sqrt_bc2), float(eps), HF=hf, LERP_LOW=(1 - beta1) < 0.5,
                                              S_KIND=_kind(m), TILE=tile)
    return d
