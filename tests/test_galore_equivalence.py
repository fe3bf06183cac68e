"""HMT Mode A configured like GaLore equals galore-torch, one step at a time from galore-torch's own state.

galore-torch runs 32 steps (bases refreshed at steps 0, 10, 20, 30) and every step's state is recorded. HMT is
then put into the state before step k (parameters, moments, step counter, projection basis: teacher forcing) and
takes step k itself; its update ``W_{k+1} − W_k`` and its new moments must equal galore-torch's. At a refresh HMT
computes its own basis by SVD, which must equal galore-torch's (sign-aligned, within the SVD's conditioning), and
then continues with galore-torch's. Rounding differences therefore cannot compound over the run: the old
whole-trajectory comparison depended on which BLAS kernel the CPU picks (galore-torch keeps its SVD basis
non-contiguous, HMT makes it contiguous; matmuls then round differently, and Adam amplified a 7e-9 difference at
step 1 to 5-9 % after 32 steps at lr 1e-2), this one does not.

Everything runs in float64. galore-torch then computes in float64 except the SVD (``get_orthogonal_matrix``
casts to float32, like HMT's ``projection.exact_svd``); HMT computes its optimizer arithmetic in float32 by
design (``state_dtype`` fp32: the projected gradient is cast with ``.float()``, moments are fp32). What is left
is fp32 rounding of HMT's Adam step (unit roundoff u = 2⁻²⁴ ≈ 6e-8); the cancellation errors of the matmuls
(where memory layout and BLAS kernel matter) are fp64 ones, ~1e-16, far below the tolerances.
"""

from __future__ import annotations

import pytest
import torch
from galore_torch import GaLoreAdamW
from helpers import (assert_bases_close, assert_tensors_close, batches, lm_step, record, reference_snapshot, replay,
                     state_rows, tiny_llama, update_rows)

from hmt_core import hmt
from hmt_core.hmt import projected_weight_names

STEPS, GAP, RANK, LR, WD = 32, 10, 8, 1e-2, 0.01
DTYPE = torch.float64
# One update, element-wise |ΔW_hmt − ΔW_ref| ≤ 2e-6·(|ΔW_ref| + max|ΔW_ref|) per tensor. HMT's fp32 Adam does a
# handful of roundings per element (EMA of m and v, sqrt, +eps, divide), each ≤ u·(magnitudes involved); with
# |m|/√v ≤ ~7 for β = (0.9, 0.999) the direction's rounding error is ≲ 10u·max|direction| ≈ 6e-7·max, and the
# fp64 reconstruction P·N (r = 8 terms) adds nothing visible. Measured: the check holds down to 1.2e-7 (all 32
# steps, ordinary and per-layer). A real difference is far above: α off by 1e-4 needs 5e-5 (negative control).
UPDATE_TOL = 2e-6
# Moments after the step: HMT stores them in fp32 (the reference in fp64) and updates them in fp32, where
# m ← β₁m + (1 − β₁)g can cancel; its rounding error is ≤ ~2u·max(|m|, |g|) ≤ 1e-6·max|m| (holds down to 9.6e-8).
MOMENT_TOL = 1e-6
# Bases: see helpers.assert_bases_close (tolerance n·u·(1 + σ₁/gap_i) per singular vector, sign-aligned). The
# step itself is taken with galore-torch's basis because the update is sensitive to it: with the moments kept
# across a refresh ("keep") a flipped singular vector changes the update, and an equally valid SVD computed
# differently (of Gᵀ, say) moves the top-8 subspace by ~u·σ₁/(σ₈ − σ₉), which showed up as 6e-5 in the update.


def galore_optimizer(model, *, lr, weight_decay):
    targets = projected_weight_names(model, ("attn", "mlp"))
    lowrank = [p for n, p in model.named_parameters() if n in targets]
    regular = [p for n, p in model.named_parameters() if n not in targets]
    groups = [{"params": regular},
              {"params": lowrank, "rank": RANK, "update_proj_gap": GAP, "scale": 0.25, "proj_type": "std"}]
    # eps: galore-torch's default 1e-6
    return GaLoreAdamW(groups, lr=lr, weight_decay=weight_decay, no_deprecation_warning=True)


def galore_like(**overrides) -> hmt.Config:
    kw = dict(mode="A", sides="one_sided", basis="svd", rank=RANK, update_interval=GAP, scale=0.25, eps=1e-6,
              adam_style="hf", moment_policy="keep", lr=LR, weight_decay=WD, per_layer=False)
    kw.update(overrides)
    return hmt.Config(**kw)


@pytest.fixture(scope="module")
def reference():
    """galore-torch's run: snapshots (parameters and optimizer state) before each step and after the last."""
    model = tiny_llama(dtype=DTYPE)
    opt = galore_optimizer(model, lr=LR, weight_decay=WD)
    step = lm_step(model, opt.step, lambda: opt.zero_grad(set_to_none=True))
    snaps, _ = record(lambda: reference_snapshot(model, opt), step, batches(STEPS))
    return snaps


def replay_hmt(snaps, cfg: hmt.Config, steps: int = STEPS):
    """HMT replayed one step at a time from each galore-torch snapshot; every step checked (see the tolerances)."""
    model = tiny_llama(dtype=DTYPE)  # parameters are overwritten from the snapshot before each step
    method = hmt.make(cfg)
    method.attach(model, max_grad_norm=None)

    def check(k, _, refreshed):
        before, after = snaps[k], snaps[k + 1]
        assert_bases_close(refreshed, before, after, source="svd", step=k)  # HMT's own SVD at refresh steps
        assert_tensors_close(update_rows(model, before, after), rtol=UPDATE_TOL, atol=UPDATE_TOL, atol_of_max=True,
                             step=k, what="update")
        rows = state_rows(method, after, k)  # also: step counters equal
        assert_tensors_close(rows["moments"], rtol=MOMENT_TOL, atol=MOMENT_TOL, atol_of_max=True, step=k,
                             what="moment")

    replay(method, model, lm_step(model, method.step, method.zero_grad, method.start_micro_batch),
           batches(STEPS)[:steps], snaps, check)
    return method


@pytest.mark.parametrize("per_layer", [False, True])
def test_mode_a_matches_galore_step_by_step(reference, per_layer):
    first, last = reference[0]["params"], reference[-1]["params"]
    assert max(float((last[n] - p).norm() / p.norm()) for n, p in first.items()) > 0.05  # the run really trained
    method = replay_hmt(reference, galore_like(per_layer=per_layer))
    # every projected layer refreshed at steps 0, 10, 20, 30 with the fixed rank
    hist = method.summary()["rank/history"]
    assert len(hist) == 14 and all(h == [[0, RANK], [10, RANK], [20, RANK], [30, RANK]] for h in hist.values())


@pytest.mark.parametrize("overrides,first_bad_step", [
    (dict(moment_policy="project"), GAP),  # a different moment policy at refresh (project vs GaLore's keep)
    (dict(scale=0.25 * (1 + 1e-4)), 0),  # α off by 1e-4: the tolerances are far tighter than a real difference
])
def test_equivalence_test_is_sensitive(reference, overrides, first_bad_step):
    """Negative controls: a real difference from galore-torch fails the step-by-step check at the first step
    it can show, with a table naming the step."""
    with pytest.raises(AssertionError, match=f"^step {first_bad_step}: "):
        replay_hmt(reference, galore_like(**overrides), steps=first_bad_step + 1)


def test_galore_baseline_method_is_galore_torch(reference):
    """``method=galore`` wraps galore-torch: the same run reproduces the reference trajectory bit for bit (the
    same library doing the same arithmetic on the same machine)."""
    from baselines import galore

    model = tiny_llama(dtype=DTYPE)
    method = galore.make(galore.Config(rank=RANK, update_proj_gap=GAP, lr=LR, weight_decay=WD))
    method.attach(model, max_grad_norm=None)
    step = lm_step(model, method.step, method.zero_grad, method.start_micro_batch)
    for x in batches(STEPS):
        step(x)
    last = reference[-1]["params"]
    assert_tensors_close([(n, p, last[n]) for n, p in model.named_parameters()], rtol=0, atol=0, step=STEPS,
                         what="parameter")
    assert method.summary()["optim/projected_params"] == 14
    assert any(t.shape == (RANK, 64) for t in method.state_tensors())  # projection bases are counted
    with pytest.raises(ValueError, match="method.rank=128 exceeds min"):
        galore.make(galore.Config()).attach(tiny_llama(), max_grad_norm=None)


def test_galore_8bit_baseline_runs_on_cuda_and_is_refused_clearly_elsewhere():
    from baselines import galore

    if not torch.cuda.is_available():  # GaLoreAdamW8bit calls torch.cuda.synchronize() every step
        with pytest.raises(ValueError, match="method.eight_bit=true needs a CUDA device"):
            galore.make(galore.Config(rank=RANK, eight_bit=True)).attach(tiny_llama(), max_grad_norm=1.0)
        return
    model = tiny_llama().cuda()
    method = galore.make(galore.Config(rank=RANK, update_proj_gap=GAP, eight_bit=True))
    method.attach(model, max_grad_norm=1.0)
    step = lm_step(model, method.step, method.zero_grad, method.start_micro_batch)
    for x in batches(3):
        step(x.cuda())
    assert any(t.dtype == torch.uint8 for t in method.state_tensors())
