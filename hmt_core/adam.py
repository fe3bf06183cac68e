"""Adam's moment update and step direction (Kingma & Ba, 2015, Alg. 1, bias-corrected) in the two AdamW formula
styles HMT reproduces (``style``), and the decoupled-weight-decay write ``apply_update_`` (Loshchilov & Hutter,
2019, Alg. 2, line 12), as pure functions over tensors; ``hmt_core.optim.update`` (the update math of
both optimizer modes) and the fused-kernel fallbacks of ``hmt_core.kernels.ops`` both use them.

- ``"torch"``: ``torch.optim.AdamW`` — ``m ← lerp(m, g, 1−β₁)``, denominator ``√v/√(1−β₂ᵗ) + ε``, step ``η/(1−β₁ᵗ)``.
- ``"hf"``: the legacy transformers AdamW that galore-torch and apollo-torch copy — ``m ← β₁m + (1−β₁)g``,
  denominator ``√v + ε`` (ε outside the bias correction), step ``η√(1−β₂ᵗ)/(1−β₁ᵗ)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

STYLES = ("torch", "hf")


def adam_moments_(m: Tensor, v: Tensor, g: Tensor, beta1: float, beta2: float,  # m, v, g: (a, b) same shape
                  style: str, factors: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Update moments in place (fp32 math; bf16 state is rounded on store). Returns fp32 (m, v).

    ``factors`` ((3,) fp32 on the moments' device; ``moment_factors``): the step's (1−β₁, β₁, β₂) as device values
    instead of Python floats — the same fp32 numbers, so the same bits — or (0, 1, 1) for a step skipped on the
    device, which with ``g`` zeroed by the caller leaves m and v bit for bit (m + 0·(0 − m), v·1 + 0·0)."""
    m32 = m if m.dtype == torch.float32 else m.float()
    v32 = v if v.dtype == torch.float32 else v.float()
    w1, b1, b2 = (1 - beta1, beta1, beta2) if factors is None else factors.unbind()
    if style == "torch":
        m32.lerp_(g, w1)
    else:
        m32.mul_(b1).add_(g, alpha=1.0 - beta1)
    v32.mul_(b2).addcmul_(g, g, value=1.0 - beta2)
    if m32 is not m:
        m.copy_(m32)
        v.copy_(v32)
    return m32, v32


def moment_factors(beta1: float, beta2: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """((3,) fp32 ``factors`` of ``adam_moments_`` for a step that runs: (1−β₁, β₁, β₂); for a skipped one:
    (0, 1, 1)), filled on ``device`` (no tensor from host data)."""
    run, skip = torch.empty(3, device=device), torch.empty(3, device=device)
    for t, values in ((run, (1 - beta1, beta1, beta2)), (skip, (0.0, 1.0, 1.0))):
        for i, x in enumerate(values):
            t[i].fill_(x)
    return run, skip


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
