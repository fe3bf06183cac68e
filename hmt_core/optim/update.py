"""Update math for HMT's two optimizer modes, as functions over tensors (no hidden state).

Mode A (GaLore-style low-rank AdamW; Zhao et al., 2024, Alg. 2): Adam moments of the projected gradient
``R = Pᵀ G`` (Kingma & Ba, 2015, Alg. 1, bias-corrected), update ``W ← W − η · α · P N`` with
``N = m̂ / (√v̂ + ε)`` and decoupled weight decay (Loshchilov & Hutter, 2019, Alg. 2, line 12).

Mode B (APOLLO; Zhu et al., 2024, Alg. 1 and Eq. 5-6): the same low-rank moments only give a scaling
``s = ‖N‖ / ‖R‖`` (per channel, or per tensor for APOLLO-Mini); the update is ``s ⊙ G`` on the *full* gradient,
passed through Fira's norm-growth limiter (Chen et al., 2024, Eq. 9, γ = 1.01) and multiplied by ``√scale``:
apollo-torch 1.0.3 multiplies by ``np.sqrt(group["scale"])`` (paper: α), so Mini's ``scale=128`` means an
effective factor √128 ≈ 11.3. HMT matches the reference code, not the paper's text.

Per-coordinate bias-correction clocks (``born``; HMT's rule for dynamic rank). Adam divides the zero-initialized
EMAs by their weight mass 1 − βᵗ (Kingma & Ba, 2015, §3). When a basis refresh raises the rank, the new low-rank
coordinates start with m = v = 0 while the global clock t is large, so their first step would be
m̂/√v̂ = (1−β₁)g / √((1−β₂)g²) = 0.1/0.0316 ≈ 3.16·sign(g) instead of Adam's first step ≈ 1·sign(g), decaying to
the right size only over ~1/(1−β₁) steps. So each rank index i carries the step ``born[i]`` at which its moments
started from zero, and a coordinate's bias correction uses its own age t − born (two-sided: the younger index of
the two). Coordinates that existed before the change keep the global clock and are computed exactly as before
(bit for bit); ``born`` is ``None`` until a rank increase happens, so a run whose rank never grows is unchanged.

Two AdamW formula styles (``style``):
- ``"torch"``: ``torch.optim.AdamW`` — ``m ← lerp(m, g, 1−β₁)``, denominator ``√v/√(1−β₂ᵗ) + ε``, step
  ``η/(1−β₁ᵗ)``, weight decay ``W ← W(1 − ηλ)`` *before* the update.
- ``"hf"``: the legacy transformers AdamW that galore-torch and apollo-torch copy — ``m ← β₁m + (1−β₁)g``,
  denominator ``√v + ε`` (ε outside the bias correction), step ``η√(1−β₂ᵗ)/(1−β₁ᵗ)``, weight decay
  ``W ← W − ηλW`` *after* the update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from hmt_core.adam import (STYLES, adam_direction, adam_moments_, adam_step,  # noqa: F401 (the update math's API)
                           apply_update_)
from hmt_core.optim.rows import row_spans
from hmt_core.projection import Basis, project_back

MOMENT_POLICIES = ("keep", "project", "reset")


def apollo_scaling(direction: Tensor, low: Tensor, *, right_sided: bool,  # direction, low: (out, r) | (r, in)
                   kind: str, reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """APOLLO's s = ‖N‖/‖R‖: (out, 1) or (in,) per channel for one-sided bases, or a 0-d tensor. ``reduce`` (row
    shards of a right-sided N and R: a sum over ranks, in place) makes the tensor norms global; a channel's norm
    is along its own row, local either way."""
    if kind == "tensor" and reduce is not None and right_sided:
        sq = reduce(torch.stack([torch.norm(direction), torch.norm(low.float())]).square())
        return sq[0].sqrt() / (sq[1].sqrt() + 1e-8)
    if kind == "tensor":
        return torch.norm(direction) / (torch.norm(low) + 1e-8)
    dim = 1 if right_sided else 0
    factor = torch.norm(direction, dim=dim) / (torch.norm(low, dim=dim) + 1e-8)
    return factor.unsqueeze(1) if dim == 1 else factor


def norm_growth_limit(update: Tensor, prev_norm: Tensor | None,  # update: (out, in); prev_norm: ()
                      gamma: float) -> tuple[Tensor, Tensor]:
    """Fira/APOLLO limiter: if ‖u‖ > γ·prev, rescale u to γ·prev. Returns (u, norm to remember)."""
    limiter, remembered = growth_divisor(torch.norm(update), prev_norm, gamma)
    return (update if limiter is None else update / limiter), remembered


def growth_divisor(norm: Tensor, prev_norm: Tensor | None,  # norm, prev_norm: ()
                   gamma: float) -> tuple[Tensor | None, Tensor]:
    """The limiter of Fira (Chen et al., 2024, Eq. 9) from ‖u‖ (however it was summed): (divisor of u, or None on
    the first step; the norm to remember, ‖u‖ after the division)."""
    if prev_norm is None:
        return None, norm
    limiter = torch.clamp(norm / (prev_norm + 1e-8), min=gamma) / gamma
    return limiter, norm / limiter


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


def scaled_norm(grad: Tensor, factor: Tensor,  # grad: (out, in); factor: () | (out, 1) | (in,), s ≥ 0
                reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """‖G ⊙ s‖ (0-d, fp32 or wider) without a weight-sized temporary: s‖G‖ for a tensor factor, else the channel norms of G
    (one reduction along each channel) weighted by the channel factors, (Σ_c s_c² ‖G_c‖²)^½. ``reduce`` (``grad`` a
    row shard: a sum over ranks, in place) adds the other ranks' rows to the square."""
    acc = torch.float32 if grad.dtype.itemsize < 4 else None  # bf16/fp16 gradients: accumulated in fp32
    if factor.dim() == 0:
        norm = torch.linalg.vector_norm(grad, dtype=acc) * factor
    else:
        norms = torch.linalg.vector_norm(grad, dim=1 if factor.dim() == 2 else 0, dtype=acc)  # (out,) | (in,)
        norm = torch.linalg.vector_norm(norms * factor.reshape(-1))
    return norm if reduce is None else reduce(norm.square()).sqrt()


def scaled_norm_of_rows(row_norms: Tensor, factor: Tensor) -> Tensor:  # row_norms: (out,) ‖G_r‖; factor: () | (out, 1)
    """``scaled_norm`` from G's row norms (gathered block by block, ``hmt_core.optim.head_update``)."""
    if factor.dim() == 0:
        return torch.linalg.vector_norm(row_norms) * factor
    return torch.linalg.vector_norm(row_norms * factor.reshape(-1))


def fp32_clipped(low: Tensor, clip: Tensor | None) -> Tensor:  # low: Ĝ (any float dtype); clip: () fp32
    """fp32 ``clip · low`` (``low.float()`` when ``clip`` is None) in one op for an fp32 or narrower ``low``: a (1,)
    view of the clip coefficient takes part in type promotion (a 0-dim one does not), so bf16 × fp32 is fp32."""
    if clip is None:
        return low.float()
    return low * clip.reshape(1) if low.dtype.itemsize <= 4 else low.float() * clip


def apollo_coefficient(grad: Tensor | None, factor: Tensor, *, prev_norm: Tensor | None,  # grad: (out, in)
                       gamma: float | None, reduce: Callable[[Tensor], Tensor] | None = None,
                       row_norms: Tensor | None = None, grad_norm: Tensor | None = None,
                       found_inf: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Mode B's update ``limit(G ⊙ s)`` as ``G ⊙ coef`` with ``coef = s / limiter`` (factor-shaped: 0-d, (out, 1)
    or (in,); APOLLO's √scale is the caller's, a Python factor of the step size), and the norm to remember for the
    next step's limiter (Fira, Eq. 9: ‖u‖ after limiting). ``gamma`` None: no limiter (``prev_norm`` passes
    through). ``reduce``: see ``scaled_norm``; ``row_norms`` ((out,) ‖G_r‖, ``grad`` None): the limiter's norm
    from them; ``grad_norm`` (() ‖G‖, known to the caller): a tensor factor's ‖G ⊙ s‖ = s‖G‖ without reading G.
    ``found_inf`` (() bool, a step skipped on the device): coef 0 and ``prev_norm`` kept where it is True.
    Only factor-sized tensors are made."""
    if gamma is None:
        coef, remembered = factor, prev_norm
    elif factor.dim() == 0 and grad_norm is not None and reduce is None:
        coef, remembered = _tensor_limit(factor, grad_norm, prev_norm, gamma)
    else:
        norm = scaled_norm(grad, factor, reduce) if row_norms is None else scaled_norm_of_rows(row_norms, factor)
        coef, remembered = _limit(factor, norm, prev_norm, gamma)
    if found_inf is None:
        return coef, remembered
    if remembered is not None:  # no memory yet: +inf keeps the next step unlimited (``_limit``), as None does
        keep = torch.full_like(remembered, math.inf) if prev_norm is None else prev_norm
        remembered = torch.where(found_inf, keep, remembered)
    return coef.masked_fill(found_inf, 0.0), remembered


def _tensor_limit(factor: Tensor, grad_norm: Tensor, prev: Tensor | None,  # factor, grad_norm, prev: ()
                  gamma: float) -> tuple[Tensor, Tensor]:
    """(s / limiter, ‖u‖ after limiting) for a tensor factor s from ‖G‖: with ‖u‖ = s‖G‖ the limiter
    max(‖u‖/(prev + ε), γ)/γ gives s / limiter = min(γ(prev + ε)/‖G‖, s) and ‖u‖/limiter = that·‖G‖ (‖G‖ = 0:
    γ(prev + ε)/0 = ∞, so s; ``fmin`` takes s where the quotient is NaN: a skipped step's coefficient is masked)."""
    if prev is None:
        return factor, factor * grad_norm
    coef = torch.fmin(torch.add(prev, 1e-8).mul_(gamma).div_(grad_norm), factor)
    return coef, coef * grad_norm


def _limit(factor: Tensor, norm: Tensor, prev: Tensor | None,  # factor: () | (out, 1) | (in,); norm, prev: ()
           gamma: float) -> tuple[Tensor, Tensor]:
    """(s / limiter, ‖u‖ / limiter) from ‖u‖ = ‖G ⊙ s‖: 1/limiter = min(γ(prev + ε)/‖u‖, 1) (Fira, Eq. 9;
    ‖u‖ = 0: ∞, so 1)."""
    if prev is None:
        return factor, norm
    inv = torch.add(prev, 1e-8).mul_(gamma).div_(norm).clamp_(max=1.0)
    return factor * inv, norm * inv


def rows_of(coef: Tensor, index) -> Tensor:  # coef: () | (out, 1) | (in,); index: a row slice or ``...``
    return coef[index] if coef.dim() == 2 and index is not Ellipsis else coef


def apply_scaled_update_(param: Tensor, grad: Tensor, coef: Tensor, *, step_size: float,  # param, grad: (rows, in)
                         lr: float, weight_decay: float, style: str) -> None:
    """W ← W − step_size·(G ⊙ coef) in one ``addcmul_`` (no update temporary), with the style's decoupled weight
    decay ordered as in ``apply_update_``."""
    if style == "torch" and weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    param.addcmul_(grad, coef, value=-step_size)
    if style != "torch" and weight_decay > 0.0:
        param.add_(param, alpha=-lr * weight_decay)


def scaled_update_rows_(param: Tensor, grad: Tensor, factor: Tensor, *,  # param, grad: (out, in)
                        prev_norm: Tensor | None, gamma: float | None, sqrt_scale: float, step_size: float,
                        lr: float, weight_decay: float, style: str, rows: int) -> Tensor | None:
    """Mode B's ``W ← W − step·(limit(G ⊙ s) · √scale)`` in row chunks of ``rows`` (``apollo_coefficient`` +
    ``apply_scaled_update_``): no weight-sized temporary. ``factor`` s is 0-d, (out, 1) or (in,); ``gamma`` None:
    no limiter. Returns the norm to remember for the next step's limiter (``‖u‖`` after limiting)."""
    coef, norm = apollo_coefficient(grad, factor, prev_norm=prev_norm, gamma=gamma)
    for index in row_spans(grad.shape[0], rows):
        apply_scaled_update_(param[index], grad[index], rows_of(coef, index), step_size=step_size * sqrt_scale,
                             lr=lr, weight_decay=weight_decay, style=style)
    return norm


# ----------------------------------------------------------------------------- per-coordinate bias-correction clocks
Born = tuple[int, ...]  # (r,) the adam step at which each rank index's moments started from zero (0: the first)


def transfer_born(born: Born | None, old: Basis, new: Basis, policy: str, t: int) -> Born | None:
    """``born`` for the new basis after a refresh at clock ``t`` (moments moved by ``transfer_moments``).

    - ``reset``: None (every coordinate restarts with the global clock, which the caller resets).
    - ``keep``: indices < old rank keep their clock; on a rank increase the zero-filled indices are born at ``t``.
    - ``project``: each new basis vector j is covered by the old subspace with weights w_ij = cos²(old_i, new_j)
      (exact coverage Σ_i w_ij of a unit vector by an orthonormal old basis). On a rank increase r₀ → r₁ the
      r₁ − r₀ least-covered vectors (they hold at most a projection residue of the old moments) are born at ``t``;
      every other vector takes the w-weighted mean of the old births (exact when the new vector is an old one).
      With no rank increase and no earlier young index: None (the trajectory is unchanged).
    """
    old_rank, new_rank = old.rank, new.rank
    if policy == "reset" or (born is None and new_rank <= old_rank):
        return None
    old_born = born if born is not None else (0,) * old_rank
    if policy == "keep":
        merged = old_born[:new_rank] + (t,) * max(0, new_rank - old_rank)
        return merged if any(merged) else None
    w = _coverage_weights(old, new)  # (r_old, r_new)
    cover = w.sum(0)
    merged = (w * torch.tensor(old_born, dtype=w.dtype).unsqueeze(1)).sum(0) / cover.clamp(min=1e-30)
    out = [int(round(float(b))) if float(c) > 0 else t for b, c in zip(merged, cover)]
    if new_rank > old_rank:
        for j in torch.argsort(cover, stable=True)[:new_rank - old_rank].tolist():
            out[j] = t
    return tuple(out) if any(out) else None


def _coverage_weights(old: Basis, new: Basis) -> Tensor:
    """(r_old, r_new) cos² between old and new basis vectors (mean of both sides for two-sided bases)."""
    terms = []
    for o, n, rows in ((old.left, new.left, False), (old.right, new.right, True)):
        if o is None or n is None:
            continue
        o32, n32 = o.double().cpu(), n.double().cpu()
        if rows:  # right bases store Qᵀ (r, in): the vectors are rows
            o32, n32 = o32.t(), n32.t()
        o32 = o32 / o32.norm(dim=0).clamp(min=1e-30)
        n32 = n32 / n32.norm(dim=0).clamp(min=1e-30)
        terms.append((o32.t() @ n32).square())
    return sum(terms) / len(terms)


def retire_born(born: Born | None, t: int, beta1: float, beta2: float) -> Born | None:
    """Forget clocks old enough that both bias corrections are 1 to fp32 precision (β^age < 2⁻²⁴, e.g. age ≥ 16,626
    for β₂ = 0.999): those coordinates then follow the global clock, as before within fp32 rounding."""
    if born is None:
        return None
    kept = tuple(b if (beta1 ** (t - b) >= 2.0 ** -24 or beta2 ** (t - b) >= 2.0 ** -24) else 0 for b in born)
    return kept if any(kept) else None


class ClockGroup(NamedTuple):
    """Coordinates of the low-rank tensor that share one birth step: ``dim`` 0 (rows of a left-only (r, in)
    tensor), 1 (columns of a right-only (out, r) one) or -1 (flat positions of a two-sided (r, r) one, whose
    coordinate (i, j) is as young as the younger of i and j); ``index`` the positions along it (int64, on the
    tensors' device); ``born`` their birth step."""

    dim: int
    index: Tensor  # (k,) int64
    born: int


def clock_index(born: Born, *, left: bool, right: bool, device: torch.device) -> tuple[ClockGroup, ...]:
    """The groups of coordinates younger than the global clock (birth step > 0), as index tensors built on the host
    from ``born`` and copied to ``device`` once: the caller caches them for as long as ``born`` holds (until a
    refresh or a retirement changes it), so a step makes no host-to-device copy (``clock_groups``)."""
    r, groups = len(born), []
    for b in sorted({x for x in born if x > 0}):
        if left and right:
            dim, positions = -1, [i * r + j for i in range(r) for j in range(r) if max(born[i], born[j]) == b]
        else:
            dim, positions = (0 if left else 1), [i for i, x in enumerate(born) if x == b]
        groups.append(ClockGroup(dim, torch.tensor(positions, dtype=torch.int64, device=device), b))
    return tuple(groups)


def clock_groups(born: Born | tuple[ClockGroup, ...], t: int, *, left: bool = False, right: bool = False,
                 device: torch.device | None = None) -> list[tuple[ClockGroup, int]]:
    """(group, age t − born) for every group of coordinates younger than the global clock ``t``; ``born`` is the
    clocks themselves (the index tensors are then built here) or ``clock_index``'s cached groups (no copy)."""
    groups = born if born and isinstance(born[0], ClockGroup) else clock_index(born, left=left, right=right,
                                                                              device=device)
    return [(g, t - g.born) for g in groups]


def _take(x: Tensor, g: ClockGroup) -> Tensor:  # x: (a, b) -> the group's coordinates (a view's gather, no sync)
    if g.dim == -1:
        return x.reshape(-1).index_select(0, g.index)
    return x.index_select(g.dim, g.index)


def fresh_clock_(d: Tensor, m: Tensor, v: Tensor, groups: list[tuple[ClockGroup, int]], *,  # d, m, v: (a, b)
                 step_size: float, lr: float, beta1: float, beta2: float, eps: float, style: str,
                 direction: bool) -> Tensor:
    """Recompute ``d`` (in place) on each group's coordinates with the group's own age in the bias correction; the
    rest of ``d`` is untouched. ``d`` is ``adam_step``'s D (``direction`` False) or ``adam_direction``'s N, both
    paired with the global scalar ``step_size``; a group's own step size is folded into its values."""
    fn = adam_direction if direction else adam_step
    for g, age in groups:
        dy, sy = fn(_take(m, g).float(), _take(v, g).float(), age, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    style=style)
        if sy != step_size:
            dy = dy * (sy / step_size)
        target = d.view(-1) if g.dim == -1 else d  # d: a fresh contiguous direction
        target.index_copy_(0 if g.dim == -1 else g.dim, g.index, dy.to(d.dtype))
    return d
