"""The LM head's Mode B update by vocabulary block inside the fused loss's backward (``method.head_update=in_loss``,
``hmt_core.optim.head_update``) against the head's ordinary update from its (V, d) gradient: one step at a time
from the same state (teacher-forced), the refusals, and a step without host synchronization that still skips a
non-finite step on the device."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import batches, tiny_llama

from experiments.dispatch_counter import DispatchCounter
from hmt_core import hmt
from hmt_core.fused_ce import causal_lm_loss

# the memory-minimal setting (benchmarks.dryrun_table.MINIMAL) on the tiny Llama (vocab 256 >= hidden 64: right-sided)
MINIMAL = {"mode": "B", "basis": "random", "scaling": "tensor", "rank": 1, "scale": 128.0,
           "target_patterns": ("attn", "mlp", "lm_head"), "state_budget": None, "update_interval": 2}


def _method(head_update: str, max_grad_norm: float | None, **overrides):
    model = tiny_llama(0)
    method = hmt.make(hmt.Config(**{**MINIMAL, **overrides, "head_update": head_update}))
    model = method.prepare(model)
    method.attach(model, max_grad_norm=max_grad_norm)
    return model, method


def _step(model, method, ids: torch.Tensor, bad: bool = False) -> torch.Tensor:
    loss = causal_lm_loss(model, ids, chunk_tokens=8)  # 32 tokens, chunk 8: 64-id vocabulary blocks (4 blocks)
    if bad:  # the loss's gradient NaN: every gradient (the head's first) is non-finite
        loss.register_hook(lambda g: g * math.nan)
    loss.backward()
    norm = method.step()
    method.zero_grad()
    return norm


def _state(model, method) -> dict[str, torch.Tensor]:
    out = {k: t.detach().clone() for k, t in model.state_dict().items()}
    out.update({f"state{i}": t.detach().clone() for i, t in enumerate(method.state_tensors())})
    return out


@pytest.mark.parametrize("case", ["bf16_unclipped", "bf16_clipped_channel", "int8_head"])
def test_one_step_equals_the_head_update_from_its_whole_gradient(case):
    """Teacher-forced: before each of 4 steps (refreshes at steps 0 and 2) the in-loss run gets the reference run's
    weights and optimizer state; then one step each on the same batch, and every weight, state tensor, the returned
    norm and the refresh's recorded projection error are compared. What differs is only the order of fp32 sums
    (‖G‖ from the row norms, R and the projection residual row block by row block instead of one reduction or matmul
    over the whole tensor): the head's weight after the step within 1e-5 of its largest change (fp32 rounding of sums
    over 256 x 64 terms, ~1e-7 each, carried through Adam's v and the limiter's norm ratio), every other tensor within
    fp32 rounding of its own scale (1e-5 relative). INT8 head: the same codes except where stochastic rounding
    lands on the other side of a rounding boundary because of those last-bit differences — at most one code step."""
    overrides = {"bf16_unclipped": ({}, None), "bf16_clipped_channel": ({"scaling": "channel"}, 1.0),
                 "int8_head": ({"embedding_dtype": "int8", "dense_8bit": True}, None)}[case]
    ref_model, ref = _method("dense", overrides[1], **overrides[0])
    model, mine = _method("in_loss", overrides[1], **overrides[0])
    assert ref_model.lm_head.weight.grad is None
    for step, ids in enumerate(batches(4)):
        model.load_state_dict(ref_model.state_dict())
        mine.load_state_dict(copy.deepcopy(ref.state_dict()))
        before = _state(ref_model, ref)
        a, b = _step(ref_model, ref, ids), _step(model, mine, ids)
        assert model.lm_head.weight.grad is None  # never a (V, d) gradient
        assert float(b) == pytest.approx(float(a), rel=1e-5), (step, float(a), float(b))
        expected, actual = _state(ref_model, ref), _state(model, mine)
        for key, want in expected.items():
            got = actual[key]
            if want.dtype == torch.int8:  # INT8 codes: one stochastic-rounding step at most
                err = int((got.int() - want.int()).abs().max())
                assert err <= 1, (step, key, err)
                continue
            scale = float((want.float() - before[key].float()).abs().max()) if "lm_head" in key else float(
                want.float().abs().max())
            err = float((got.float() - want.float()).abs().max())
            assert err <= 1e-5 * max(scale, 1e-30) + 1e-7, (step, key, err, scale)
        if step % 2 == 0:  # a refresh: the error measured row block by row block
            (_, _, e_ref, _), (_, _, e_mine, _) = (m.opt.history.history["lm_head.weight"][-1] for m in (ref, mine))
            assert e_mine == pytest.approx(e_ref, rel=1e-5, abs=1e-7), (step, e_ref, e_mine)
            assert 0 < e_ref < 1, e_ref


def test_a_step_has_no_host_sync_and_a_nonfinite_one_is_skipped():
    """A step that is not a refresh makes no host synchronization of HMT's (``tests/test_hmt_syncs.py``'s count);
    a step whose gradients are NaN leaves every weight and state tensor as it was and returns NaN."""
    model, method = _method("in_loss", None, update_interval=100)
    data = batches(3)
    _step(model, method, data[0])  # step 0: the refresh
    counter = DispatchCounter()
    with counter:
        norm = _step(model, method, data[1])
    syncs = {k: n for k, n in counter.report().sync_sites.items() if "<- transformers/" not in k}
    assert not syncs, syncs
    assert math.isfinite(float(norm)) and float(norm) > 0, float(norm)
    before = _state(model, method)
    norm = _step(model, method, data[2], bad=True)
    assert math.isnan(float(norm)), float(norm)
    after = _state(model, method)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, changed


@pytest.mark.parametrize("overrides, culprit", [
    ({"mode": "A"}, "method.mode=B"),
    ({"basis": "rsvd"}, "method.basis=random"),
    ({"per_layer": False}, "method.per_layer=true"),
])
def test_unsupported_settings_are_refused_in_one_line(overrides, culprit):
    with pytest.raises(ValueError) as e:
        hmt.Config(**{**MINIMAL, **overrides, "head_update": "in_loss"})
    assert culprit in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_head_that_is_not_projected_is_refused_at_attach():
    with pytest.raises(ValueError) as e:
        _method("in_loss", None, target_patterns=("attn", "mlp"))
    assert "lm_head in method.target_patterns" in str(e.value), str(e.value)


def test_the_in_loss_rows_move_at_lr_times_head_lr_scale():
    """``method.head_lr_scale=0.25``: one in-loss step equals, for the head, the step of a run at lr × 0.25 bit for
    bit (a power of two: the two rates are the same float), and for every other weight the run at lr."""
    lr = 1e-2

    def one_step(**overrides):
        model, method = _method("in_loss", None, **overrides)
        _step(model, method, batches(1)[0])
        return {k: t.detach().clone() for k, t in model.state_dict().items()}

    scaled, at_lr, at_scaled_lr = one_step(lr=lr, head_lr_scale=0.25), one_step(lr=lr), one_step(lr=lr * 0.25)
    for key, value in scaled.items():
        expected, other = (at_scaled_lr, at_lr) if key.startswith("lm_head.") else (at_lr, at_scaled_lr)
        assert torch.equal(value, expected[key]), (key, float((value.float() - expected[key].float()).abs().max()))
        if value.is_floating_point() and "rotary" not in key:  # every weight moved: the two runs are told apart
            assert not torch.equal(value, other[key]), key
