"""HMT Mode B configured like APOLLO / APOLLO-Mini follows apollo-torch's trajectory (≥30 steps, refreshes)."""

from __future__ import annotations

import copy

import pytest
import torch
from apollo_torch import APOLLOAdamW
from helpers import batches, tiny_llama

from hmt_core import hmt
from hmt_core.hmt import projected_weight_names

STEPS, GAP = 32, 10
VARIANTS = {  # name: (rank, scale_type, scale, lr)
    "apollo": (16, "channel", 1.0, 1e-2),
    "mini": (1, "tensor", 128.0, 1e-3),
}


def apollo_optimizer(model, variant):
    rank, scale_type, scale, lr = VARIANTS[variant]
    targets = projected_weight_names(model, ("attn", "mlp"))
    # one group per parameter, in model order, so apollo-torch's seed (1-based parameter index) equals HMT's
    groups = [{"params": [p], "rank": rank, "proj": "random", "scale_type": scale_type, "scale": scale,
               "update_proj_gap": GAP, "proj_type": "std"} if n in targets else {"params": [p]}
              for n, p in model.named_parameters()]
    return APOLLOAdamW(groups, lr=lr, weight_decay=0.01)


def apollo_like(variant, **overrides) -> hmt.Config:
    rank, scale_type, scale, lr = VARIANTS[variant]
    kw = dict(mode="B", sides="one_sided", basis="random", rank=rank, update_interval=GAP, scale=scale,
              scaling=scale_type, eps=1e-6, adam_style="hf", lr=lr, weight_decay=0.01, per_layer=False)
    kw.update(overrides)
    return hmt.Config(**kw)


def train(model, data, step, zero, start=None):
    for x in data:
        if start:
            start(0, 1)
        model(input_ids=x, labels=x).loss.backward()
        step()
        zero()


@torch.no_grad()
def max_rel_diff(a, b) -> float:
    return max(float((p - q).norm() / q.norm()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request):
    torch.set_num_threads(1)
    init = tiny_llama()
    model = copy.deepcopy(init)
    opt = apollo_optimizer(model, request.param)
    train(model, batches(STEPS), opt.step, lambda: opt.zero_grad(set_to_none=True))
    return request.param, init, model


def run_hmt(init, cfg):
    model = copy.deepcopy(init)
    method = hmt.make(cfg)
    method.attach(model, max_grad_norm=None)
    train(model, batches(STEPS), method.step, method.zero_grad, method.start_micro_batch)
    return model, method


@pytest.mark.parametrize("per_layer", [False, True])
def test_mode_b_matches_apollo_trajectory(reference, per_layer):
    variant, init, ref = reference
    model, method = run_hmt(init, apollo_like(variant, per_layer=per_layer))
    assert max_rel_diff(init, ref) > 1e-2  # the run really trained
    assert all(len(h) == 4 for h in method.summary()["rank/history"].values())  # refreshes at 0, 10, 20, 30
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_sensitivity_without_limiter(reference):
    """Negative control: the limiter off (a real difference from apollo-torch's defaults) is detected."""
    variant, init, ref = reference
    model, _ = run_hmt(init, apollo_like(variant, norm_limiter=False))
    assert max_rel_diff(model, ref) > 1e-4


@pytest.mark.parametrize("variant,expected", [("apollo", (16, "channel", 1.0)), ("mini", (1, "tensor", 128.0))])
def test_apollo_baseline_method_wraps_apollo_torch(variant, expected):
    """``method=apollo`` resolves the published presets and runs apollo-torch itself (same trajectory as a
    hand-built APOLLOAdamW with the same groups)."""
    from baselines import apollo

    init = tiny_llama()
    model, ref = copy.deepcopy(init), copy.deepcopy(init)
    method = apollo.make(apollo.Config(variant=variant, update_proj_gap=GAP, lr=1e-3))
    method.attach(model, max_grad_norm=1.0)
    assert (method.summary()["rank/fixed"], method.summary()["apollo/scaling"],
            method.summary()["apollo/scale"]) == expected
    rank, scaling, scale = expected
    targets = projected_weight_names(ref, ("attn", "mlp"))
    groups = [{"params": [p for n, p in ref.named_parameters() if n not in targets]},
              {"params": [p for n, p in ref.named_parameters() if n in targets], "rank": rank, "proj": "random",
               "scale_type": scaling, "scale": scale, "update_proj_gap": GAP, "proj_type": "std"}]
    opt = APOLLOAdamW(groups, lr=1e-3)

    def ref_step():
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)  # the driver's order
        opt.step()

    data = batches(12)
    train(ref, data, ref_step, lambda: opt.zero_grad(set_to_none=True))
    train(model, data, method.step, method.zero_grad, method.start_micro_batch)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert max_rel_diff(init, model) > 1e-3
    with pytest.raises(ValueError, match="method.variant"):
        apollo.Config(variant="maxi")
