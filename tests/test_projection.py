"""Projection bases and maps: shapes/sides, exactness on the subspace, randomized-SVD energy, robustness."""

from __future__ import annotations

import math

import pytest
import torch

from hmt_core import projection as proj
from hmt_core.optim.update import transfer_moments


def low_rank_plus_noise(out_dim, in_dim, rank, noise=1e-3, seed=0, decay=0.8):
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(out_dim, rank, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(in_dim, rank, generator=gen)).Q
    s = torch.tensor([decay ** i for i in range(rank)])
    return u @ torch.diag(s) @ v.t() + noise * torch.randn(out_dim, in_dim, generator=gen)


@pytest.mark.parametrize("shape,sides,low", [
    ((40, 24), "one_sided", (40, 6)),   # out >= in: G Q
    ((24, 40), "one_sided", (6, 40)),   # out < in: Pᵀ G
    ((40, 24), "two_sided", (6, 6)),    # Pᵀ G Q
])
def test_sides_and_shapes(shape, sides, low):
    g = low_rank_plus_noise(*shape, rank=6, noise=0.0)
    use_left, use_right = proj.which_sides(shape, sides)
    basis = proj.basis_from_factors(proj.exact_svd(g, 6), 6, use_left, use_right, torch.float32)
    r = proj.project(g, basis)
    assert tuple(r.shape) == low
    # G has rank 6, so projecting onto its top-6 singular subspace and back is exact
    torch.testing.assert_close(proj.project_back(r, basis), g, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(proj.project_back(r, basis, 0.25), 0.25 * g, atol=1e-5, rtol=1e-4)
    assert proj.relative_projection_error(g, basis, orthonormal=True) < 1e-4


def test_two_sided_error_on_full_rank_gradient():
    g = torch.randn(30, 20, generator=torch.Generator().manual_seed(0))
    f = proj.exact_svd(g, 5)
    one = proj.basis_from_factors(f, 5, False, True, torch.float32)
    two = proj.basis_from_factors(f, 5, True, True, torch.float32)
    e1, e2 = (proj.relative_projection_error(g, b, orthonormal=True) for b in (one, two))
    expected = math.sqrt(1 - float((f.s ** 2).sum()) / f.total_energy)  # optimal rank-5 error
    assert e1 == pytest.approx(expected, rel=1e-4) and e2 == pytest.approx(expected, rel=1e-4)
    # QR path for non-orthonormal bases gives the same projector
    scaled = proj.Basis(None, 3.0 * one.right)
    assert proj.relative_projection_error(g, scaled) == pytest.approx(e1, rel=1e-4)


def test_randomized_svd_captures_top_r_energy_and_warm_start_helps():
    gen = torch.Generator().manual_seed(3)
    out_dim, in_dim, r = 300, 500, 32
    s = torch.tensor([1.0 / (1 + i) ** 1.0 for i in range(min(out_dim, in_dim))])
    u = torch.linalg.qr(torch.randn(out_dim, s.numel(), generator=gen)).Q
    v = torch.linalg.qr(torch.randn(in_dim, s.numel(), generator=gen)).Q
    g = u @ torch.diag(s) @ v.t()
    exact = proj.exact_svd(g, r)
    top = float((exact.s ** 2).sum())
    cold = proj.randomized_svd(g, r, power_iters=0, oversample=8, generator=torch.Generator().manual_seed(0))
    rs = proj.randomized_svd(g, r, power_iters=2, oversample=8, generator=torch.Generator().manual_seed(0))

    def captured(f):  # energy of G inside the found right subspace
        return float(torch.linalg.vector_norm(g @ f.vh.t()) ** 2)

    assert captured(rs) >= 0.99 * top
    assert captured(cold) < captured(rs)  # power iterations matter on this spectrum
    # warm start from the exact basis of a slightly rotated gradient: no power iterations needed
    g2 = g + 1e-3 * torch.randn(out_dim, in_dim, generator=gen)
    warm = proj.randomized_svd(g2, r, power_iters=0, warm=proj.Basis(None, exact.vh),
                               generator=torch.Generator().manual_seed(0))
    top2 = float((proj.exact_svd(g2, r).s ** 2).sum())
    assert float(torch.linalg.vector_norm(g2 @ warm.vh.t()) ** 2) >= 0.995 * top2
    assert float(torch.linalg.vector_norm(g2 @ warm.vh.t()) ** 2) > captured(cold)


def test_zero_and_nonfinite_gradients_never_raise_or_nan():
    z = torch.zeros(20, 12)
    for f in (proj.exact_svd(z, 4), proj.randomized_svd(z, 4, generator=torch.Generator().manual_seed(0))):
        assert f is not None and f.total_energy == 0.0
        assert all(torch.isfinite(t).all() for t in (f.u, f.s, f.vh))
    bad = torch.randn(20, 12)
    bad[3, 4] = float("nan")
    assert proj.exact_svd(bad, 4) is None
    assert proj.randomized_svd(bad, 4) is None
    fb = proj.orthonormal_fallback((20, 12), 4, True, True, 7, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(fb.left.t() @ fb.left, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(fb.right @ fb.right.t(), torch.eye(4), atol=1e-5, rtol=0)
    assert proj.relative_projection_error(z, fb) == 0.0


def test_random_basis_matches_apollo_torch_draws():
    from apollo_torch.random_projector import GradientProjector

    g = torch.randn(12, 20)
    ref = GradientProjector(4, update_proj_gap=1, seed=5)
    basis, seed = proj.random_basis((12, 20), 4, True, False, 5, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(proj.project(g, basis), ref.project(g, 0), rtol=0, atol=0)
    assert seed == ref.seed  # next refresh uses the same seed as apollo-torch's
    basis2, _ = proj.random_basis((12, 20), 4, True, False, seed, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(proj.project(g, basis2), ref.project(g, 1), rtol=0, atol=0)


def test_project_moments_is_exact_for_first_moment():
    """Re-expressing m in a new basis equals projecting the old full-space m onto it (one- and two-sided)."""
    gen = torch.Generator().manual_seed(0)
    g_old, g_new = torch.randn(30, 20, generator=gen), torch.randn(30, 20, generator=gen)
    for use_left, use_right in ((False, True), (True, False), (True, True)):
        old = proj.basis_from_factors(proj.exact_svd(g_old, 6), 6, use_left, use_right, torch.float32)
        new = proj.basis_from_factors(proj.exact_svd(g_new, 4), 4, use_left, use_right, torch.float32)
        m = proj.project(g_old, old)
        v = m * m
        shape = proj.project(g_new, new).shape
        m2, v2 = transfer_moments(m, v, old, new, "project", shape)
        torch.testing.assert_close(m2, proj.project(proj.project_back(m, old), new), atol=1e-5, rtol=1e-4)
        assert (v2 >= 0).all() and v2.shape == shape
        mk, _ = transfer_moments(m, v, old, new, "keep", shape)
        assert mk.shape == shape
        mr, vr = transfer_moments(m, v, old, new, "reset", shape)
        assert float(mr.abs().sum() + vr.abs().sum()) == 0.0
