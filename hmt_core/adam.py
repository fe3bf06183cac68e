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

    ``factors`` ((4,) fp32 on the moments' device; ``moment_factors``): the step's (1−β₁, β₁, β₂) as device values
    instead of Python floats — the same fp32 numbers, so the same bits — or (0, 1, 1) for a step skipped on the
    device, which with ``g`` zeroed by the caller leaves m and v bit for bit (m + 0·(0 − m), v·1 + 0·0)."""
    m32 = m if m.dtype == torch.float32 else m.float()
    v32 = v if v.dtype == torch.float32 else v.float()
    w1, b1, b2 = (1 - beta1, beta1, beta2) if factors is None else (factors[0], factors[1], factors[2])
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
    """((4,) fp32 ``factors`` of ``adam_moments_`` for a step that runs: (1−β₁, β₁, β₂, 1); for a skipped one:
    (0, 1, 1, 0)), filled on ``device`` (no tensor from host data). The last is the factor of the direction
    (``adam_step_many``)."""
    run, skip = torch.empty(4, device=device), torch.empty(4, device=device)
    for t, values in ((run, (1 - beta1, beta1, beta2, 1.0)), (skip, (0.0, 1.0, 1.0, 0.0))):
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


def adam_step_many(ms: list[Tensor], vs: list[Tensor], gs: list[Tensor], t: int, *,  # each m, v, g: (a, b)
                   lr: float, beta1: float, beta2: float, eps: float, style: str,
                   factors: Tensor | None = None) -> tuple[list[Tensor], float]:
    """``adam_moments_`` + ``adam_step`` of several tensors at one clock ``t``, in ``torch._foreach_*`` ops (one
    multi-tensor kernel per op on CUDA instead of one launch per tensor; on CPU the same per-tensor ops): the same
    arithmetic tensor by tensor, so the same bits. ``factors``: as in ``adam_moments_`` (``g`` zeroed on a skipped
    step by the caller); its last entry multiplies the directions (0 on a skipped step: a zero direction)."""
    m32 = [m if m.dtype == torch.float32 else m.float() for m in ms]
    v32 = [v if v.dtype == torch.float32 else v.float() for v in vs]
    if style == "torch":
        torch._foreach_lerp_(m32, gs, 1 - beta1 if factors is None else [factors[0]] * len(m32))
    else:
        torch._foreach_mul_(m32, beta1 if factors is None else factors[1])
        torch._foreach_add_(m32, gs, alpha=1.0 - beta1)
    torch._foreach_mul_(v32, beta2 if factors is None else factors[2])
    torch._foreach_addcmul_(v32, gs, gs, value=1.0 - beta2)
    low = [i for i, m in enumerate(ms) if m32[i] is not m]  # bf16 state: rounded on store
    if low:
        torch._foreach_copy_([ms[i] for i in low] + [vs[i] for i in low], [m32[i] for i in low] + [v32[i] for i in low])
    bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
    den = torch._foreach_sqrt(v32)
    if style == "torch":  # adam_step: (m · η/(1−β₁ᵗ)) / (√v/√(1−β₂ᵗ) + ε)
        num, step_size = torch._foreach_mul(m32, lr / bc1), 1.0
        torch._foreach_div_(den, bc2 ** 0.5)
    else:  # adam_direction: m / (√v + ε), step η√(1−β₂ᵗ)/(1−β₁ᵗ)
        num, step_size = m32, lr * math.sqrt(bc2) / bc1
    torch._foreach_add_(den, eps)
    d = torch._foreach_div(num, den)
    if factors is not None:
        torch._foreach_mul_(d, factors[3])
    return d, step_size


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
