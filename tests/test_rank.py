"""Energy-based rank choice on synthetic gradients with known spectra, and the per-layer rank history."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hmt_core import hmt
from hmt_core import projection as proj
from hmt_core.rank import RankHistory, choose_rank, energy_ratios


def with_spectrum(s: torch.Tensor, out_dim: int, in_dim: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(out_dim, s.numel(), generator=gen)).Q
    v = torch.linalg.qr(torch.randn(in_dim, s.numel(), generator=gen)).Q
    return u @ torch.diag(s) @ v.t()


def step_spectrum(k: int, n: int, tail: float) -> torch.Tensor:
    """k singular values of 1, then n-k of ``tail``: E(r) = r / (k + (n-k) tail²) for r <= k."""
    return torch.cat([torch.ones(k), torch.full((n - k,), tail)])


CANDS = (8, 16, 32, 64)


def test_energy_ratios_known_values():
    s = torch.tensor([3.0, 2.0, 1.0, 0.0])
    torch.testing.assert_close(energy_ratios(s, 14.0), torch.tensor([9 / 14, 13 / 14, 1.0, 1.0], dtype=torch.float64))
    assert energy_ratios(torch.zeros(3), 0.0).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("k,expected", [(8, 8), (12, 16), (16, 16), (30, 32), (50, 64)])
def test_smallest_candidate_reaching_tau(k, expected):
    g = with_spectrum(step_spectrum(k, 96, 1e-3), 128, 96)
    f = proj.exact_svd(g, 96)
    assert choose_rank(f.s, f.total_energy, candidates=CANDS, tau=0.95, fallback="largest", max_rank=96) == expected


def test_fallback_largest_or_full_and_clipped_candidates():
    flat = with_spectrum(torch.ones(96), 128, 96)  # E(r) = r/96: no candidate reaches 0.95
    f = proj.exact_svd(flat, 96)
    kw = dict(candidates=CANDS, tau=0.95)
    assert choose_rank(f.s, f.total_energy, fallback="largest", max_rank=96, **kw) == 64
    assert choose_rank(f.s, f.total_energy, fallback="full", max_rank=96, **kw) == 96
    # candidates above min(out, in) are dropped; with none left, full rank
    assert choose_rank(f.s[:40], f.total_energy, fallback="largest", max_rank=40, **kw) == 32
    assert choose_rank(f.s[:4], f.total_energy, fallback="largest", max_rank=4, **kw) == 4
    assert choose_rank(f.s, f.total_energy, candidates=CANDS, tau=1.0, fallback="largest", max_rank=96) == 64
    # a zero gradient has nothing to capture: smallest candidate
    assert choose_rank(torch.zeros(96), 0.0, fallback="largest", max_rank=96, **kw) == 8


@pytest.mark.parametrize("k", [10, 20])
def test_randomized_sketch_chooses_like_exact(k):
    s = torch.cat([torch.linspace(1.0, 0.5, k), 0.02 * torch.rand(96 - k, generator=torch.Generator().manual_seed(1))])
    g = with_spectrum(s, 200, 96)
    exact = proj.exact_svd(g, 64)
    sketch = proj.randomized_svd(g, 64, power_iters=2, generator=torch.Generator().manual_seed(0))
    kw = dict(candidates=CANDS, tau=0.95, fallback="largest", max_rank=96)
    assert choose_rank(sketch.s, sketch.total_energy, **kw) == choose_rank(exact.s, exact.total_energy, **kw)


def test_method_refresh_records_per_layer_ranks_and_priors():
    """Two Linear layers with different gradient spectra get different ranks; priors override candidates."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"attn": nn.Linear(96, 128, bias=False), "mlp": nn.Linear(96, 128, bias=False)})
    grads = {"attn.weight": with_spectrum(step_spectrum(12, 96, 1e-3), 128, 96, 1),
             "mlp.weight": with_spectrum(step_spectrum(40, 96, 1e-3), 128, 96, 2)}
    for basis in ("svd", "rsvd", "random"):
        # random bases: the legacy spectral rule (the default rule, by captured energy: test_rank_change.py)
        cfg = hmt.Config(rank=None, rank_candidates=CANDS, tau=0.95, basis=basis, update_interval=2,
                         per_layer=False, mlp_candidates=(48, 96), random_rank="spectrum")
        method = hmt.make(cfg)
        method.attach(model, max_grad_norm=None)
        for _ in range(3):
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            method.step()
            method.zero_grad()
        hist = method.summary()["rank/history"]
        assert hist == {"attn.weight": [[0, 16], [2, 16]], "mlp.weight": [[0, 48], [2, 48]]}, basis
        assert method.metrics()["rank/mean"] == 32.0
        assert method.summary()["rank/histogram_current"] == {"16": 1, "48": 1}
        errors = method.summary()["proj/rel_error_history"]["attn.weight"]
        if basis != "random":  # the SVD bases keep all but the 1e-3 tail
            assert errors[0][1] < 1e-2


def test_rank_history_roundtrip():
    h = RankHistory()
    h.record("a", 0, 32, 0.1)
    h.record("a", 200, 64, 0.2)
    h2 = RankHistory()
    h2.load_state_dict(h.state_dict())
    assert h2.summary() == h.summary() and h2.current() == {"a": 64}


def test_rank_history_records_budget_caps_and_reads_old_entries():
    """A refresh whose rank the state budget cut below its τ-rank is listed (``rank/budget_capped``: step, rank,
    τ-rank) and counted (``rank/capped_layers``, current ranks only); entries saved before τ-ranks were recorded
    ((step, rank, error) triples) load with τ-rank = rank."""
    h = RankHistory()
    h.record("a", 0, 32, 0.1, tau_rank=64)
    h.record("a", 200, 64, 0.2, tau_rank=64)
    h.record("b", 0, 16, 0.3, tau_rank=128)
    h.record("c", 0, 8, 0.3)
    assert h.summary()["rank/budget_capped"] == {"a": [[0, 32, 64]], "b": [[0, 16, 128]]}
    assert h.metrics()["rank/capped_layers"] == 1.0  # only b is capped now
    old = RankHistory()
    old.load_state_dict({"a": [[0, 32, 0.1], [200, 64, 0.2]]})
    assert old.summary()["rank/budget_capped"] == {} and old.current() == {"a": 64}
