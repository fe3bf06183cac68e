"""HMT's deferred updates in ``torch._foreach_*`` ops (``hmt_core.optim.grouped``, ``hmt_core.adam.adam_step_many``)
and the device-side skip folded into Adam's moments (``hmt_core.optim.skip.DeviceSkip.moment_factors``): the same
arithmetic tensor by tensor as the one-slot path, so every comparison here is bit for bit (``torch.equal``, no
tolerance) — on CPU the foreach ops run the same per-tensor kernels, and the device-side betas are the same fp32
numbers as the Python floats they replace."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import batches, lm_step, tiny_llama

from hmt_core import adam, hmt
from hmt_core.optim import grouped

STYLES = ("torch", "hf")


def _first_mismatch(pairs) -> str | None:
    for name, a, b in pairs:
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()
            return f"{name}: max |Δ| {diff:.3e}"
    return None


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skipped", [None, False, True])
def test_adam_step_many_is_adam_one_tensor_at_a_time(style, dtype, skipped):
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 7), (3, 64), (1, 9)]
    ms = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    vs = [torch.rand(s, generator=gen).to(dtype) for s in shapes]
    gs = [torch.randn(s, generator=gen) for s in shapes]
    factors = None
    if skipped is not None:
        run, skip = adam.moment_factors(0.9, 0.999, torch.device("cpu"))
        factors = skip if skipped else run
        gs = [torch.zeros_like(g) for g in gs] if skipped else gs  # the caller zeroes a skipped step's gradient
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, style=style)
    m1, v1 = [m.clone() for m in ms], [v.clone() for v in vs]
    ds, step = adam.adam_step_many(m1, v1, gs, 3, factors=factors, **kw)
    rows = []
    for i, (m, v, g) in enumerate(zip(ms, vs, gs)):
        m2, v2 = m.clone(), v.clone()
        if skipped:  # a skipped step: the moments as they were and a zero direction
            ref_d = torch.zeros_like(ds[i])
        else:
            m32, v32 = adam.adam_moments_(m2, v2, g, 0.9, 0.999, style)
            ref_d, ref_step = adam.adam_step(m32, v32, 3, **kw)
            assert step == ref_step
        rows += [(f"m[{i}]", m1[i], m2), (f"v[{i}]", v1[i], v2), (f"d[{i}]", ds[i], ref_d)]
    assert _first_mismatch(rows) is None, _first_mismatch(rows)


def _per_slot_low(opt, slots, lows, coef):  # the one-slot path the grouped one replaces
    for s, low in zip(slots, lows):
        opt.update_low_rank(s, low, coef)


def _per_slot_dense(opt, slots, grads, coef):
    for s, g in zip(slots, grads):
        opt.update_full(s, g, coef)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_updates_in_foreach_ops_equal_the_one_slot_path(monkeypatch, style, dtype):
    """Mode A with clipping (every update deferred to ``finish_step``), 4 steps from the same state: a refresh, two
    ordinary steps and one whose lm_head gradient is NaN (skipped on the device). Weights, moments and returned
    norms equal the one-slot path's bit for bit, and the skipped step leaves every weight and moment unchanged."""
    model = tiny_llama(dtype=dtype)
    ref_model = copy.deepcopy(model)
    kw = dict(rank=4, update_interval=3, adam_style=style, weight_decay=0.0)
    method, ref = hmt.make(hmt.Config(**kw)), hmt.make(hmt.Config(**kw))
    method.attach(model, max_grad_norm=1.0)
    ref.attach(ref_model, max_grad_norm=1.0)
    poison = {"on": False}
    for m in (model, ref_model):
        m.lm_head.weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    run = lm_step(model, method.step, method.zero_grad, method.start_micro_batch)
    ref_run = lm_step(ref_model, ref.step, ref.zero_grad, ref.start_micro_batch)
    for k, x in enumerate(batches(4)):
        poison["on"] = k == 2
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        moments = [(s.m.clone(), s.v.clone()) for s in method.opt.slots if s.m is not None]
        loss = run(x)
        with monkeypatch.context() as patch:
            patch.setattr(grouped, "update_low_rank_many", _per_slot_low)
            patch.setattr(grouped, "update_dense_many", _per_slot_dense)
            ref_loss = ref_run(x)
        rows = [(n, p, q) for (n, p), q in zip(model.named_parameters(), ref_model.parameters())]
        rows += [(f"{s.name}.{w}", getattr(s, w), getattr(r, w)) for s, r in zip(method.opt.slots, ref.opt.slots)
                 for w in ("m", "v") if getattr(s, w) is not None]
        assert _first_mismatch(rows) is None, (k, _first_mismatch(rows), loss, ref_loss)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0, equal_nan=True)  # the norm (NaN: skipped)
        assert loss.isnan().item() == (k == 2), (k, loss)
        if k == 2:
            kept = [(n, p, before[n]) for n, p in model.named_parameters()]
            kept += [(s.name, s.m, m) for s, (m, _) in zip([s for s in method.opt.slots if s.m is not None], moments)]
            assert _first_mismatch(kept) is None, _first_mismatch(kept)
