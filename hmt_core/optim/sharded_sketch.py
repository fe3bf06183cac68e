"""A distributed randomized range finder for HMT's basis refresh on row-sharded gradients (FSDP2,
``dist.refresh=sketch``): Halko, Martinsson & Tropp (2011), Alg. 4.3/4.4 and 5.1, over row blocks as in GaLore 2 (Su
et al., 2025), the tall sketch orthonormalized by CholeskyQR2 (fp64 Gram; Fukaya et al. 2014) with Householder's
signs (Ballard et al. 2014, Alg. 5). It mirrors ``hmt_core.projection.randomized_svd`` step for step on each rank's
rows G_k without gathering G. Algorithm, collectives, accuracy and the projection-error diagnostic:
docs/design/sharded.md."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from hmt_core import projection as proj
from hmt_core.kernels import ops as kops
from hmt_core.optim.rows import rank_rows

GRAM_OK = 0.5  # CholeskyQR2's second pass is used when ‖Q₁ᵀQ₁ − I‖_F ≤ this (see the module docstring)


def all_reduce_(t: Tensor, group) -> Tensor:  # t: any shape, summed over ranks in place
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _holds(ok: Tensor) -> bool:  # ok: () bool, computed from replicated values; a fake tensor (dry run): True
    return True if is_fake(ok) else bool(ok)


def gather_rows(local: Tensor, rows_total: int, group) -> Tensor:  # local: (rows_k, c) -> (rows_total, c)
    """The row blocks of every rank, cut like ``torch.chunk`` (FSDP2's ``Shard(0)``: ⌈rows/W⌉ each, the last ranks
    shorter or empty), concatenated: one all-gather of W × ⌈rows/W⌉ × c (each block zero-padded)."""
    world = dist.get_world_size(group)
    size = -(-rows_total // world)
    padded = local.new_zeros((size, local.shape[1]))
    padded[:local.shape[0]] = local
    blocks = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(blocks, padded, group=group)
    spans = [rank_rows(rows_total, world, r) for r in range(world)]
    return torch.cat([b[:s.stop - s.start] for b, s in zip(blocks, spans)])


def householder_signs(top: Tensor, rows_total: int) -> Tensor:  # top: (w, w) fp64 -> (w,) ±1
    """Signs S with Q₊ diag(S) = the Householder (LAPACK ``geqrf``) Q of a matrix whose positive-diagonal QR is Q₊
    (m × w, orthonormal), from Q₊'s top w × w block ``top``: the modified LU of Ballard et al. (2014), Alg. 5.
    LAPACK's ``dlarfg`` keeps α's sign when nothing is below it (the last column of a square Q). A loop of w small
    steps: run on the host (one w × w copy), then moved back; a dry run's fake ``top`` has no signs (ones)."""
    if is_fake(top):
        return top.new_ones(top.shape[0])
    a = top.detach().to("cpu", copy=True)
    w = a.shape[0]
    signs = a.new_empty(w)
    for i in range(w):
        keep = i == w - 1 and rows_total == w  # dlarfg with an empty x(2:n): τ = 0, β = α
        si = torch.where(a[i, i] >= 0, 1.0, -1.0) if keep else torch.where(a[i, i] >= 0, -1.0, 1.0)
        signs[i] = si
        if i + 1 < w:
            a[i, i] -= si  # |pivot| = |a_ii| + 1 ≥ 1
            a[i + 1:, i + 1:] -= torch.outer(a[i + 1:, i] / a[i, i], a[i, i + 1:])
    return signs.to(top.device)


def orthonormalize_rows(y: Tensor, rows: slice, rows_total: int, group, *, signs: bool = True) -> Tensor:
    # y: (rows_k, w) fp32, this rank's rows [rows] of Y (rows_total × w) -> (rows_k, w) fp32
    """This rank's rows of the Householder Q of Y, computed across ranks by CholeskyQR2 in fp64 with Householder's
    column signs (``signs=False``: CholeskyQR's own, positive-R signs); falls back to all-gathering Y and
    ``torch.linalg.qr`` (see the module docstring). Every branch is taken on all-reduced values, identically on
    every rank."""
    w = y.shape[1]
    q = y.double()
    gram = all_reduce_(q.t() @ q, group)  # (w, w)
    chol, info = torch.linalg.cholesky_ex(gram)
    if _holds((info == 0) & torch.isfinite(chol).all()):
        q = torch.linalg.solve_triangular(chol.t(), q, upper=True, left=False)  # Y R₁⁻¹, R₁ = Lᵀ
        gram = q.t() @ q
        if signs:  # Q₁'s global rows [0, w) ride along: the rows of them this rank holds
            top = q.new_zeros((w, w))
            a, b = min(rows.start, w), min(rows.stop, w)
            top[a:b] = q[:b - a]
            gram = torch.cat([gram, top])  # (2w, w)
        gram = all_reduce_(gram, group)
        gram, top = gram[:w], gram[w:]
        eye = torch.eye(w, dtype=gram.dtype, device=gram.device)
        chol, info = torch.linalg.cholesky_ex(gram)
        if _holds((torch.linalg.matrix_norm(gram - eye) <= GRAM_OK) & (info == 0) & torch.isfinite(chol).all()):
            r2 = chol.t()
            q = torch.linalg.solve_triangular(r2, q, upper=True, left=False)  # Q₁ R₂⁻¹
            if signs:
                q = q * householder_signs(torch.linalg.solve_triangular(r2, top, upper=True, left=False), rows_total)
            return q.float()
    full = gather_rows(y, rows_total, group)  # (rows_total, w): the single-process operation, on every rank
    return torch.linalg.qr(full).Q[rows].contiguous()


def randomized_svd_rows(grad: Tensor, k: int, *, rows: slice, shape: tuple[int, int], group, total_energy: float,
                        power_iters: int = 2, oversample: int = 8, warm: proj.Basis | None = None,
                        generator: torch.Generator | None = None, gather_u: bool = False) -> proj.Factors | None:
    # grad: (rows_k, n), rows [rows] of G (m × n) = ``shape``; warm: the whole previous basis (P: (m, r) | Qᵀ: (r, n))
    """``hmt_core.projection.randomized_svd`` of the row-sharded G (see the module docstring): Factors with ``s``
    (k,) and ``vh`` (k, n) replicated, ``u`` this rank's rows (rows_k, k) of U, or all of U (m, k) with
    ``gather_u``; ``total_energy`` is the all-reduced ‖G‖². ``None`` when a replicated factorization fails or is
    not finite (the same on every rank). The caller has checked ‖G‖² is finite: a local check would diverge."""
    g = grad.float()
    out_dim, in_dim = shape
    width = min(k + oversample, out_dim, in_dim)
    omega = torch.randn(in_dim, width, generator=generator, dtype=g.dtype, device="cpu").to(g.device)  # (n, w)
    if warm is not None:
        if warm.right is not None:
            seed_cols = warm.right.float().t()  # (n, r)
        else:
            seed_cols = all_reduce_(g.t() @ warm.left[rows].float(), group)  # Gᵀ P = Σ_k G_kᵀ P_k: (n, r)
        c = min(seed_cols.shape[1], width)
        omega[:, :c] = seed_cols[:, :c]
    try:
        y = g @ omega  # (rows_k, w)
        for _ in range(power_iters):  # qr(Gᵀ Y).Q does not depend on Y's column signs: CholeskyQR's suffice
            y = orthonormalize_rows(y, rows, out_dim, group, signs=False)
            z = torch.linalg.qr(all_reduce_(g.t() @ y, group)).Q  # (n, w), replicated
            y = g @ z
        qy = orthonormalize_rows(y, rows, out_dim, group)  # (rows_k, w)
        ub, s, vh = torch.linalg.svd(all_reduce_(qy.t() @ g, group), full_matrices=False)  # B: (w, n), replicated
    except torch.linalg.LinAlgError:  # raised alike on every rank (replicated inputs)
        return None
    if not proj.all_finite(ub, s, vh):
        return None
    u = (qy @ ub)[:, :k]  # (rows_k, k)
    if gather_u:
        u = gather_rows(u.contiguous(), out_dim, group)  # (m, k), replicated
        if not proj.all_finite(u):
            return None
    return proj.Factors(u, s[:k], vh[:k], total_energy)


def projection_error_rows(grad: Tensor, basis: proj.Basis, low: Tensor, total_energy: Tensor, group, *,
                          chunk_elems: int = proj.ERROR_CHUNK_ELEMS) -> float:
    # grad: (rows_k, n); basis: this rank's P_k (rows_k, r) or the shared Qᵀ (r, n), orthonormal;
    # low: G_k Q (rows_k, r) or the all-reduced PᵀG (r, n), fp32; total_energy: (1,) fp64 all-reduced ‖G‖²
    """‖G − Π(G)‖/‖G‖ from row shards: the explicit residual of ``relative_projection_error`` summed over ranks."""
    rows_k, in_dim = grad.shape
    step = max(1, chunk_elems // max(1, in_dim))
    err2 = torch.zeros(1, dtype=torch.float64, device=grad.device)
    p = basis.left.float() if basis.left is not None else None
    qt = basis.right.float() if basis.right is not None else None
    for a in range(0, rows_k, step):
        g = grad[a:a + step].float()
        approx = low[a:a + step] @ qt if p is None else p[a:a + step] @ low
        err2 += torch.linalg.vector_norm(g - approx).double().square()
        del g, approx
    all_reduce_(err2, group)
    if is_fake(err2):
        return float("nan")
    ref, err = float(total_energy[0]), float(err2[0])
    if not math.isfinite(ref) or ref == 0:
        return 0.0
    return math.sqrt(err / ref)


class RowSketch:
    """This rank's rows of a gradient, standing in for the whole gradient in ``LowRankOptimizer.refresh``
    (``sketch=``): its shape, dtype and device, the randomized SVD's factors and the projection error, computed
    across ranks; ``energy`` ((1,) fp64, all-reduced ‖G‖²) is taken at construction, and ``low`` is Ĝ (G_k Q, or
    the all-reduced PᵀG) once the error was computed, for the engine's update."""

    def __init__(self, grad: Tensor, *, rows: slice, shape: tuple[int, int], group, kernels: str | None = None):
        # grad: (rows_k, n), rows [rows] of G (m × n) = ``shape``
        self.grad, self.rows, self.shape, self.group, self.kernels = grad, rows, tuple(shape), group, kernels
        self.dtype, self.device = grad.dtype, grad.device
        self.left = proj.which_sides(self.shape, "one_sided")[0]
        local = torch.linalg.vector_norm(grad, dtype=torch.float64).square().reshape(1)
        self.energy = all_reduce_(local, group)  # (1,) fp64: ‖G‖², non-finite on every rank if G is anywhere
        self.low: Tensor | None = None

    def randomized_svd(self, k: int, *, power_iters: int, oversample: int, warm: proj.Basis | None,
                       generator: torch.Generator | None) -> proj.Factors | None:
        return randomized_svd_rows(self.grad, k, rows=self.rows, shape=self.shape, group=self.group,
                                   total_energy=proj.scalar(self.energy[0]), power_iters=power_iters,
                                   oversample=oversample, warm=warm, generator=generator, gather_u=self.left)

    def relative_error(self, basis: proj.Basis, orthonormal: bool) -> float:  # basis: the whole (replicated) one
        if not orthonormal:
            raise ValueError("a sketched refresh's projection error needs an orthonormal basis (method.basis=rsvd)")
        local = proj.Basis(basis.left[self.rows], None) if basis.left is not None else basis
        low = kops.project(self.grad, local, backend=self.kernels).float()  # G_k Q, or the partial P_kᵀ G_k
        if basis.left is not None:
            all_reduce_(low, self.group)  # PᵀG = Σ_k P_kᵀ G_k: r × n, the engine's Ĝ as between refreshes
        self.low = low
        return projection_error_rows(self.grad, local, low, self.energy, self.group)


def collectives(*, left: bool, warm: bool, power_iters: int) -> tuple[int, int]:
    """(all-reduces, all-gathers) one sketched refresh of a weight issues, the module docstring's list (without a
    rank-deficient Y's fallback); ``tests/test_fsdp2_sketch.py`` counts them."""
    reduces = 1 + (1 if left and warm else 0) + 2 * (power_iters + 1) + power_iters + 1 + 1 + (1 if left else 0)
    return reduces, 1 if left else 0
