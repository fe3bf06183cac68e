"""HMT Mode B configured like APOLLO / APOLLO-Mini equals apollo-torch, one step at a time from apollo-torch's state.

apollo-torch runs 32 steps (seeded random bases refreshed at steps 0, 10, 20, 30) and every step's state is
recorded. HMT is then put into the state before step k (parameters, moments, step counter, projection basis, the
seed of the next refresh, the norm-growth limiter's memory: teacher forcing) and takes step k itself; its update
``W_{k+1} − W_k`` and its new state must equal apollo-torch's. At a refresh HMT draws its own basis, which must
equal apollo-torch's. Rounding differences of one step cannot compound over the run, so no BLAS-kernel choice can
decide the result.

Everything runs in float64: apollo-torch draws its random basis in float32 and casts it (like HMT's
``projection.random_basis``) and computes everything else in float64; HMT computes its optimizer arithmetic in
float32 by design (fp32 moments, ``.float()`` projected gradient, fp32 APOLLO scaling factor). What is left is
fp32 rounding of HMT's step (unit roundoff u = 2⁻²⁴ ≈ 6e-8).
"""

from __future__ import annotations

import copy

import pytest
import torch
from apollo_torch import APOLLOAdamW
from helpers import (assert_bases_close, assert_params_close, assert_tensors_close, batches, lm_step, record,
                     reference_snapshot, replay, state_rows, tiny_llama, update_rows)

from hmt_core import hmt
from hmt_core.hmt import projected_weight_names

STEPS, GAP = 32, 10
DTYPE = torch.float64
VARIANTS = {  # name: (rank, scale_type, scale, lr)
    "apollo": (16, "channel", 1.0, 1e-2),
    "mini": (1, "tensor", 128.0, 1e-3),
}
# One update, element-wise |ΔW_hmt − ΔW_ref| ≤ 2e-6·(|ΔW_ref| + max|ΔW_ref|) per tensor: HMT's fp32 Adam (dense
# parameters) and fp32 scaling factor s = ‖N‖/‖R‖ (projected ones) each do a handful of roundings per element,
# ≲ 10u ≈ 6e-7 of the largest entry (|m|/√v ≤ ~7 for β = (0.9, 0.999)). Measured: the check holds down to
# 1.3e-7 (32 steps, both variants, ordinary and per-layer). A real difference is far above: the negative
# controls below (α or γ off by 1e-4) need a tolerance above 2.5e-5 to pass.
UPDATE_TOL = 2e-6
# Moments: fp32 in HMT (fp64 in apollo-torch), updated in fp32 where m ← β₁m + (1 − β₁)g can cancel: error
# ≤ ~2u·max(|m|, |g|) ≤ 1e-6·max|m| (holds down to 1.0e-7).
MOMENT_TOL = 1e-6
# Bases: both sides draw N(0, 1) in float32 from a generator seeded with the same seed and divide by √r in fp32,
# so they are equal on any machine; 1e-6 relative only forgives fp32 rounding of that division.
BASIS_RTOL = 1e-6
# The limiter's remembered norm ‖s ⊙ G‖ (a scalar): s carries HMT's fp32 rounding (≲ 10u); holds down to 1.1e-7.
LIMITER_RTOL = 1e-6


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
    run = lm_step(model, step, zero, start)
    for x in data:
        run(x)


@torch.no_grad()
def max_rel_diff(a, b) -> float:
    return max(float((p - q).norm() / q.norm()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request):
    """apollo-torch's run: snapshots (parameters and optimizer state) before each step and after the last."""
    model = tiny_llama(dtype=DTYPE)
    opt = apollo_optimizer(model, request.param)
    step = lm_step(model, opt.step, lambda: opt.zero_grad(set_to_none=True))
    snaps, _ = record(lambda: reference_snapshot(model, opt), step, batches(STEPS))
    return request.param, snaps


def replay_hmt(snaps, cfg: hmt.Config, steps: int = STEPS):
    """HMT replayed one step at a time from each apollo-torch snapshot; every step checked (see the tolerances)."""
    model = tiny_llama(dtype=DTYPE)  # parameters are overwritten from the snapshot before each step
    method = hmt.make(cfg)
    method.attach(model, max_grad_norm=None)

    def check(k, _, refreshed):
        before, after = snaps[k], snaps[k + 1]
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert_bases_close(refreshed, before, after, source="random", random_rtol=BASIS_RTOL, step=k)
        assert_tensors_close(update_rows(model, before, after), rtol=UPDATE_TOL, atol=UPDATE_TOL, atol_of_max=True,
                             step=k, what="update")
        rows = state_rows(method, after, k)  # also: step counters and the seeds of the next refresh equal
        assert_tensors_close(rows["moments"], rtol=MOMENT_TOL, atol=MOMENT_TOL, atol_of_max=True, step=k,
                             what="moment")
        assert_tensors_close(rows["limiter"], rtol=LIMITER_RTOL, atol=0, step=k, what="limiter memory")

    replay(method, model, lm_step(model, method.step, method.zero_grad, method.start_micro_batch),
           batches(STEPS)[:steps], snaps, check)
    return method


@pytest.mark.parametrize("per_layer", [False, True])
def test_mode_b_matches_apollo_step_by_step(reference, per_layer):
    variant, snaps = reference
    first, last = snaps[0]["params"], snaps[-1]["params"]
    assert max(float((last[n] - p).norm() / p.norm()) for n, p in first.items()) > 1e-2  # the run really trained
    method = replay_hmt(snaps, apollo_like(variant, per_layer=per_layer))
    assert all(len(h) == 4 for h in method.summary()["rank/history"].values())  # refreshes at 0, 10, 20, 30


@pytest.mark.parametrize("overrides,first_bad_step", [
    (dict(norm_limiter=False), 0),  # the limiter off (a real difference from apollo-torch's defaults)
    (dict(limiter_gamma=1.01 * (1 + 1e-4)), 1),  # γ off by 1e-4 (the limiter bites from step 1 in this run)
    ("scale", 0),  # α off by 1e-4 (√α by 5e-5): the tolerances are far tighter than a real difference
])
def test_sensitivity(reference, overrides, first_bad_step):
    """Negative controls: a real difference from apollo-torch fails the step-by-step check at the first step it
    can show, with a table naming the step."""
    variant, snaps = reference
    if overrides == "scale":
        overrides = dict(scale=VARIANTS[variant][2] * (1 + 1e-4))
    with pytest.raises(AssertionError, match=f"^step {first_bad_step}: "):
        replay_hmt(snaps, apollo_like(variant, **overrides), steps=first_bad_step + 1)


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
    assert_params_close(model, ref, rtol=0, atol=0, step=12)  # the same library, the same arithmetic: bit for bit
    assert max_rel_diff(init, model) > 1e-3
    with pytest.raises(ValueError, match="method.variant"):
        apollo.Config(variant="maxi")


def test_apollo_default_rank_is_capped_by_a_narrow_grouped_query_projection():
    """d/4 exceeds a grouped-query k/v projection's rows when the KV width is below d/4 (70B: 8192/4 = 2048 > 1024):
    the default rank is capped at the smallest projected weight's min(out, in); an explicit rank is not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from baselines import apollo

    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=16, num_key_value_heads=2)  # k/v: (16, 128), d/4 = 32
    model = LlamaForCausalLM(cfg)
    assert apollo.Config().resolved(model)[0] == 16
    assert apollo.Config(rank=8).resolved(model)[0] == 8
    with pytest.raises(ValueError, match="exceeds min"):
        apollo.make(apollo.Config(rank=32)).attach(model, max_grad_norm=None)
