"""Update precision (hmt_core.precision): stochastic rounding is unbiased and seeded; fp32 master weights make a
BF16 model's step the fp32 model's step (HMT in every update path, AdamW); masters and the generator are state
(meter, state_dict round trip)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_tensors_close, tiny_llama
from torch import nn

from baselines import adamw
from hmt_core import hmt
from hmt_core import projection as proj
from hmt_core.precision import UpdateWriter, stochastic_round, write_rows

BF16_U = 2.0 ** -8  # BF16 unit roundoff (8 significant bits)


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(⌊x⌋, ⌈x⌉) in BF16 for positive fp32 x: truncation of the bit pattern, and the next value up."""
    lo = (x.view(torch.int32) & -65536).view(torch.float32)
    hi = (lo.view(torch.int32) + 65536).view(torch.float32)
    return lo, hi


# ------------------------------------------------------------------------------------------- stochastic rounding
def test_stochastic_rounding_is_unbiased():
    """Each of M values is rounded N times. A rounding of x is ⌈x⌉ with probability p and ⌊x⌋ otherwise, so the mean
    of N roundings has expectation ⌊x⌋ + p·ε (= x exactly when p = (x − ⌊x⌋)/ε) and standard error
    σ = ε·√(p(1 − p)/N). We keep p ∈ [1/16, 15/16] so Np ≥ 256 and the mean is Gaussian to good accuracy; the bound
    |mean − x| ≤ 6σ then fails for one element with probability 2·10⁻⁹ (M·2·10⁻⁹ ≈ 10⁻⁶ for all), while a bias of
    one 2⁻¹⁶ε step of the 16 random bits (or round-to-nearest's up to ε/2) exceeds it (negative control below)."""
    gen = torch.Generator().manual_seed(1)
    m, n = 512, 4096
    lo = torch.rand(m, generator=gen) * 4 + 0.5
    lo = (lo.view(torch.int32) & -65536).view(torch.float32)  # BF16 values in [0.5, 4.5)
    _, hi = bf16_neighbours(lo)
    p = 1 / 16 + torch.rand(m, generator=gen) * (14 / 16)
    x = lo + p * (hi - lo)  # fp32 between two BF16 neighbours
    sign = torch.where(torch.arange(m) % 2 == 0, 1.0, -1.0)  # negative values round symmetrically
    x = x * sign
    p_exact = (x.abs().view(torch.int32) & 0xFFFF).double() / 65536  # the fraction the 16 truncated bits encode
    draws = stochastic_round(x.expand(n, m).contiguous(), torch.Generator().manual_seed(0)).double()
    eps = (hi - lo).double()
    assert bool(((draws.abs() == lo.double()) | (draws.abs() == hi.double())).all())  # only the two neighbours
    sigma = eps * torch.sqrt(p_exact * (1 - p_exact) / n)
    err = draws.mean(0) - x.double()
    assert float((err.abs() / sigma).max()) < 6.0
    nearest = x.to(torch.bfloat16).double()  # negative control: round-to-nearest is biased by up to ε/2
    assert float(((nearest - x.double()).abs() / sigma).max()) > 6.0


def test_stochastic_rounding_exact_values_specials_and_determinism():
    special = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, float("inf"), -float("inf"), float("nan"), 1e-40])
    out = stochastic_round(special.repeat(1000), torch.Generator().manual_seed(0)).float().view(1000, -1)
    exact = special.to(torch.bfloat16).float()
    for j in (0, 1, 2, 3, 5, 6):  # BF16-representable values never move; infinities stay
        assert bool((out[:, j] == exact[j]).all())
    assert bool(torch.isnan(out[:, 7]).all())
    x = torch.randn(3, 1000)
    a = stochastic_round(x, torch.Generator().manual_seed(5))
    b = stochastic_round(x, torch.Generator().manual_seed(5))
    c = stochastic_round(x, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="fp32"):
        stochastic_round(x.double(), None)


def test_write_rows_bounds_fp32_chunk():
    assert write_rows((4, 5)) == [...]
    spans = write_rows((1000, 1000), chunk_bytes=4 * 1000 * 300)
    assert [(s.start, s.stop) for s in spans] == [(0, 300), (300, 600), (600, 900), (900, 1000)]


# ------------------------------------------------------------------------------------------- master weights
def linear_loss_step(model: nn.Module, grads: dict[str, torch.Tensor], step) -> object:
    """A loss whose gradient is ``grads`` exactly in any weight dtype: L = Σ_p ⟨p, C_p⟩ with BF16-representable C_p
    (∂L/∂p = C_p, no rounding), so a BF16 and an fp32 model get the same gradient values and what differs between
    them is only the optimizer step. Backward runs (per-layer hooks fire), then ``step``."""
    loss = sum((p * grads[n].to(p.dtype)).sum() for n, p in model.named_parameters())
    loss.backward()
    out = step()
    return out


def random_grads(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(p.shape, generator=gen) * 0.1).to(torch.bfloat16).float()
            for n, p in model.named_parameters()}


def force_hmt_state(dst, src, masters: bool) -> None:
    """Put HMT ``dst`` (fp32 model) into ``src``'s state: weights = src's fp32 masters, moments, counters, bases
    (BF16 values upcast), seeds, limiter memory."""
    for a, b in zip(dst.opt.slots, src.opt.slots):
        a.param.data.copy_(b.master if masters and b.master is not None else b.param.data.float())
        for key in ("step", "adam_t", "born"):
            setattr(a.clock, key, getattr(b.clock, key))
        for key in ("seed", "rank"):
            setattr(a, key, getattr(b, key))
        for key in ("m", "v", "limiter_prev"):
            t = getattr(b, key)
            setattr(a, key, None if t is None else t.detach().clone())
        a.basis = None if b.basis is None else proj.Basis(*(None if t is None else t.float().clone()
                                                                for t in b.basis))


# One step of a BF16 model with fp32 masters vs the same step of an fp32 model from the same state (weights = the
# masters) and the same gradient values. Dense parameters run identical fp32 arithmetic: bit-identical. Projected
# weights differ by what HMT computes in the weight dtype by design, each a relative rounding ≤ u = 2⁻⁸:
# - full rank (sides="identity"; identity bases are exact in BF16, Ĝ = G exactly): only the direction, rounded to
#   the basis dtype before the reconstruction (``kops.factors``): |Δ_bf16 − Δ_fp32| ≤ u·|Δ| per element.
#   (Mode B: the norms of the BF16 Ĝ in APOLLO's scaling, ≤ u as well.) IDENTITY_TOL = u (measured ≤ 1.7e-3 =
#   0.43u in units of |Δ| + max|Δ|).
# - low rank: also the BF16 basis and the BF16 projected gradient Ĝ = PᵀG (matmul output), so an element of the
#   update, a sum of r products each perturbed by ≤ 3u, moves by ≤ 3u·Σ|terms| ≲ 3u·(|Δ| + max|Δ|).
#   LOWRANK_TOL = 3u (measured ≤ 4.7e-3 = 1.2u). Except at step 0: Adam's first direction is sign(Ĝ) and a
#   coordinate with |Ĝ| below its BF16 rounding flips sign (measured: 9% of the update norm-wise), so the low-rank
#   comparison starts at step 1, where the moments' history bounds a perturbation of Ĝ by ~(1 − β₁)δ.
# Clipping is enabled with max_grad_norm=1e6 where listed: the deferred (finish_step) path, with a coefficient of
# exactly 1 (a real coefficient from BF16 gradient norms would be BF16-rounded itself). Row chunking is forced
# (chunk_rows_for → 16 rows) so the row-chunked dense and Mode B writes run. Plain BF16 weights at lr 1e-5 lose
# most of the update (relative error ~1: the negative control below), the effect this is about.
IDENTITY_TOL = BF16_U
LOWRANK_TOL = 3 * BF16_U


@pytest.mark.parametrize("kw,clip", [
    (dict(mode="A", sides="identity", per_layer=True), 1e6),
    (dict(mode="A", sides="identity", per_layer=False), None),
    (dict(mode="B", sides="identity", per_layer=True), None),
    (dict(mode="A", basis="svd", per_layer=True), None),
    (dict(mode="A", basis="rsvd", per_layer=True), 1e6),
    (dict(mode="A", basis="rsvd", per_layer=False), None),
    (dict(mode="B", basis="random", per_layer=True, scaling="channel"), None),
    (dict(mode="B", basis="random", per_layer=False, scaling="tensor"), None),
], ids=["A-full-per_layer-deferred", "A-full-ordinary", "B-full-per_layer", "A-svd-per_layer",
        "A-rsvd-per_layer-deferred", "A-rsvd-ordinary", "B-channel-per_layer", "B-tensor-ordinary"])
def test_hmt_master_weights_step_equals_fp32_step(kw, clip, monkeypatch):
    from hmt_core.optim import optimizer as hopt
    monkeypatch.setattr(hopt, "chunk_rows_for", lambda shape, dtype, chunk_bytes=0, like=None: 16)
    full = kw.get("sides") == "identity"
    tol = IDENTITY_TOL if full else LOWRANK_TOL
    cfg = dict(rank=None if full else 8, update_interval=3, lr=1e-5, weight_decay=0.01, scale=1.0 if full else 0.25,
               **kw)
    bf16 = tiny_llama(dtype=torch.bfloat16)
    m16 = hmt.make(hmt.Config(master_weights=True, **cfg))
    m16.attach(bf16, max_grad_norm=clip)
    f32 = tiny_llama(dtype=torch.float32)
    m32 = hmt.make(hmt.Config(**cfg))
    m32.attach(f32, max_grad_norm=clip)
    masters = [s.master for s in m16.opt.slots]
    assert all(t is not None and t.dtype == torch.float32 for t in masters)
    state_ids = {id(t) for t in m16.state_tensors()}
    assert all(id(t) in state_ids for t in masters)  # the meter counts them as optimizer state
    for k in range(5):
        grads = random_grads(bf16, k)
        before = [s.master.clone() for s in m16.opt.slots]
        if k > 0:
            force_hmt_state(m32, m16, masters=True)
        else:
            for a, b in zip(m32.opt.slots, m16.opt.slots):
                a.param.data.copy_(b.master)
        linear_loss_step(bf16, grads, m16.step)
        m16.zero_grad()
        linear_loss_step(f32, grads, m32.step)
        m32.zero_grad()
        for s in m16.opt.slots:  # the BF16 weight is the rounded master
            assert torch.equal(s.param.data, s.master.to(torch.bfloat16)), s.name
        rows = [(s.name, s.master - b0, r.param.data - b0)
                for s, r, b0 in zip(m16.opt.slots, m32.opt.slots, before) if full or k > 0 or not s.projected]
        assert_tensors_close(rows, rtol=tol, atol=tol, atol_of_max=True, step=k, what="update")
        dense = [(s.name, s.master - b0, r.param.data - b0)
                 for s, r, b0 in zip(m16.opt.slots, m32.opt.slots, before) if not s.projected]
        assert_tensors_close(dense, rtol=0, atol=0, step=k, what="dense update")


def test_plain_bf16_loses_updates_negative_control():
    cfg = dict(sides="identity", scale=1.0, update_interval=3, lr=1e-5, mode="A")
    bf16 = tiny_llama(dtype=torch.bfloat16)
    m16 = hmt.make(hmt.Config(**cfg))
    m16.attach(bf16, max_grad_norm=None)
    f32 = tiny_llama(dtype=torch.float32)
    m32 = hmt.make(hmt.Config(**cfg))
    m32.attach(f32, max_grad_norm=None)
    for a, b in zip(f32.parameters(), bf16.parameters()):
        a.data.copy_(b.data.float())
    before = [p.detach().float().clone() for p in bf16.parameters()]
    grads = random_grads(bf16, 0)
    linear_loss_step(bf16, grads, m16.step)
    linear_loss_step(f32, grads, m32.step)
    rows = [(n, p.float() - b0, q - b0) for (n, p), q, b0 in zip(bf16.named_parameters(), f32.parameters(), before)]
    with pytest.raises(AssertionError, match="^step 0: "):
        assert_tensors_close(rows, rtol=IDENTITY_TOL, atol=IDENTITY_TOL, atol_of_max=True, step=0, what="update")


# AdamW with masters runs torch.optim.AdamW's formula in fp32 (hmt_core.optim.update, style "torch") on the fp32
# master with the BF16 gradient's values: the reference is torch.optim.AdamW on an fp32 model with the same
# values. Both are fp32 with the same operations up to association (torch: addcdiv(p, m, denom, −η/bc₁); ours:
# p − (m·η/bc₁)/denom), a few fp32 roundings of ≤ u₃₂ = 2⁻²⁴ each, |m̂|/√v̂ ≤ ~7: ≲ 10u₃₂·max|ΔW| (the bound of
# test_hmt_optim's ADAMW_TOL); 2e-6 of (|Δ| + max|Δ|) per tensor. Moments (fp32 in both) alike.
ADAMW_TOL = 2e-6


def test_adamw_master_weights_step_equals_fp32_torch_adamw():
    hp = dict(lr=1e-5, weight_decay=0.1, eps=1e-8)
    bf16 = tiny_llama(dtype=torch.bfloat16)
    meth = adamw.make(adamw.Config(master_weights=True, **hp))
    meth.attach(bf16, max_grad_norm=None)
    opt = meth.driver.optimizer
    f32 = tiny_llama(dtype=torch.float32)
    ref = torch.optim.AdamW(f32.parameters(), **hp)
    masters = [opt.state[p]["master"] for p in bf16.parameters()]
    assert {id(t) for t in masters} <= {id(t) for t in meth.state_tensors()}
    for k in range(4):
        grads = random_grads(bf16, k)
        for q, m, p in zip(f32.parameters(), masters, bf16.parameters()):  # the same state: weights and moments
            q.data.copy_(m)
            if k > 0:
                ref.state[q]["exp_avg"].copy_(opt.state[p]["exp_avg"])
                ref.state[q]["exp_avg_sq"].copy_(opt.state[p]["exp_avg_sq"])
        before = [m.clone() for m in masters]
        linear_loss_step(bf16, grads, meth.step)
        meth.zero_grad()
        linear_loss_step(f32, grads, ref.step)
        ref.zero_grad()
        names = [n for n, _ in bf16.named_parameters()]
        rows = [(n, m - b0, q.data - b0) for n, m, q, b0 in zip(names, masters, f32.parameters(), before)]
        assert_tensors_close(rows, rtol=ADAMW_TOL, atol=ADAMW_TOL, atol_of_max=True, step=k, what="update")
        moments = [(n, opt.state[p][key], ref.state[q][key]) for n, p, q in zip(names, bf16.parameters(),
                                                                               f32.parameters())
                   for key in ("exp_avg", "exp_avg_sq")]
        assert_tensors_close(moments, rtol=ADAMW_TOL, atol=ADAMW_TOL, atol_of_max=True, step=k, what="moment")
        for m, p in zip(masters, bf16.parameters()):
            assert torch.equal(p.data, m.to(torch.bfloat16))


def test_probe_measures_without_changing_plain_writes():
    """The benchmark's probe routes a plain BF16 write through an fp32 temporary + round-to-nearest: with no weight
    decay (one rounding either way) the weights are bit-identical to the in-place write."""
    results = []
    for probe in (None, lambda p, i, d: None):
        model = tiny_llama(dtype=torch.bfloat16)
        method = hmt.make(hmt.Config(rank=8, update_interval=2, lr=1e-3))
        method.attach(model, max_grad_norm=1.0)
        method.opt.writer.probe = probe
        for k in range(3):
            linear_loss_step(model, random_grads(model, k), method.step)
            method.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ------------------------------------------------------------------------------------------- state round trip
def make_method(name: str, **kw):
    if name == "hmt":
        return hmt.make(hmt.Config(rank=8, update_interval=2, lr=1e-4, **kw))
    return adamw.make(adamw.Config(lr=1e-4, **kw))


@pytest.mark.parametrize("name", ["hmt", "adamw"])
@pytest.mark.parametrize("mode", ["master_weights", "stochastic_rounding"])
def test_state_dict_round_trips_masters_and_generator(name, mode):
    """Resume after 2 steps from state_dict (weights + method state, through torch.save) continues bit-identically:
    the fp32 masters keep their dtype and the stochastic-rounding generator its position."""
    import io
    model = tiny_llama(dtype=torch.bfloat16)
    method = make_method(name, **{mode: True})
    method.attach(model, max_grad_norm=1.0)
    for k in range(2):
        linear_loss_step(model, random_grads(model, k), method.step)
        method.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "method": method.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    twin = tiny_llama(seed=3, dtype=torch.bfloat16)
    twin.load_state_dict(saved["model"])
    resumed = make_method(name, **{mode: True})
    resumed.attach(twin, max_grad_norm=1.0)
    resumed.load_state_dict(saved["method"])
    masters = [t for t in resumed.state_tensors() if t.dtype == torch.float32 and t.dim() >= 1]
    if mode == "master_weights":
        n_params = sum(p.numel() for p in twin.parameters())
        assert sum(t.numel() for t in masters) >= n_params  # fp32 masters (and fp32 moments for adamw) kept fp32
    for k in range(2, 5):
        for m, net in ((method, model), (resumed, twin)):
            linear_loss_step(net, random_grads(net, k), m.step)
            m.zero_grad()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n
    for a, b in zip(method.state_tensors(), resumed.state_tensors()):
        assert torch.equal(a, b)


def test_config_errors():
    with pytest.raises(ValueError, match="alternatives"):
        hmt.Config(master_weights=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="dense_8bit"):
        hmt.Config(dense_8bit=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="alternatives"):
        adamw.Config(master_weights=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="method.random_rank"):
        hmt.Config(random_rank="oracle")
    model = tiny_llama(dtype=torch.float16)
    with pytest.raises(ValueError, match="rounds to bfloat16"):
        make_method("hmt", stochastic_rounding=True).attach(model, max_grad_norm=None)


def test_stochastic_rounding_moves_small_updates_in_expectation():
    """At lr 1e-5 plain BF16 AdamW leaves almost every weight of magnitude ≥ 2⁻⁸ unchanged; with stochastic
    rounding the mean change over many steps is the intended one (the accumulated fp32 update)."""
    torch.manual_seed(0)
    w0 = (torch.rand(256, 256) * 0.5 + 0.5).to(torch.bfloat16)  # |w| in [0.5, 1): ulp 2⁻⁸, update 1e-5 ≪ ulp/2
    drift = {}
    for mode in ("plain", "sr"):
        net = nn.Linear(256, 256, bias=False).to(torch.bfloat16)
        net.weight.data.copy_(w0)
        meth = adamw.make(adamw.Config(lr=1e-5, stochastic_rounding=mode == "sr"))
        meth.attach(net, max_grad_norm=None)
        for _ in range(100):
            net.weight.grad = torch.ones_like(net.weight)  # constant gradient: Adam step ≈ lr per element
            meth.step()
            meth.zero_grad()
        drift[mode] = float((w0.float() - net.weight.detach().float()).mean())
    assert drift["plain"] == 0.0
    # intended: 100 steps of ≈ 1e-5 = 1e-3 per element. An element moves by ε = 2⁻⁸ with probability p = 1e-5/ε
    # per step: variance 100·p(1−p)·ε² ≈ 3.9e-6 per element, so the mean over 65,536 elements has std 7.7e-6
    # (0.8% of 1e-3); 5% is 6.5 standard errors (BF16 moments add a bias ≤ a few 2⁻⁸ = 0.4%).
    assert math.isclose(drift["sr"], 1e-3, rel_tol=0.05), drift


def test_writer_refuses_both_modes():
    with pytest.raises(ValueError, match="alternatives"):
        UpdateWriter(master_weights=True, stochastic_rounding=True)
