"""HMT Mode A configured like GaLore follows galore-torch's parameter trajectory (≥30 steps, 3 refreshes)."""

from __future__ import annotations

import copy

import pytest
import torch
from galore_torch import GaLoreAdamW
from helpers import batches, tiny_llama

from hmt_core import hmt
from hmt_core.hmt import projected_weight_names

STEPS, GAP, RANK = 32, 10, 8


def galore_optimizer(model, *, lr, weight_decay):
    targets = projected_weight_names(model, ("attn", "mlp"))
    lowrank = [p for n, p in model.named_parameters() if n in targets]
    regular = [p for n, p in model.named_parameters() if n not in targets]
    groups = [{"params": regular},
              {"params": lowrank, "rank": RANK, "update_proj_gap": GAP, "scale": 0.25, "proj_type": "std"}]
    # eps: galore-torch's default 1e-6
    return GaLoreAdamW(groups, lr=lr, weight_decay=weight_decay, no_deprecation_warning=True)


def run_reference(model, data, opt):
    for x in data:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def run_hmt(model, data, method):
    for x in data:
        method.start_micro_batch(0, 1)
        model(input_ids=x, labels=x).loss.backward()
        method.step()
        method.zero_grad()


def galore_like(**overrides) -> hmt.Config:
    kw = dict(mode="A", sides="one_sided", basis="svd", rank=RANK, update_interval=GAP, scale=0.25, eps=1e-6,
              adam_style="hf", moment_policy="keep", lr=1e-2, weight_decay=0.01, per_layer=False)
    kw.update(overrides)
    return hmt.Config(**kw)


@torch.no_grad()
def max_rel_diff(a, b) -> float:
    return max(float((p - q).norm() / q.norm()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    init = tiny_llama()
    model = copy.deepcopy(init)
    run_reference(model, batches(STEPS), galore_optimizer(model, lr=1e-2, weight_decay=0.01))
    return init, model


@pytest.mark.parametrize("per_layer", [False, True])
def test_mode_a_matches_galore_trajectory(reference, per_layer):
    init, ref = reference
    model = copy.deepcopy(init)
    method = hmt.make(galore_like(per_layer=per_layer))
    method.attach(model, max_grad_norm=None)
    run_hmt(model, batches(STEPS), method)
    assert max_rel_diff(init, ref) > 0.05  # the run really trained
    # every projected layer refreshed at steps 0, 10, 20, 30 with the fixed rank
    hist = method.summary()["rank/history"]
    assert len(hist) == 14 and all(h == [[0, RANK], [10, RANK], [20, RANK], [30, RANK]] for h in hist.values())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)  # bit-identical on CPU today


def test_equivalence_test_is_sensitive(reference):
    """Negative control: a different moment policy at refresh (project vs GaLore's keep) is detected."""
    init, ref = reference
    model = copy.deepcopy(init)
    method = hmt.make(galore_like(moment_policy="project"))
    method.attach(model, max_grad_norm=None)
    run_hmt(model, batches(STEPS), method)
    assert max_rel_diff(model, ref) > 1e-4


def test_galore_baseline_method_is_galore_torch(reference):
    """``method=galore`` wraps galore-torch: the same run reproduces the reference trajectory."""
    from baselines import galore

    init, ref = reference
    model = copy.deepcopy(init)
    method = galore.make(galore.Config(rank=RANK, update_proj_gap=GAP, lr=1e-2, weight_decay=0.01))
    method.attach(model, max_grad_norm=None)
    run_hmt(model, batches(STEPS), method)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert method.summary()["optim/projected_params"] == 14
    assert any(t.shape == (RANK, 64) for t in method.state_tensors())  # projection bases are counted
    with pytest.raises(ValueError, match="method.rank=128 exceeds min"):
        galore.make(galore.Config()).attach(copy.deepcopy(init), max_grad_norm=None)


def test_galore_8bit_baseline_runs_on_cuda_and_is_refused_clearly_elsewhere():
    from baselines import galore

    if not torch.cuda.is_available():  # GaLoreAdamW8bit calls torch.cuda.synchronize() every step
        with pytest.raises(ValueError, match="method.eight_bit=true needs a CUDA device"):
            galore.make(galore.Config(rank=RANK, eight_bit=True)).attach(tiny_llama(), max_grad_norm=1.0)
        return
    model = tiny_llama().cuda()
    method = galore.make(galore.Config(rank=RANK, update_proj_gap=GAP, eight_bit=True))
    method.attach(model, max_grad_norm=1.0)
    run_hmt(model, [x.cuda() for x in batches(3)], method)
    assert any(t.dtype == torch.uint8 for t in method.state_tensors())
