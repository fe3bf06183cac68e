"""AdamW's split learning rate (``method.dense_lr_scale``): the parameters HMT projects take ``lr``, every other
one ``lr × dense_lr_scale``, and the schedule scales both groups together."""

from __future__ import annotations

import pytest
import torch
from helpers import batches, tiny_llama

from baselines import adamw
from baselines.driver import OptimizerDriver
from hmt_core.hmt import projected_weight_names

LR, SCALE = 1e-3, 4.0


def _grads(model: torch.nn.Module) -> None:
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()


def test_split_step_is_two_adamws_at_their_own_rates() -> None:
    """One step from the same state and gradients: the split optimizer against two torch AdamWs, one over the
    projected weights at lr, one over the rest at lr × scale. AdamW is elementwise per tensor, so grouping
    changes no float: the tolerance is 0."""
    split, ref = tiny_llama(), tiny_llama()
    _grads(split)
    _grads(ref)
    built = adamw.build(split, adamw.Config(lr=LR, dense_lr_scale=SCALE))
    projected = projected_weight_names(ref, ("attn", "mlp"))
    named = list(ref.named_parameters())
    assert projected and len(projected) < len(named), projected
    kw = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    refs = [torch.optim.AdamW([p for n, p in named if n in projected], lr=LR, **kw),
            torch.optim.AdamW([p for n, p in named if n not in projected], lr=LR * SCALE, **kw)]
    built.optimizer.step()
    for opt in refs:
        opt.step()
    for (name, a), (_, b) in zip(split.named_parameters(), ref.named_parameters()):
        diff = (a - b).abs().max().item()
        assert diff == 0, f"{name}: max |split − reference| = {diff:.3e}"
    moved = {n: (a - b).abs().max().item() for (n, a), (_, b) in zip(split.named_parameters(),
                                                                      tiny_llama().named_parameters())}
    assert all(v > 0 for v in moved.values()), moved  # every parameter took a step


def test_embedding_and_head_take_the_scaled_rate_under_the_schedule() -> None:
    model = tiny_llama()
    opt = adamw.build(model, adamw.Config(lr=LR, dense_lr_scale=SCALE)).optimizer
    by_name = {id(p): n for n, p in model.named_parameters()}
    rates = {by_name[id(p)]: g["lr"] for g in opt.param_groups for p in g["params"]}
    assert rates["model.embed_tokens.weight"] == rates["lm_head.weight"] == rates["model.norm.weight"] == LR * SCALE
    assert rates["model.layers.0.self_attn.q_proj.weight"] == rates["model.layers.1.mlp.down_proj.weight"] == LR
    driver = OptimizerDriver(opt, max_grad_norm=None)
    driver.set_lr_scale(0.5)  # warmup / cosine: the ratio stays
    assert [g["lr"] for g in opt.param_groups] == [LR * 0.5, LR * SCALE * 0.5], opt.param_groups


def test_default_is_one_group() -> None:
    opt = adamw.build(tiny_llama(), adamw.Config(lr=LR)).optimizer
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == LR


@pytest.mark.parametrize("kw, message", [({"dense_lr_scale": 0.0}, "dense_lr_scale must be > 0"),
                                         ({"dense_lr_scale": 4.0, "eight_bit": True}, "not offered with")])
def test_bad_split_is_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        adamw.Config(**kw)
