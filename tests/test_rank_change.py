"""Dynamic rank and the optimizer state: new coordinates after a rank increase get their own bias-correction clock
(hmt_core.optim.update, "Per-coordinate bias-correction clocks"), old ones continue bit for bit; random bases
get their rank from the energy they capture (hmt_core.rank.choose_rank_by_capture)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.dispatch_counter import DispatchCounter
from hmt_core import hmt
from hmt_core import projection as proj
from hmt_core.optim import update as upd
from hmt_core.optim.refresh import random_capture
from hmt_core.rank import captured_energy, choose_rank_by_capture, energy_ratios

OUT, IN, T = 32, 16, 5  # weight (out, in): one-sided right basis, rank = columns of Ĝ (out, r); refresh every T
LR = 1e-3
G1 = [4.0, 3.5, 3.0, 2.5]  # energy in 4 directions: rank 4 at τ = 0.99
G2 = G1 + [2.0, 1.8, 1.6, 1.4]  # 4 more (E(4) = 0.79): rank 8 from the refresh at step T on


def diag(values: list[float]) -> torch.Tensor:
    """(OUT, IN) gradient with G[i, i] = values[i]: its singular vectors are exactly ±eᵢ (LAPACK, checked below),
    so Ĝ = G Qᵀ keeps each coordinate's gradient exact and W's column i only ever sees rank coordinate i."""
    g = torch.zeros(OUT, IN)
    for i, v in enumerate(values):
        g[i, i] = v
    return g


def run(mode: str, grows: bool, policy: str = "keep", per_layer: bool = False, steps: int = T + 5):
    """Constant gradient G1 (rank 4); with ``grows`` G2 (rank 8) from step T. Records (W, m, v, rank) after each
    step. Per-layer: the update happens in the backward hook (gradient from L = ⟨W, G⟩)."""
    torch.manual_seed(0)
    net = nn.ModuleDict({"attn": nn.Linear(IN, OUT, bias=False)})
    cfg = hmt.Config(mode=mode, basis="svd", rank=None, rank_candidates=(4, 8), tau=0.99, update_interval=T, lr=LR,
                     scale=1.0, moment_policy=policy, norm_limiter=False, per_layer=per_layer)
    method = hmt.make(cfg)
    method.attach(net, max_grad_norm=None)
    s = method.opt.slots[0]
    out = []
    for k in range(steps):
        g = diag(G2 if grows and k >= T else G1)
        if per_layer:
            (net.attn.weight * g).sum().backward()
        else:
            net.attn.weight.grad = g.clone()
        method.step()
        method.zero_grad()
        out.append((net.attn.weight.detach().clone(), s.m.clone(), s.v.clone(), s.rank))
    return out, method


@pytest.mark.parametrize("mode,policy,per_layer", [("A", "keep", False), ("A", "project", False),
                                                   ("A", "keep", True), ("B", "keep", False)])
def test_rank_increase_gives_new_coordinates_a_fresh_clock(mode, policy, per_layer):
    """After the rank grows 4 → 8 at step T, each new coordinate's steps under a constant gradient have Adam's
    fresh-start size |ΔW| = lr·|m̂|/(√v̂ + ε) ≈ lr·1 (Mode B: its channel scaling ‖N̂‖/‖R‖ = 1 with √scale = 1),
    not 3.16·lr, 4.25·lr, ... as zero-filled moments under the global clock t ≈ 5 would give; the old coordinates'
    moments and weights are bit-identical to a run whose rank stayed 4."""
    grown, method = run(mode, True, policy, per_layer)
    same, _ = run(mode, False, policy, per_layer)
    assert [r[3] for r in grown] == [4] * T + [8] * 5 and [r[3] for r in same] == [4] * (T + 5)
    assert method.opt.slots[0].clock.born == (0, 0, 0, 0, T, T, T, T)
    for k in range(T, T + 5):
        before = grown[k - 1][0]
        step = (before - grown[k][0]).diagonal()[4:8]  # new coordinates c = 4..7 only touch W[c, c]
        torch.testing.assert_close(step, torch.full((4,), LR), rtol=1e-5, atol=0)  # fresh: ≈ lr·1 every step
        w_new, m_new, v_new, _ = grown[k]
        w_old, m_old, v_old, _ = same[k]
        assert torch.equal(m_new[:, :4], m_old) and torch.equal(v_new[:, :4], v_old), f"step {k}: old moments"
        assert torch.equal(w_new[:, :4], w_old[:, :4]), f"step {k}: old coordinates' weights"
        assert torch.equal(w_new[:, 8:], w_old[:, 8:])


def test_young_clock_index_tensors_are_built_once_per_born():
    """After the rank increase the young coordinates' index tensors are built once (when ``born`` changes) and
    reused: a later step builds no tensor from host data (``torch.tensor(list)`` dispatches ``lift_fresh``, a
    host-to-device copy on CUDA) and holds the very same index tensors; the update is the uncached one's."""
    _, method = run("A", True, steps=T + 2)
    s = method.opt.slots[0]
    cached = s.clock.born_index[1]
    assert s.clock.born == (0, 0, 0, 0, T, T, T, T) and [g.born for g in cached] == [T]
    net_w, grad = s.param.detach().clone(), diag(G2)
    counter = DispatchCounter()
    with counter:
        s.param.grad = grad
        method.step()
        method.zero_grad()
    assert s.clock.born_index[1] is cached, "index tensors rebuilt although born did not change"
    counts = counter.report()
    fresh = {k: n for k, n in counts.sync_ops.items() if "lift_fresh" in k}
    assert not fresh, f"a step built tensors from host data: {fresh} at {counts.sync_sites}"
    step = (net_w - s.param.detach()).diagonal()[4:8]  # the young coordinates still take fresh-clock steps ≈ lr
    torch.testing.assert_close(step, torch.full((4,), LR), rtol=1e-5, atol=0)


def test_zero_filled_moments_under_the_global_clock_would_be_oversized():
    """The defect the clocks fix, computed with the update functions: m = v = 0 and bias correction at a large t
    (both corrections ≈ 1) make the first step in a new coordinate (1 − β₁)g / √((1 − β₂)g²) ≈ 3.16·sign(g)
    (at t = 200: 1 − β₂ᵗ = 0.18, so 1.35·sign(g)); its own clock gives 1."""
    g = torch.tensor([[0.7]])
    m, v = torch.zeros(1, 1), torch.zeros(1, 1)
    upd.adam_moments_(m, v, g, 0.9, 0.999, "torch")
    kw = dict(lr=1.0, beta1=0.9, beta2=0.999, eps=1e-12, style="torch")
    old_clock, _ = upd.adam_step(m, v, 100_000, **kw)
    at_200, _ = upd.adam_step(m, v, 200, **kw)
    assert abs(float(at_200) - 1.35) < 0.01
    own_clock, _ = upd.adam_step(m, v, 1, **kw)
    assert abs(float(old_clock) - 0.1 / 0.001 ** 0.5) < 1e-4 and abs(float(own_clock) - 1.0) < 1e-6


@pytest.mark.parametrize("left,right", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("style,direction", [("torch", False), ("hf", False), ("torch", True)])
def test_fresh_clock_touches_only_young_coordinates(left, right, style, direction):
    born, t = (0, 0, 4, 6), 9
    r, n = 4, 5
    shape = (r, r) if left and right else ((r, n) if left else (n, r))
    gen = torch.Generator().manual_seed(0)
    m, v = torch.randn(shape, generator=gen), torch.rand(shape, generator=gen)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, style=style)
    fn = upd.adam_direction if direction else upd.adam_step
    d, step_size = fn(m, v, t, **kw)
    out = d.clone()
    groups = upd.clock_groups(born, t, left=left, right=right, device=m.device)
    upd.fresh_clock_(out, m, v, groups, step_size=step_size, direction=direction, **kw)
    age_of = torch.tensor([t - b for b in born])
    if left and right:
        ages = torch.minimum(age_of[:, None], age_of[None, :])
    elif left:
        ages = age_of[:, None].expand(shape)
    else:
        ages = age_of[None, :].expand(shape)
    for pos in torch.cartesian_prod(*(torch.arange(x) for x in shape)).tolist():
        i, j = pos
        age = int(ages[i, j])
        if age == t:
            assert out[i, j] == d[i, j]  # old: untouched, bit for bit
        else:
            dy, sy = fn(m[i:i + 1, j:j + 1], v[i:i + 1, j:j + 1], age, **kw)
            torch.testing.assert_close(out[i, j] * step_size, dy[0, 0] * sy, rtol=1e-6, atol=0)


def unit_rows(indices: list[int], n: int = 8) -> proj.Basis:
    return proj.Basis(None, torch.eye(n)[indices])


def test_transfer_born_rules():
    old, t = unit_rows([0, 1, 2, 3]), 10
    grown = unit_rows([0, 1, 2, 3, 4, 5])
    assert upd.transfer_born(None, old, grown, "keep", t) == (0, 0, 0, 0, 10, 10)
    assert upd.transfer_born(None, old, unit_rows([0, 1, 2, 3]), "keep", t) is None  # same rank: unchanged
    assert upd.transfer_born((0, 0, 0, 0, 10, 10), grown, unit_rows([0, 1, 2]), "keep", 20) is None  # shrink
    assert upd.transfer_born((0, 0, 0, 0, 10, 10), grown, unit_rows(list(range(5))), "keep", 20) == (0, 0, 0, 0, 10)
    assert upd.transfer_born((0, 0, 7, 7), old, grown, "reset", t) is None
    # project: permuted old vectors keep their clocks, vectors outside the old span are born now
    assert upd.transfer_born((0, 3, 0, 0), old, unit_rows([2, 1, 6, 0, 3, 7]), "project", t) == (0, 3, 10, 0, 0, 10)
    assert upd.transfer_born(None, old, unit_rows([3, 2, 1, 0]), "project", t) is None
    assert upd.retire_born((0, 10), 10 + 100, 0.9, 0.999) == (0, 10)
    assert upd.retire_born((0, 10), 10 + 17000, 0.9, 0.999) is None


def test_born_round_trips_through_state_dict():
    _, method = run("A", True, steps=T + 1)
    twin = hmt.make(method.config)
    net = nn.ModuleDict({"attn": nn.Linear(IN, OUT, bias=False)})
    twin.attach(net, max_grad_norm=None)
    twin.load_state_dict(method.state_dict())
    assert twin.opt.slots[0].clock.born == method.opt.slots[0].clock.born == (0, 0, 0, 0, T, T, T, T)


# ------------------------------------------------------------------------------------------- random-basis rank
def with_spectrum(s: torch.Tensor, out_dim: int, in_dim: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(out_dim, s.numel(), generator=gen)).Q
    v = torch.linalg.qr(torch.randn(in_dim, s.numel(), generator=gen)).Q
    return u @ torch.diag(s) @ v.t()


def test_captured_energy():
    s = torch.cat([torch.linspace(3, 1, 12), torch.full((84,), 0.05)])
    g = with_spectrum(s, 128, 96)
    f = proj.exact_svd(g, 96)
    e = energy_ratios(f.s, f.total_energy)
    for r in (4, 12, 40):  # an SVD basis captures the spectral energy E(r)
        assert abs(captured_energy(g, None, f.vh[:r]) - float(e[r - 1])) < 1e-5
    flat = with_spectrum(torch.ones(96), 128, 96)  # GᵀG = I: every r-dim subspace captures exactly r/96
    for r in (8, 32):
        b, _ = proj.random_basis((128, 96), r, False, True, 5, torch.device("cpu"), torch.float32)
        assert abs(captured_energy(flat, b.left, b.right) - r / 96) < 1e-5
    # rank-1 G = u vᵀ: a Gaussian r-dim subspace captures ‖Π v‖² ~ Beta(r/2, (n−r)/2), mean r/n (= 1/6 for r = 16,
    # n = 96), std √(2r(n−r)/(n²(n+2))) = 0.053; the mean of 64 seeds has std 0.0067, so 0.03 is 4.5 std
    one = with_spectrum(torch.ones(1), 128, 96)
    draws = [captured_energy(one, *proj.random_basis((128, 96), 16, False, True, seed, torch.device("cpu"),
                                                     torch.float32)[0]) for seed in range(64)]
    assert abs(sum(draws) / 64 - 16 / 96) < 0.03
    assert captured_energy(torch.zeros(4, 3), None, torch.randn(2, 3)) == 1.0


def random_method(g: torch.Tensor, **kw):
    """No state budget: full rank here (96, fp32) would exceed GaLore's state ("galore") by Mode B's 4-byte
    limiter norm, and these checks are about the τ rule alone."""
    net = nn.ModuleDict({"attn": nn.Linear(g.shape[1], g.shape[0], bias=False)})
    method = hmt.make(hmt.Config(mode="B", basis="random", rank=None, update_interval=10, per_layer=False,
                                 state_budget=None, **kw))
    method.attach(net, max_grad_norm=None)
    seed0 = method.opt.slots[0].seed
    net.attn.weight.grad = g.clone()
    method.step()
    return method.opt.slots[0], seed0


def test_random_basis_rank_is_chosen_by_what_the_basis_captures():
    low = with_spectrum(torch.cat([torch.ones(12), torch.full((84,), 1e-3)]), 128, 96)
    cands = (8, 16, 32, 64)
    legacy, _ = random_method(low, rank_candidates=cands, tau=0.95, random_rank="spectrum")
    assert legacy.rank == 16  # the spectrum's answer (12 directions), which a Gaussian basis does not realize
    s, seed0 = random_method(low, rank_candidates=cands, tau=0.95)
    bases = {r: proj.random_basis((128, 96), r, False, True, seed0, torch.device("cpu"), torch.float32)
             for r in cands}
    captured = [captured_energy(low, b.left, b.right) for b, _ in bases.values()]
    assert s.rank == choose_rank_by_capture(captured, cands, 0.95) == 64
    assert torch.equal(s.basis.right, bases[64][0].right) and s.seed == bases[64][1]  # the basis measured is used
    flat = with_spectrum(torch.ones(96), 128, 96)  # E(r) = r/96 exactly: ratios to E(64) are 1/8, 1/4, 1/2
    assert random_method(flat, rank_candidates=cands, tau=0.45)[0].rank == 32
    assert random_method(flat, rank_candidates=cands, tau=0.55)[0].rank == 64
    # rank_fallback="full": full rank captures everything, so the rule is E(r) ≥ τ (32/96 ≥ 0.3 > 16/96)
    assert random_method(flat, rank_candidates=cands, tau=0.3, rank_fallback="full")[0].rank == 32
    assert random_method(flat, rank_candidates=cands, tau=0.95, rank_fallback="full")[0].rank == 96


def test_random_rank_in_a_dry_run_is_the_largest():
    """Fake tensors have no values to measure: the largest candidate, the upper bound whose memory counts."""
    method = hmt.make(hmt.Config(basis="random", rank=None, rank_candidates=(8, 16), tau=0.1))
    net = nn.ModuleDict({"attn": nn.Linear(96, 128, bias=False)})
    method.attach(net, max_grad_norm=None)
    with FakeTensorMode():
        grad = torch.empty(128, 96)
        opt = method.opt
        assert random_capture(opt.projection, opt.slots[0], grad, False, True, opt.budget)[0] == 16
