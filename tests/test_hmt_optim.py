"""HMT optimizer: identity projection == torch AdamW, per-layer == ordinary step (clipping, accumulation),
config errors, exact resume, robustness, state accounting.

The equivalence tests compare one step at a time from the same state (teacher forcing, ``helpers.replay``): the
reference (torch.optim.AdamW, or HMT's ordinary step) runs, its state is recorded before every step, and HMT is
put into that state and takes the step itself. Rounding differences of one step cannot compound, so the result
does not depend on which BLAS kernel the CPU picks. They run in float64; HMT's optimizer arithmetic is float32
by design (fp32 moments; the projected gradient is cast with ``.float()``), so against a float64 reference what
remains is fp32 rounding (unit roundoff u = 2⁻²⁴ ≈ 6e-8) of one Adam step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import (assert_bases_close, assert_tensors_close, batches, force_state, hmt_snapshot, lm_step, record,
                     reference_snapshot, replay, state_rows, tiny_llama, update_rows)
from torch import nn

from hmt_core import hmt

DTYPE = torch.float64
# vs torch.optim.AdamW (fp64): one update element-wise within 2e-6·(|ΔW| + max|ΔW|) per tensor: HMT's fp32 Adam
# does a handful of roundings per element, each ≤ u·(magnitudes involved), and |m|/√v ≤ ~7 for β = (0.9, 0.999),
# so ≲ 10u·max|ΔW| ≈ 6e-7·max (the check holds down to 1.9e-7); moments (fp32 in HMT) likewise within
# 2e-6·(|m| + max|m|): the EMA's rounding where β₁m and (1 − β₁)g cancel is ≤ ~2u·max (holds down to 1.5e-7).
# A real difference (β₂ 0.999 → 0.9991, weight decay 0.1 → 0.1001) needs 5e-5 or more (negative controls).
ADAMW_TOL = 2e-6
# The global gradient norm HMT returns is the fp32 norm of per-parameter norms (clip_grad_norm_ in fp64): u-level.
NORM_RTOL = 1e-6
# Per-layer vs ordinary step: the same HMT arithmetic in the same dtypes (fp32 optimizer math on fp64 gradients),
# only called from backward hooks instead of after backward; the same gradient goes into the same functions, so
# the results agree to a few fp32 roundings at most (measured: bit-identical; Mode B with lagged clipping 2e-12,
# the test's coefficient being computed in Python floats). 1e-6·(|x| + max|x|): far below a real difference (a
# 1e-4 change of β₁ needs 4.5e-4; a lagged vs an exact clipping coefficient, a wrong accumulation: O(1)).
SAME_TOL = 1e-6
# Accumulation over micro-batches: per-layer Mode A accumulates Σᵢ PᵀGᵢ in an fp32 low-rank buffer (hooks.py),
# the ordinary step sums the full gradients in the parameter dtype (fp64) and projects once. Where PᵀG₁ and PᵀG₂
# cancel, the fp32 sum keeps an absolute error ~u·(|PᵀG₁| + |PᵀG₂|), which the moments show as u-level of their
# largest entry (checked with SAME_TOL). Adam's first step is nearly sign(Ĝ) (N = Ĝ/(|Ĝ| + ε) with ε = 1e-8), so
# such a coordinate's update can move by much more than u: the update check holds down to 2.8e-6 (at step 0;
# ≤ 3e-7 afterwards, once v has history). 1e-5·(|ΔW| + max|ΔW|) for the update, a 3.6× margin; a wrong
# accumulation changes the moments by O(1), a 1e-4 change of a hyperparameter the update by ≥ 1e-4.
ACCUM_UPDATE_TOL = 1e-5
# Bases each side computes at a refresh: svd / rsvd ones are compared sign-aligned, within the SVD's conditioning
# (helpers.assert_bases_close); seeded random ones are the same fp32 draws scaled by 1/√r: 1e-6 relative.
RANDOM_BASIS_RTOL = 1e-6


def train(model, method, data, micro: int = 1) -> list[float]:
    run = lm_step(model, method.step, method.zero_grad, method.start_micro_batch, micro=micro)
    return [run(x) for x in data]


def attached(model, max_grad_norm=None, **kw):
    method = hmt.make(hmt.Config(**kw))
    method.attach(model, max_grad_norm=max_grad_norm)
    return method


def assert_same_params(a, b, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)


def check_step(method, model, snaps, *, tol: float, update_tol: float | None = None, ref_norms=None):
    """``replay``'s check: HMT's update (``update_tol``, default ``tol``), moments (``tol``), fresh bases, limiter
    memory and returned gradient norm against the reference's."""
    update_tol = tol if update_tol is None else update_tol
    source = "random" if method.config.basis == "random" else "svd"

    def check(k, norm, refreshed=None):
        if ref_norms is not None:
            assert abs(norm - ref_norms[k]) <= NORM_RTOL * abs(ref_norms[k]), \
                f"step {k}: gradient norm {norm} vs reference {ref_norms[k]} (rtol={NORM_RTOL:.0e})"
        before, after = snaps[k], snaps[k + 1]
        if refreshed is not None:
            assert_bases_close(refreshed, before, after, source=source, random_rtol=RANDOM_BASIS_RTOL, step=k)
        assert_tensors_close(update_rows(model, before, after), rtol=update_tol, atol=update_tol, atol_of_max=True,
                             step=k, what="update")
        rows = state_rows(method, after, k)  # also: step counters, ranks, seeds equal
        assert_tensors_close(rows["moments"], rtol=tol, atol=tol, atol_of_max=True, step=k, what="moment")
        assert_tensors_close(rows["limiter"], rtol=tol, atol=0, step=k, what="limiter memory")
        if "rank_history" in after:  # an HMT reference: the same refreshes with the same ranks
            history = method.summary()["rank/history"]
            assert history == after["rank_history"], f"step {k}: rank history {history} vs {after['rank_history']}"

    return check


def adamw_reference(data, *, clip: float, **adamw):
    """torch.optim.AdamW with global-norm clipping over ``data``: (snapshots, gradient norm of each step)."""
    ref = tiny_llama(dtype=DTYPE)
    opt = torch.optim.AdamW(ref.parameters(), **adamw)

    def step(x):
        ref(input_ids=x, labels=x).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return float(norm)

    return record(lambda: reference_snapshot(ref, opt), step, data)


@pytest.mark.parametrize("per_layer", [False, True])
def test_identity_full_rank_equals_torch_adamw(per_layer):
    data = batches(8)
    snaps, norms = adamw_reference(data, clip=0.5, lr=3e-3, weight_decay=0.1, eps=1e-8)
    assert min(norms) > 0.5  # clipping was active
    model = tiny_llama(dtype=DTYPE)
    method = attached(model, 0.5, sides="identity", scale=1.0, lr=3e-3, weight_decay=0.1, adam_style="torch",
                      per_layer=per_layer)
    replay(method, model, lm_step(model, method.step, method.zero_grad, method.start_micro_batch), data, snaps,
           check_step(method, model, snaps, tol=ADAMW_TOL, ref_norms=norms))
    assert all(s.rank == min(s.param.shape) for s in method.opt.slots if s.projected)


@pytest.mark.parametrize("kw", [dict(beta2=0.9991), dict(weight_decay=0.1001)], ids=["beta2", "weight_decay"])
def test_adamw_equivalence_is_sensitive(kw):
    """Negative control: HMT off by 1e-4 in one hyperparameter fails the step-by-step check at step 0."""
    data = batches(1)
    snaps, norms = adamw_reference(data, clip=0.5, lr=3e-3, weight_decay=0.1, eps=1e-8)
    model = tiny_llama(dtype=DTYPE)
    method = attached(model, 0.5, **{**dict(sides="identity", scale=1.0, lr=3e-3, weight_decay=0.1,
                                            adam_style="torch", per_layer=False), **kw})
    with pytest.raises(AssertionError, match="^step 0: "):
        replay(method, model, lm_step(model, method.step, method.zero_grad, method.start_micro_batch), data, snaps,
               check_step(method, model, snaps, tol=ADAMW_TOL, ref_norms=norms))


def per_layer_vs_ordinary(kw, clip, data, micro=1, steps=None, **per_layer_kw):
    """HMT's ordinary step as the reference, per-layer HMT replayed one step at a time from its state."""
    a = tiny_llama(dtype=DTYPE)
    ma = attached(a, clip, per_layer=False, **kw)
    snaps, na = record(lambda: hmt_snapshot(ma, a), lm_step(a, ma.step, ma.zero_grad, ma.start_micro_batch, micro),
                       data)
    b = tiny_llama(dtype=DTYPE)
    mb = attached(b, clip, per_layer=True, **{**kw, **per_layer_kw})
    # with accumulation per-layer Mode A reports ‖Σᵢ PᵀGᵢ‖ for projected weights, not ‖ΣᵢGᵢ‖ (hooks.py, rule 4)
    check = check_step(mb, b, snaps, tol=SAME_TOL, update_tol=SAME_TOL if micro == 1 else ACCUM_UPDATE_TOL,
                       ref_norms=na if micro == 1 else None)
    replay(mb, b, lm_step(b, mb.step, mb.zero_grad, mb.start_micro_batch, micro), data[:steps], snaps, check)
    return ma, mb, na


@pytest.mark.parametrize("mode,basis", [("A", "rsvd"), ("A", "svd"), ("B", "random")])
def test_per_layer_in_backward_equals_ordinary_step(mode, basis):
    """No clipping: every update happens inside backward and equals the ordinary step (Mode A: also with
    exact global clipping, deferred in low-rank space)."""
    kw = dict(mode=mode, basis=basis, rank=None, rank_candidates=(8, 16, 32), tau=0.5, update_interval=4,
              lr=3e-3, weight_decay=0.01)
    clip = 0.3 if mode == "A" else None
    ma, mb, na = per_layer_vs_ordinary(kw, clip, batches(9))
    assert clip is None or min(na) > clip  # clipping was active
    hist = ma.summary()["rank/history"]
    assert hist == mb.summary()["rank/history"] and all(len(h) == 3 for h in hist.values())  # steps 0, 4, 8


def test_per_layer_equivalence_is_sensitive():
    """Negative control: per-layer HMT with β₁ off by 1e-4 fails the step-by-step check at step 0."""
    kw = dict(mode="A", basis="svd", rank=8, update_interval=4, lr=3e-3, weight_decay=0.01)
    with pytest.raises(AssertionError, match="^step 0: "):
        per_layer_vs_ordinary(kw, 0.3, batches(1), beta1=0.9 * (1 + 1e-4))


def test_full_gradients_of_projected_weights_never_coexist():
    model = tiny_llama()
    projected = hmt.projected_weight_names(model, ("attn", "mlp"))
    params = dict(model.named_parameters())
    live = []
    for name in projected:  # registered before the method's hooks, so they run first
        params[name].register_post_accumulate_grad_hook(
            lambda p: live.append(sum(params[n].grad is not None for n in projected)))
    method = attached(model, 1.0, rank=8, basis="rsvd", per_layer=True)
    train(model, method, batches(2), micro=2)
    assert len(live) == 2 * 2 * len(projected) and max(live) == 1


def test_grad_accumulation_in_low_rank_space_matches_accumulated_step():
    """With a gradient-independent basis (seeded random) and no clipping, accumulating Ĝ per micro-batch
    equals projecting the accumulated G: per-layer with 2 micro-batches == ordinary step on the sum, one step at
    a time from the same state (tolerances: ACCUM_UPDATE_TOL)."""
    kw = dict(mode="A", basis="random", rank=8, update_interval=3, lr=3e-3)
    ma, mb, _ = per_layer_vs_ordinary(kw, None, batches(5, batch=4), micro=2)
    assert ma.summary()["rank/history"] == mb.summary()["rank/history"]


def test_grad_accumulation_updates_only_after_last_micro_batch():
    model = tiny_llama()
    method = attached(model, 1.0, rank=8, basis="svd", per_layer=True)
    before = copy.deepcopy(model.state_dict())
    x = batches(1, batch=4)[0]
    for i, chunk in enumerate(x.chunk(2)):
        method.start_micro_batch(i, 2)
        model(input_ids=chunk, labels=chunk).loss.backward()
        if i == 0:
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    norm = method.step()
    assert norm > 0 and any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_mode_b_per_layer_clipping_uses_previous_step_norm():
    """Per-layer Mode B clips with the previous step's global-norm coefficient: one step at a time from the same
    state, it equals an ordinary step on the gradient scaled by that coefficient."""
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("mlp", nn.Linear(24, 40, bias=False))
    net = net.to(DTYPE)
    xs = [torch.randn(8, 24, dtype=DTYPE) for _ in range(3)]
    kw = dict(mode="B", basis="random", rank=4, lr=1e-2, update_interval=10)
    a, b = copy.deepcopy(net), copy.deepcopy(net)
    ma, mb = attached(a, None, per_layer=False, **kw), attached(b, 0.01, per_layer=True, **kw)
    check = check_step(mb, b, snaps := [hmt_snapshot(ma, a)], tol=SAME_TOL)
    coef = 1.0
    for k, x in enumerate(xs):
        force_state(mb, b, snaps[k])  # b's lagged coefficient is its own (from its previous step)
        a(x).square().sum().backward()
        a.mlp.weight.grad.mul_(coef)  # reference: ordinary step on the grad clipped by last step's coefficient
        ma.step()
        ma.zero_grad()
        snaps.append(hmt_snapshot(ma, a))
        b(x).square().sum().backward()
        norm = mb.step()
        mb.zero_grad()
        check(k, norm)
        coef = min(1.0, 0.01 / (norm + 1e-6))
    assert coef < 0.1  # clipping really was active


@pytest.mark.parametrize("kw,msg", [
    (dict(tau=1.5), "method.tau must be in (0, 1], got 1.5"),
    (dict(tau=0.0), "method.tau must be in (0, 1]"),
    (dict(rank=0), "method.rank must be a positive integer"),
    (dict(rank=-3), "method.rank"),
    (dict(update_interval=0), "method.update_interval must be > 0"),
    (dict(sides="diagonal"), "method.sides"),
    (dict(basis="qr"), "method.basis"),
    (dict(mode="B", scaling="row"), "method.scaling"),
    (dict(mode="C"), "method.mode"),
    (dict(moment_policy="rotate"), "method.moment_policy"),
    (dict(rank_candidates=()), "method.rank_candidates"),
    (dict(state_dtype="fp8"), "method.state_dtype"),
    (dict(mode="B", sides="two_sided"), "method.scaling"),
])
def test_config_errors_name_the_key(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("[", r"\[").replace("]", r"\]")):
        hmt.Config(**kw)


def test_rank_larger_than_layer_is_rejected_in_attach():
    with pytest.raises(ValueError, match=r"method.rank=65 exceeds min\(out, in\)=64 of model.layers.0"):
        attached(tiny_llama(), rank=65)


@pytest.mark.parametrize("kw", [
    dict(mode="A", basis="rsvd", rank=None, rank_candidates=(8, 16), tau=0.5, update_interval=2,
         moment_policy="project"),
    dict(mode="B", basis="random", rank=4, update_interval=2, scaling="channel", dense_8bit=True),
])
def test_state_dict_roundtrip_resumes_exactly(kw):
    data = batches(7)
    model = tiny_llama()
    method = attached(model, 0.5, **kw)
    train(model, method, data[:3])
    saved_model, saved_state = copy.deepcopy(model.state_dict()), copy.deepcopy(method.state_dict())
    train(model, method, data[3:])
    resumed = tiny_llama(seed=123)
    resumed.load_state_dict(saved_model)
    method2 = attached(resumed, 0.5, **kw)
    method2.load_state_dict(saved_state)
    train(resumed, method2, data[3:])
    assert_same_params(resumed, model, rtol=0, atol=0)
    assert method2.summary()["rank/history"] == method.summary()["rank/history"]


def test_zero_and_nan_gradients_fall_back_without_crashing():
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("mlp", nn.Linear(24, 40, bias=False))
    for basis in ("svd", "rsvd"):
        method = attached(net, None, basis=basis, rank=None, rank_candidates=(4, 8), update_interval=1,
                          per_layer=False)
        net.mlp.weight.grad = torch.zeros(40, 24)
        method.step()
        assert method.opt.slots[0].rank == 4 and torch.isfinite(net.mlp.weight).all()
        bad = torch.randn(40, 24)
        bad[0, 0] = float("nan")
        net.mlp.weight.grad = bad
        method.opt.refresh(method.opt.slots[0], bad)  # the factorization fails: previous basis is kept
        assert method.opt.fallbacks == 1
        assert all(torch.isfinite(t).all() for t in method.opt.slots[0].basis if t is not None)


def test_state_tensors_bf16_state_and_memory():
    full = sum(p.numel() * 2 * 4 for p in tiny_llama().parameters())  # AdamW fp32 m + v
    for kw, dtype in ((dict(rank=8, state_dtype="fp32"), torch.float32), (dict(rank=8, state_dtype="bf16"),
                                                                          torch.bfloat16)):
        model = tiny_llama()
        method = attached(model, 1.0, **kw)
        train(model, method, batches(2))
        slots = [s for s in method.opt.slots if s.projected]
        assert all(s.m.dtype == dtype and s.v.dtype == dtype for s in slots)
        ids = {id(t) for t in method.state_tensors()}
        assert all(id(s.m) in ids and id(s.v) in ids and id(s.basis.right if s.basis.right is not None
                                                            else s.basis.left) in ids for s in slots)
        state_bytes = method.summary()["optim/state_bytes"]
        assert 0 < state_bytes < full
        assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("factor_shape", [(), (300, 1), (64,)], ids=["tensor", "row", "column"])
@pytest.mark.parametrize("limiter", [False, True])
def test_row_chunked_mode_b_update_equals_the_unchunked_one(factor_shape, limiter):
    from hmt_core.optim import update as upd

    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(300, 64, generator=gen)
    grad = torch.randn(300, 64, generator=gen)
    factor = torch.rand(factor_shape, generator=gen) + 0.5
    prev = torch.tensor(0.5 * float(torch.norm(grad * factor)))  # small previous norm: the limiter bites
    kw = dict(step_size=0.1, lr=0.01, weight_decay=0.1, style="torch")
    ref = w0.clone()
    scaled = grad * factor
    ref_prev = prev
    if limiter:
        scaled, ref_prev = upd.norm_growth_limit(scaled, prev, 1.01)
    upd.apply_update_(ref, scaled * 2.0, **kw)
    out = w0.clone()
    new_prev = upd.scaled_update_rows_(out, grad, factor, prev_norm=prev, gamma=1.01 if limiter else None,
                                       sqrt_scale=2.0, rows=7, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)  # the limiter norm is summed in another order
    torch.testing.assert_close(new_prev, ref_prev, rtol=1e-6, atol=0)
    assert not torch.equal(out, w0)


def test_row_chunked_dense_adam_is_bit_identical(monkeypatch):
    """Large dense weights (embedding, lm_head) are updated in row chunks: element-wise the same arithmetic."""
    from hmt_core.optim import optimizer as hopt
    from helpers import batches, tiny_llama

    calls = []

    def run(chunk_rows):
        model = tiny_llama()
        # one small projected weight (patterns matching none are an error); embedding and lm_head stay dense
        method = hmt.make(hmt.Config(target_patterns=(r"layers\.0\.self_attn\.q_proj",), rank=4, state_dtype="bf16",
                                     lr=1e-3, weight_decay=0.1, per_layer=False))
        method.attach(model, max_grad_norm=None)
        if chunk_rows:
            monkeypatch.setattr(hopt, "chunk_rows_for",  # chunk the (256, 64) embedding / lm_head only
                                lambda shape, dtype, chunk_bytes=0, like=None: calls.append(shape) or (
                                    chunk_rows if shape[0] == 256 else shape[0]))
        for ids in batches(3):
            model(input_ids=ids, labels=ids).loss.backward()
            method.step()
            method.zero_grad()
        monkeypatch.undo()
        return model

    whole, chunked = run(None), run(7)
    assert (256, 64) in calls  # the embedding / lm_head really went through the chunked path
    for (name, a), b in zip(whole.named_parameters(), chunked.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("scaling", ["tensor", "channel"])
def test_mode_b_row_chunks_cost_one_op_each(scaling, monkeypatch):
    """Mode B's update of a row-chunked weight: each extra chunk adds exactly one ATen op (``addcmul_``), the
    limiter norm and scaling are computed once per weight (no per-chunk norm, scaling or limiter ops), and the
    result equals the one-chunk update (element-wise the same arithmetic: only the chunking differs)."""
    from experiments.dispatch_counter import DispatchCounter
    from hmt_core.optim import optimizer as hopt

    def step(rows: int):
        monkeypatch.setattr(hopt, "chunk_rows_for", lambda shape, dtype, chunk_bytes=0, like=None: rows)
        torch.manual_seed(0)
        net = nn.ModuleDict({"mlp": nn.Linear(24, 64, bias=False)})
        method = attached(net, None, mode="B", rank=2, basis="random", scaling=scaling, per_layer=False)
        grad = torch.randn(64, 24, generator=torch.Generator().manual_seed(1))
        s = method.opt.slots[0]
        for _ in range(2):  # the second step has a limiter memory: the limiter's ops run
            if method.opt.refresh_due(s):
                method.opt.refresh(s, grad)
            counter = DispatchCounter()
            with counter:
                method.opt.update_full(s, grad)
        return sum(counter.report().aten_ops.values()), net["mlp"].weight.detach().clone()  # views excluded

    (one, w_one), (four, w_four) = step(64), step(16)
    assert four - one == 3, (one, four)
    assert torch.equal(w_one, w_four)
