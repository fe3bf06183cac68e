"""Update math for HMT's two optimizer modes, as functions over tensors (no hidden state).

Mode A (GaLore-style low-rank AdamW; Zhao et al., 2024, Alg. 2): Adam moments of the projected gradient
``R = Pᵀ G`` (Kingma & Ba, 2015, Alg. 1, bias-corrected), update ``W ← W − η · α · P N`` with
``N = m̂ / (√v̂ + ε)`` and decoupled weight decay (Loshchilov & Hutter, 2019, Alg. 2, line 12).

Mode B (APOLLO; Zhu et al., 2024, Alg. 1 and Eq. 5-6): the same low-rank moments only give a scaling
``s = ‖N‖ / ‖R‖`` (per channel, or per tensor for APOLLO-Mini); the update is ``s ⊙ G`` on the *full* gradient,
passed through Fira's norm-growth limiter (Chen et al., 2024, Eq. 9, γ = 1.01) and multiplied by ``√scale``:
apollo-torch 1.0.3 multiplies by ``np.sqrt(group["scale"])`` (paper: α), so Mini's ``scale=128`` means an
effective factor √128 ≈ 11.3. HMT matches the reference code, not the paper's text.

Two AdamW formula styles (``style``):
- ``"torch"``: ``torch.optim.AdamW`` — ``m ← lerp(m, g, 1−β₁)``, denominator ``√v/√(1−β₂ᵗ) + ε``, step
  ``η/(1−β₁ᵗ)``, weight decay ``W ← W(1 − ηλ)`` *before* the update.
- ``"hf"``: the legacy transformers AdamW that galore-torch and apollo-torch copy — ``m ← β₁m + (1−β₁)g``,
  denominator ``√v + ε`` (ε outside the bias correction), step ``η√(1−β₂ᵗ)/(1−β₁ᵗ)``, weight decay
  ``W ← W − ηλW`` *after* the update.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hmt_core.projection import Basis, project_back

STYLES = ("torch", "hf")
MOMENT_POLICIES = ("keep", "project", "reset")


def adam_moments_(m: Tensor, v: Tensor, g: Tensor, beta1: float, beta2: float,  # m, v, g: (a, b) same shape
                  style: str) -> tuple[Tensor, Tensor]:
    """Update moments in place (fp32 math; bf16 state is rounded on store). Returns fp32 (m, v)."""
    m32 = m if m.dtype == torch.float32 else m.float()
    v32 = v if v.dtype == torch.float32 else v.float()
    if style == "torch":
        m32.lerp_(g, 1 - beta1)
    else:
        m32.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v32.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    if m32 is not m:
        m.copy_(m32)
        v.copy_(v32)
    return m32, v32


def adam_direction(m: Tensor, v: Tensor, t: int, *, lr: float, beta1: float, beta2: float,  # m, v: (a, b)
                   eps: float, style: str) -> tuple[Tensor, float]:
    """(N, step_size): the normalized direction N (a, b) and the scalar step size η_t of the chosen style."""
    bc1 = 1.0 - beta1 ** t
    bc2 = 1.0 - beta2 ** t
    if style == "torch":
        return m / (v.sqrt() / bc2 ** 0.5).add_(eps), lr / bc1
    return m / v.sqrt().add_(eps), lr * math.sqrt(bc2) / bc1


def adam_step(m: Tensor, v: Tensor, t: int, *, lr: float, beta1: float, beta2: float,  # m, v: (a, b)
              eps: float, style: str) -> tuple[Tensor, float]:
    """(D, step_size) with ``W ← W − step_size · D`` the Adam update: same math as ``adam_direction``, with the
    rounding order of each reference (torch folds η_t into the numerator: ``addcdiv(m, denom, value=-η_t)``)."""
    if style == "torch":
        bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
        return (m * (lr / bc1)) / (v.sqrt() / bc2 ** 0.5).add_(eps), 1.0
    return adam_direction(m, v, t, lr=lr, beta1=beta1, beta2=beta2, eps=eps, style=style)


def apply_update_(param: Tensor, update: Tensor, *, step_size: float, lr: float,  # param, update: (out, in)
                  weight_decay: float, style: str) -> None:
    """W ← W − step_size · update with decoupled weight decay, ordered as in the style's reference."""
    if style == "torch":
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        param.add_(update, alpha=-step_size)
    else:
        param.add_(update, alpha=-step_size)
        if weight_decay > 0.0:
            param.add_(param, alpha=-lr * weight_decay)


def apollo_scaling(direction: Tensor, low: Tensor, *, right_sided: bool,  # direction, low: (out, r) | (r, in)
                   kind: str) -> Tensor:
    """APOLLO's s = ‖N‖/‖R‖: (out, 1) or (in,) per channel for one-sided bases, or a 0-d tensor."""
    if kind == "tensor":
        return torch.norm(direction) / (torch.norm(low) + 1e-8)
    dim = 1 if right_sided else 0
    factor = torch.norm(direction, dim=dim) / (torch.norm(low, dim=dim) + 1e-8)
    return factor.unsqueeze(1) if dim == 1 else factor


def norm_growth_limit(update: Tensor, prev_norm: Tensor | None,  # update: (out, in); prev_norm: ()
                      gamma: float) -> tuple[Tensor, Tensor]:
    """Fira/APOLLO limiter: if ‖u‖ > γ·prev, rescale u to γ·prev. Returns (u, norm to remember)."""
    norm = torch.norm(update)
    if prev_norm is None:
        return update, norm
    limiter = torch.clamp(norm / (prev_norm + 1e-8), min=gamma) / gamma
    return update / limiter, norm / limiter


def transfer_moments(m: Tensor, v: Tensor, old: Basis, new: Basis,  # m, v: low-rank in old basis
                     policy: str, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Moments for the new basis (same dtype as ``m``).

    - ``keep`` (galore-torch / apollo-torch): unchanged; if the rank changed, the overlapping block is copied
      and the rest zero-filled.
    - ``project``: first moment re-expressed exactly, ``m' = T_Lᵀ m T_R`` with transitions ``T_L = P_oldᵀ P_new``,
      ``T_R = Q_oldᵀ Q_new``; second moment ``v' = (T_L∘T_L)ᵀ v (T_R∘T_R)`` (exact if coordinates of the
      gradient are uncorrelated), clamped ≥ 0.
    - ``reset``: zeros (the caller also restarts bias correction).
    ``shape`` is the low-rank shape under the new basis.
    """
    shape = tuple(shape)
    if policy == "keep":
        if tuple(m.shape) == shape:
            return m, v
        m2, v2 = m.new_zeros(shape), v.new_zeros(shape)
        a, b = min(m.shape[0], shape[0]), min(m.shape[1], shape[1])
        m2[:a, :b] = m[:a, :b]
        v2[:a, :b] = v[:a, :b]
        return m2, v2
    if policy == "reset":
        return m.new_zeros(shape), v.new_zeros(shape)
    m32, v32 = m.float(), v.float()
    if old.left is not None:
        tl = old.left.float().t() @ new.left.float()  # (r_old, r_new)
        m32, v32 = tl.t() @ m32, (tl * tl).t() @ v32
    if old.right is not None:
        tr = old.right.float() @ new.right.float().t()  # (r_old, r_new)
        m32, v32 = m32 @ tr, v32 @ (tr * tr)
    return m32.to(m.dtype), v32.clamp_(min=0).to(v.dtype)


def low_rank_shape(b: Basis, shape: tuple[int, int]) -> tuple[int, int]:
    """Shape of Ĝ for a weight of ``shape`` (out, in) under basis ``b``."""
    rows = b.left.shape[1] if b.left is not None else shape[0]
    cols = b.right.shape[0] if b.right is not None else shape[1]
    return rows, cols


def project_back_scaled(direction: Tensor, basis: Basis | None, scale: float) -> Tensor:
    """direction (low-rank) -> full-shape update; dense parameters (basis None) pass through unscaled."""
    if basis is None:
        return direction
    return project_back(direction.to(_basis_dtype(basis)), basis, scale)


def _basis_dtype(b: Basis) -> torch.dtype:
    return (b.left if b.left is not None else b.right).dtype


def scaled_update_rows_(param: Tensor, grad: Tensor, factor: Tensor, *,  # param, grad: (out, in)
                        prev_norm: Tensor | None, gamma: float | None, sqrt_scale: float, step_size: float,
                        lr: float, weight_decay: float, style: str, rows: int) -> Tensor:
    """Mode B's ``W ← W − step·(limit(G ⊙ s) · √scale)`` in row chunks of ``rows``: never more than one chunk of
    the fp32 update is alive (the unchunked form holds ~3 weight-sized fp32 temporaries). ``factor`` s is 0-d,
    (out, 1) or (in,). Each element sees the same operations as ``grad * factor`` → ``norm_growth_limit`` →
    ``apply_update_``; only the limiter's norm is summed chunk by chunk. ``gamma`` None: no limiter.
    Returns the norm to remember for the next step's limiter (``‖u‖`` after limiting)."""
    def chunk_factor(start: int, stop: int) -> Tensor:
        return factor[start:stop] if factor.dim() == 2 else factor

    spans = [(i, min(i + rows, grad.shape[0])) for i in range(0, grad.shape[0], rows)]
    limiter = None
    if gamma is not None:
        sq = sum(torch.linalg.vector_norm(grad[a:b] * chunk_factor(a, b)).square() for a, b in spans)
        norm = sq.sqrt()
        if prev_norm is not None:
            limiter = torch.clamp(norm / (prev_norm + 1e-8), min=gamma) / gamma
            norm = norm / limiter
    for a, b in spans:
        u = grad[a:b] * chunk_factor(a, b)
        if limiter is not None:
            u = u / limiter
        apply_update_(param[a:b], u * sqrt_scale, step_size=step_size, lr=lr, weight_decay=weight_decay, style=style)
    return norm if gamma is not None else prev_norm
