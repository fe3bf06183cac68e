"""Gradient projection bases and the project / project-back maps (pure functions).

Implements the subspace projection of GaLore (Zhao et al., 2024, "GaLore: Memory-Efficient LLM Training by
Gradient Low-Rank Projection", Eq. 2-3 / Alg. 2: ``R_t = P_tᵀ G_t``, update ``P_t N_t``; the one-sided "std"
rule of galore-torch picks the side by shape) and of APOLLO (Zhu et al., 2024, "APOLLO: SGD-like Memory,
AdamW-level Performance", Alg. 1: seeded Gaussian projection ``P ~ N(0, 1/r)``, seeded like apollo-torch so
trajectories match), plus HMT's two-sided form ``Ĝ = Pᵀ G Q`` (HMT design, "Dynamic Low-Rank Gradient
Projection") and a randomized SVD (Halko, Martinsson & Tropp, 2011, Alg. 4.4: range finder + subspace/power
iterations), warm-started from the previous basis.

A ``Basis`` stores ``left`` = P (out × r) and/or ``right`` = Qᵀ (r × in). Storing Qᵀ (not Q) keeps the exact
memory layout and matmul calls of galore-torch / apollo-torch (their ``ortho_matrix`` is (r, in)), so the
equivalence tests can be tight.

One-sided (GaLore's rule): out ≥ in → ``Ĝ = G Q`` (out × r); else ``Ĝ = Pᵀ G`` (r × in).
Two-sided: ``Ĝ = Pᵀ G Q`` (r × r), back-projection ``P U Qᵀ``.

All factorizations run in fp32; failures (LinAlgError, non-finite input or output) never raise: ``factorize``
returns ``None`` and the caller keeps the previous basis or falls back to a seeded orthonormal one.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch import Tensor

SIDES = ("one_sided", "two_sided", "identity")
SOURCES = ("svd", "rsvd", "random")


class Basis(NamedTuple):
    left: Tensor | None  # (out, r) = P
    right: Tensor | None  # (r, in) = Qᵀ

    @property
    def rank(self) -> int:
        return self.left.shape[1] if self.left is not None else self.right.shape[0]


class Factors(NamedTuple):
    u: Tensor  # (out, k)
    s: Tensor  # (k,)
    vh: Tensor  # (k, in)
    total_energy: float  # ‖G‖_F², the exact denominator of E(r)


def which_sides(shape: tuple[int, int], sides: str) -> tuple[bool, bool]:
    """(use_left, use_right) for a weight of ``shape`` (out, in) under ``sides``."""
    out_dim, in_dim = shape
    if sides == "two_sided":
        return True, True
    if sides in ("one_sided", "identity"):
        return (False, True) if out_dim >= in_dim else (True, False)
    raise ValueError(f"unknown projection sides {sides!r}; expected one of {SIDES}")


def project(grad: Tensor, basis: Basis) -> Tensor:
    """grad: (out, in) -> (out, r) | (r, in) | (r, r)."""
    low = grad
    if basis.left is not None:
        low = torch.matmul(basis.left.t(), low)
    if basis.right is not None:
        low = torch.matmul(low, basis.right.t())
    return low


def project_back(low: Tensor, basis: Basis, scale: float = 1.0) -> Tensor:
    """low: (out, r) | (r, in) | (r, r) -> (out, in), times ``scale`` (GaLore's α, applied in project_back)."""
    full = low
    if basis.right is not None:
        full = torch.matmul(full, basis.right)
    if basis.left is not None:
        full = torch.matmul(basis.left, full)
    return full * scale if scale != 1.0 else full


ERROR_CHUNK_ELEMS = 1 << 22  # fp32 elements per row chunk of ``relative_projection_error`` (16 MiB)


def relative_projection_error(grad: Tensor, basis: Basis, orthonormal: bool = False, *,
                              chunk_elems: int = ERROR_CHUNK_ELEMS) -> float:
    """‖G − Π(G)‖/‖G‖, grad: (out, in); Π the orthogonal projector onto span(basis) (QR first unless
    ``orthonormal``, as SVD bases are): Π(G) = P Pᵀ G, G Q Qᵀ or P Pᵀ G Q Qᵀ. 0 for a zero or non-finite G.

    The residual is formed in fp32 over row chunks of at most ``chunk_elems`` elements (the left core Pᵀ G, r × in,
    is accumulated over the same chunks first), so the temporaries are a few chunks, never a full-size fp32 copy of
    G. The explicit residual is kept (rather than ‖G‖² − ‖PᵀG‖²) because it stays accurate for a nearly exact
    projection with a basis that is orthonormal only to fp32 precision. Shape-only (fake) tensors run exactly the
    same ops — a dry run measures the same temporaries — and only the final read is skipped (NaN).
    """
    if chunk_elems <= 0:
        raise ValueError(f"chunk_elems must be > 0, got {chunk_elems}")
    out_dim, in_dim = grad.shape
    rows = max(1, chunk_elems // max(1, in_dim))
    p = qt = None  # P (out, r) and Qᵀ (r, in), orthonormal, fp32
    if basis.left is not None:
        p = basis.left.float() if orthonormal else torch.linalg.qr(basis.left.float()).Q
    if basis.right is not None:
        qt = basis.right.float() if orthonormal else torch.linalg.qr(basis.right.float().t()).Q.t()
    core = None  # Pᵀ G (r, in), then Pᵀ G Q (r, r) for two sides
    if p is not None:
        for a in range(0, out_dim, rows):
            part = p[a:a + rows].t() @ grad[a:a + rows].float()
            core = part if core is None else core.add_(part)
        if qt is not None:
            core = core @ qt.t()
    ref2 = torch.zeros((), dtype=torch.float64, device=grad.device)
    err2 = torch.zeros((), dtype=torch.float64, device=grad.device)
    for a in range(0, out_dim, rows):
        g = grad[a:a + rows].float()
        if p is None:
            approx = (g @ qt.t()) @ qt
        elif qt is None:
            approx = p[a:a + rows] @ core
        else:
            approx = (p[a:a + rows] @ core) @ qt
        ref2 += torch.linalg.vector_norm(g).double().square()
        err2 += torch.linalg.vector_norm(g - approx).double().square()
        del g, approx
    if is_fake(ref2):
        return float("nan")
    ref, err = float(ref2), float(err2)
    if not math.isfinite(ref) or ref == 0:
        return 0.0
    return math.sqrt(err / ref)


# ----------------------------------------------------------------------------------------------- factorizations
def all_finite(*tensors: Tensor) -> bool:
    """All values finite. Shape-only (fake) tensors in a dry run have no values: assumed finite, which is the
    path whose memory the dry run must measure."""
    if any(is_fake(t) for t in tensors):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def scalar(t: Tensor) -> float:
    """``float(t)``, or NaN for a shape-only (fake) tensor, which has no value."""
    return float("nan") if is_fake(t) else float(t)


def exact_svd(grad: Tensor, k: int) -> Factors | None:
    """Top-k of the thin SVD of grad (out, in), fp32; ``None`` on failure."""
    g = grad.float()
    if not all_finite(g):
        return None
    try:
        u, s, vh = torch.linalg.svd(g, full_matrices=False)
    except RuntimeError:  # torch.linalg.LinAlgError subclasses RuntimeError
        return None
    if not all_finite(u, s, vh):
        return None
    return Factors(u[:, :k], s[:k], vh[:k], scalar(torch.sum(s * s)))


def randomized_svd(grad: Tensor, k: int, *, power_iters: int = 2, oversample: int = 8,
                   warm: Basis | None = None, generator: torch.Generator | None = None) -> Factors | None:
    """Top-k randomized SVD of grad (out, in) (Halko et al. 2011, Alg. 4.4), fp32; ``None`` on failure.

    The test matrix Ω (in × (k+p)) starts with the previous right basis Qᵀ (or Gᵀ P for a previous left basis)
    and is completed with Gaussian columns, so a slowly rotating subspace needs few power iterations.
    """
    g = grad.float()
    if not all_finite(g):
        return None
    out_dim, in_dim = g.shape
    width = min(k + oversample, out_dim, in_dim)
    omega = torch.randn(in_dim, width, generator=generator, dtype=g.dtype, device="cpu").to(g.device)
    if warm is not None:
        if warm.right is not None:
            seed_cols = warm.right.float().t()  # (in, r)
        else:
            seed_cols = g.t() @ warm.left.float()  # (in, r)
        n = min(seed_cols.shape[1], width)
        omega[:, :n] = seed_cols[:, :n]
    try:
        y = g @ omega  # (out, width)
        for _ in range(power_iters):
            y = torch.linalg.qr(y).Q
            z = torch.linalg.qr(g.t() @ y).Q  # (in, width)
            y = g @ z
        qy = torch.linalg.qr(y).Q  # (out, width)
        ub, s, vh = torch.linalg.svd(qy.t() @ g, full_matrices=False)  # (width, in)
    except RuntimeError:
        return None
    u = qy @ ub
    if not all_finite(u, s, vh):
        return None
    return Factors(u[:, :k], s[:k], vh[:k], scalar(torch.sum(g * g)))


def basis_from_factors(f: Factors, rank: int, use_left: bool, use_right: bool, dtype: torch.dtype) -> Basis:
    left = f.u[:, :rank].contiguous().to(dtype) if use_left else None
    right = f.vh[:rank].contiguous().to(dtype) if use_right else None
    return Basis(left, right)


# ------------------------------------------------------------------------------- seeded random (APOLLO) bases
def stable_randn(shape: tuple[int, int], seed: int, device: torch.device, dtype=torch.float32) -> Tensor:
    """Same generator use as apollo_torch.random_projector.stable_randn (bit-identical draws)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=dtype)


def next_seed(seed: int, adv: int = 0xF) -> int:
    """apollo_torch.random_projector.next_seed: the seed of the next refresh."""
    with unset_fake_temporarily():  # seed arithmetic is real even inside a FakeTensorMode dry run
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, torch.iinfo(torch.int64).max, (adv,), generator=gen).tolist()[-1]


def random_basis(shape: tuple[int, int], rank: int, use_left: bool, use_right: bool, seed: int,
                 device: torch.device, dtype: torch.dtype) -> tuple[Basis, int]:
    """Gaussian N(0, 1/r) basis as in apollo-torch; returns (basis, seed for the next refresh)."""
    out_dim, in_dim = shape
    left = right = None
    if use_left:
        left = (stable_randn((out_dim, rank), seed, device) / math.sqrt(rank)).to(dtype)
        seed = next_seed(seed)
    if use_right:
        right = (stable_randn((rank, in_dim), seed, device) / math.sqrt(rank)).to(dtype)
        seed = next_seed(seed)
    return Basis(left, right), seed


def orthonormal_fallback(shape: tuple[int, int], rank: int, use_left: bool, use_right: bool, seed: int,
                         device: torch.device, dtype: torch.dtype) -> Basis:
    """A seeded random orthonormal basis: used when a factorization fails and no previous basis exists."""
    out_dim, in_dim = shape
    left = right = None
    if use_left:
        left = torch.linalg.qr(stable_randn((out_dim, rank), seed, device)).Q.to(dtype)
    if use_right:
        right = torch.linalg.qr(stable_randn((in_dim, rank), seed + 1, device)).Q.t().contiguous().to(dtype)
    return Basis(left, right)


def identity_basis(shape: tuple[int, int], use_left: bool, device: torch.device, dtype: torch.dtype) -> Basis:
    """Full-rank identity projection (Ĝ = G): used to check that HMT reduces to AdamW."""
    out_dim, in_dim = shape
    if use_left:
        return Basis(torch.eye(out_dim, device=device, dtype=dtype), None)
    return Basis(None, torch.eye(in_dim, device=device, dtype=dtype))
