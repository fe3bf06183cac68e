"""``update.apollo_coefficient``: Mode B's coefficient ``coef`` with ``G ⊙ coef = limit(G ⊙ s)`` (Fira's norm-growth
limiter, Eq. 9) and the norm it remembers, against the reference formula ``update.norm_growth_limit`` applied to the
full ``G ⊙ s``; the tensor-factor path from a known ‖G‖ against the path that reads G; the device-side skip.

Tolerances: both sides compute in fp32 from the same values; the reference takes ‖G ⊙ s‖ over a weight-sized
product and divides u by the limiter, the coefficient takes s‖G‖ and min(γ(prev + ε)/‖G‖, s): a few roundings each
(≲ 4u ≈ 2.4e-7 relative), so 1e-6 relative.
"""

from __future__ import annotations

import math

import pytest
import torch

from hmt_core.optim import update as upd

GAMMA = 1.01
RTOL = 1e-6  # a few fp32 roundings on either side (module docstring)


def _case(prev_scale: float | None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(48, 32, generator=gen)
    factor = torch.rand((), generator=gen) + 0.5
    prev = None if prev_scale is None else prev_scale * torch.linalg.vector_norm(grad * factor)
    return grad, factor, prev


@pytest.mark.parametrize("prev_scale", [None, 0.5, 3.0], ids=["first_step", "limited", "not_limited"])
@pytest.mark.parametrize("known_norm", [True, False], ids=["grad_norm", "reads_grad"])
def test_coefficient_is_the_limited_update_over_the_gradient(prev_scale, known_norm):
    grad, factor, prev = _case(prev_scale)
    ref_u, ref_prev = upd.norm_growth_limit(grad * factor, prev, GAMMA)
    coef, remembered = upd.apollo_coefficient(grad, factor, prev_norm=prev, gamma=GAMMA,
                                              grad_norm=torch.linalg.vector_norm(grad) if known_norm else None)
    torch.testing.assert_close(grad * coef, ref_u, rtol=RTOL, atol=0)
    torch.testing.assert_close(remembered, ref_prev, rtol=RTOL, atol=0)
    if prev_scale == 0.5:  # the limiter bites: ‖u‖ = γ · prev
        torch.testing.assert_close(remembered, GAMMA * (prev + 1e-8), rtol=RTOL, atol=0)


@pytest.mark.parametrize("known_norm", [True, False], ids=["grad_norm", "reads_grad"])
def test_a_zero_gradient_gets_the_unlimited_factor(known_norm):
    """‖G‖ = 0: γ(prev + ε)/0 is +inf, so the coefficient is s (the reference: limiter max(0/prev, γ)/γ = 1)."""
    grad, factor, _ = _case(None)
    grad.zero_()
    coef, remembered = upd.apollo_coefficient(grad, factor, prev_norm=torch.tensor(0.25), gamma=GAMMA,
                                              grad_norm=torch.zeros(()) if known_norm else None)
    assert torch.equal(coef, factor) and float(remembered) == 0.0, (float(coef), float(factor), float(remembered))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("prev_scale", [None, 0.5])
@pytest.mark.parametrize("known_norm", [True, False], ids=["grad_norm", "reads_grad"])
def test_a_skipped_step_gives_a_zero_coefficient_and_keeps_the_memory(bad, prev_scale, known_norm):
    """Under ``found_inf`` True the coefficient is 0 (exactly, also from a non-finite gradient) and the limiter's
    memory is the previous one (+inf before the first step: the next step is unlimited, as with no memory)."""
    grad, factor, prev = _case(prev_scale)
    grad[3, 5] = bad
    coef, remembered = upd.apollo_coefficient(grad, factor, prev_norm=prev, gamma=GAMMA,
                                              grad_norm=torch.linalg.vector_norm(grad) if known_norm else None,
                                              found_inf=torch.tensor(True))
    assert float(coef) == 0.0, float(coef)
    expected = math.inf if prev is None else float(prev)
    assert float(remembered) == expected, (float(remembered), expected)
    ok = _case(prev_scale)[0]  # the same step under a False flag is the ordinary one, bit for bit
    run = upd.apollo_coefficient(ok, factor, prev_norm=prev, gamma=GAMMA, found_inf=torch.tensor(False))
    plain = upd.apollo_coefficient(ok, factor, prev_norm=prev, gamma=GAMMA)
    assert torch.equal(run[0], plain[0]) and torch.equal(run[1], plain[1]), (run, plain)


def test_fp32_clipped_is_one_op_for_a_bf16_projection():
    """``fp32_clipped``: clip · Ĝ in fp32 from a bf16 Ĝ in one multiply (a (1,) clip view promotes), the same values
    as ``Ĝ.float() * clip``."""
    from experiments.dispatch_counter import DispatchCounter

    low = torch.randn(8, 3, generator=torch.Generator().manual_seed(1)).bfloat16()
    clip = torch.tensor(0.37)
    counter = DispatchCounter()
    with counter:
        out = upd.fp32_clipped(low, clip)
    assert out.dtype == torch.float32 and torch.equal(out, low.float() * clip), out
    assert sum(counter.report().aten_ops.values()) == 1, counter.report().op_names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_flag_turns_true_at_the_first_nonfinite_norm_and_stays(dtype):
    """``PerLayerEngine._flag`` (two ops per norm): False while the norms are finite (also 0 and the largest finite
    value), True from the first +inf or NaN on, whatever follows."""
    from types import SimpleNamespace

    from hmt_core.optim.hooks import PerLayerEngine

    big = torch.finfo(dtype).max
    for norms, expected in (([0.0, 1.0, big], [False] * 3), ([1.0, math.inf, 2.0, 0.0], [False, True, True, True]),
                            ([math.nan, 1.0], [True, True]), ([2.0, 3.0, math.nan], [False, False, True])):
        engine = SimpleNamespace(poison=None, found_inf=None)
        flags = [bool(PerLayerEngine._flag(engine, torch.tensor(n, dtype=dtype))) for n in norms]
        assert flags == expected, (norms, flags)
