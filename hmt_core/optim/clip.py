"""The clipping rule of ``torch.nn.utils.clip_grad_norm_`` as device tensors: the global norm over all parameters
and the coefficient min(1, c / (‖g‖ + 1e-6)), shared by the per-layer and the ordinary step."""

from __future__ import annotations

import torch
from torch import Tensor


def global_norm(norms: list[Tensor]) -> Tensor:
    """‖(‖G_1‖, ..., ‖G_n‖)‖ in fp32, the arithmetic of ``torch.nn.utils.clip_grad_norm_``."""
    return torch.linalg.vector_norm(torch.stack(norms).float())


def clip_coefficient(total: Tensor, max_grad_norm: float | None) -> Tensor | None:
    """``min(1, c / (‖g‖ + 1e-6))`` as a 0-d tensor, like ``clip_grad_norm_``; ``None`` when not clipping."""
    if not max_grad_norm:
        return None
    return torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
