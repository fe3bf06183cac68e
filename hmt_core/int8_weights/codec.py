"""INT8 weight codes: symmetric absmax quantization with one fp32 scale per block of ``block`` consecutive input
features of a row (Q-GaLore, Zhang et al., 2024, §3.3 stores weights in INT8 with group size 256; it uses
asymmetric min/max groups, we use the symmetric absmax rule of the project's other INT8 codecs, Dettmers et al.
2022). For a weight W (rows, cols) and block b (the last block of a row may be shorter):

    s[i, k] = max_{j ∈ block k} |W[i, j]| / 127   (1 for an all-zero block),   q[i, j] = R(W[i, j] / s[i, ⌊j/b⌋])

with R round-to-nearest-even (``quantize(..., generator=None)``: converting a model) or stochastic rounding
(``hmt_core.precision.stochastic_round_int``: writing an update, unbiased), clamped to [−127, 127]. Dequantized:
Ŵ[i, j] = q[i, j]·s[i, ⌊j/b⌋]. Error bound: |Ŵ − W| ≤ s/2 per element with round-to-nearest (the clamp only
removes the fp32 rounding of W/s past ±127), < s with stochastic rounding. Blocks along the input dimension keep
rows independent: an optimizer's row chunk is requantized on its own, and one outlier only widens its block's
step (``benchmarks/int8_bench.py`` compares block sizes and per-output-channel scales by their error).

``dequantize`` runs the Triton kernel of ``hmt_core.kernels.int8_weight`` when ``hmt_core.kernels.use_triton``
says so (through the custom op ``hmt::int8_weight_dequant``, with a fake implementation) and the PyTorch fallback
``dequantize_torch`` otherwise — called directly, so the memory meter sees its real ops (as ``hmt_core.kernels.ops``
does for its fallbacks); both write the product straight into the output.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from hmt_core import kernels
from hmt_core.adam import apply_update_
from hmt_core.precision import stochastic_round_int

BLOCK = 256  # Q-GaLore's weight group size
QMAX = 127.0


def num_blocks(cols: int, block: int) -> int:
    return -(-cols // block)


def _split(cols: int, block: int) -> tuple[int, int]:
    """(number of whole blocks, columns they cover) of a row of ``cols``; the rest is one shorter block."""
    n = cols // block
    return n, n * block


def _absmax(v: Tensor, dim: int) -> Tensor:  # -> fp32, ``v`` reduced over ``dim``
    high = v.amax(dim=dim)
    return torch.maximum(high, v.amin(dim=dim).neg_(), out=high).float()


def block_absmax(w: Tensor, block: int) -> Tensor:  # w: (rows, cols) -> (rows, nb) fp32
    rows, cols = w.shape
    n, full = _split(cols, block)
    parts = []
    if n:  # max |w| as max(max w, −min w): no |w| temporary; on CPU ~20x faster than the ∞-norm's reduction
        parts.append(_absmax(w[:, :full].reshape(rows, n, block), dim=2))
    if full < cols:
        parts.append(_absmax(w[:, full:], dim=1).unsqueeze(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def scaled_op(op, a: Tensor, s: Tensor, block: int, out: Tensor | None) -> Tensor:
    """out = op(a, s expanded over each block) for a, out: (rows, cols), s: (rows, nb); no expanded copy of s.
    ``out`` None: a new fp32 tensor (``op``'s result type for fp32 scales), one op when the blocks tile the rows."""
    rows, cols = a.shape
    n, full = _split(cols, block)
    if out is None and full == cols and s.dtype == torch.float32:
        return op(a.reshape(rows, n, block), s[:, :, None]).view(rows, cols)
    if out is None:
        out = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    if n:
        op(a[:, :full].reshape(rows, n, block), s[:, :n, None], out=out[:, :full].view(rows, n, block))
    if full < cols:
        op(a[:, full:], s[:, n:], out=out[:, full:])
    return out


def quantize(w: Tensor, block: int = BLOCK,  # w: (rows, cols) float -> (q (rows, cols) int8, s (rows, nb) fp32)
             generator: torch.Generator | None = None, *, stochastic: bool = False,
             noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Codes and scales of ``w`` (see the module docstring): round-to-nearest, or stochastic rounding from
    ``generator`` (or the pre-drawn ``noise``, ``stochastic_round_int``) when ``stochastic``. Non-finite values are refused (ValueError) on real tensors when converting
    (round-to-nearest); an update's write trusts its caller (HMT skips non-finite gradients before updating)."""
    if w.dim() != 2:
        raise ValueError(f"int8 weight quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    absmax = block_absmax(w, block)
    if not stochastic and not is_fake(absmax) and absmax.numel() and not bool(torch.isfinite(absmax).all()):
        raise ValueError("int8 weight quantization: the weight contains NaN or Inf")
    # absmax ≥ 0, NaN only for a block with a NaN (refused above when converting; a skipped update keeps its codes)
    scale = kernels.div_rn(absmax, QMAX).masked_fill_(absmax == 0, 1.0)
    y = scaled_op(torch.div, w, scale, block, None)
    y = stochastic_round_int(y, generator, noise) if stochastic else y.round_()
    return y.clamp_(-QMAX, QMAX).to(torch.int8), scale  # |W/s| ≤ 127 up to one fp32 rounding of the division


def dequantize_torch(q: Tensor, scale: Tensor, block: int,  # q: (rows, cols) int8, scale: (rows, nb) fp32
                     dtype: torch.dtype) -> Tensor:  # -> (rows, cols) dtype
    """q·s computed in fp32 (the ops' common dtype: one rounding) and stored in ``dtype`` by round-to-nearest-even,
    written straight into the output (``out=``; no weight-sized temporary on CUDA, where the cast is fused)."""
    out = None if dtype == torch.float32 else torch.empty(q.shape, dtype=dtype, device=q.device)
    return scaled_op(torch.mul, q, scale, block, out)


@torch.library.custom_op("hmt::int8_weight_dequant", mutates_args=())
def int8_weight_dequant(q: Tensor, scale: Tensor, block: int, dtype: torch.dtype, backend: str = "") -> Tensor:
    # q: (rows, cols) int8, scale: (rows, nb) fp32 -> (rows, cols) dtype
    if kernels.use_triton(q, scale, backend=backend):
        from hmt_core.kernels import int8_weight  # imports triton: only where a Triton kernel runs (also below)
        return int8_weight.dequant(q, scale, block, dtype)
    return dequantize_torch(q, scale, block, dtype)


@int8_weight_dequant.register_fake
def _(q, scale, block, dtype, backend=""):
    return q.new_empty(q.shape, dtype=dtype)


def dequantize(q: Tensor, scale: Tensor, block: int, dtype: torch.dtype,  # q: (rows, cols), scale: (rows, nb)
               *, backend: str | None = None) -> Tensor:
    """Ŵ = q·s in ``dtype``: the Triton kernel when it runs (``backend``: "auto" | "triton" | "torch", None: the
    global one), else ``dequantize_torch``."""
    if kernels.use_triton(q, scale, backend=backend):
        return torch.ops.hmt.int8_weight_dequant(q, scale, block, dtype, backend or kernels.get_backend())
    return dequantize_torch(q, scale, block, dtype)


# --------------------------------------------------------------------------- fused update of INT8 weight rows
def int8_update_torch(codes: Tensor, scales: Tensor, update: Tensor, noise: Tensor, block: int,  # see int8_update
                      step_size: float, decay: float, decay_after: bool) -> None:
    """``int8_update``'s PyTorch fallback, the unfused ops: dequantize, ``apply_update_``'s arithmetic, requantize."""
    w = dequantize_torch(codes, scales, block, torch.float32)
    # decay = ηλ: apply_update_ with lr 1 and weight decay ηλ (1.0 · ηλ is ηλ exactly); hf decays after the step
    apply_update_(w, update, step_size=step_size, lr=1.0, weight_decay=decay, style="hf" if decay_after else "torch")
    q, s = quantize(w, block, stochastic=True, noise=noise)
    codes.copy_(q)
    scales.copy_(s)


@torch.library.custom_op("hmt::int8_update_", mutates_args=("codes", "scales"))
def int8_update_(codes: Tensor, scales: Tensor, update: Tensor, noise: Tensor, block: int, step_size: float,
                 decay: float, decay_after: bool, backend: str = "") -> None:
    # codes: (rows, cols) int8, scales: (rows, nb) fp32, both in place; update: (rows, cols) fp32; noise: int16
    if kernels.use_triton(codes, scales, update, noise, backend=backend):
        from hmt_core.kernels import int8_weight
        int8_weight.update_(codes, scales, update, noise, block, step_size=step_size, decay=decay,
                            decay_after=decay_after)
    else:
        int8_update_torch(codes, scales, update, noise, block, step_size, decay, decay_after)


@int8_update_.register_fake
def _(codes, scales, update, noise, block, step_size, decay, decay_after, backend="") -> None:
    return None


def int8_update(codes: Tensor, scales: Tensor, update: Tensor, noise: Tensor, block: int, *, step_size: float,
                decay: float, decay_after: bool, backend: str | None = None) -> None:
    """INT8 rows updated in place: Ŵ = q·s, W ← W − step_size·U with decoupled weight decay ``decay`` (= ηλ; before
    the update, or after it with ``decay_after``, as ``hmt_core.adam.apply_update_`` orders them), then requantized
    by stochastic rounding with the pre-drawn ``noise`` (``random_halfwords``, U's shape). One Triton kernel when it
    runs (``hmt_core.kernels.int8_weight.update_``), else ``int8_update_torch``."""
    if kernels.use_triton(codes, scales, update, noise, backend=backend):
        torch.ops.hmt.int8_update_(codes, scales, update, noise, block, float(step_size), float(decay),
                                   bool(decay_after), backend or kernels.get_backend())
    else:
        int8_update_torch(codes, scales, update, noise, block, step_size, decay, decay_after)
