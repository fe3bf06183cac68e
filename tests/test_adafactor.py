"""``method=adafactor`` (transformers' ``Adafactor``, Shazeer & Stern 2018): settings, a dry run, a short CPU run
whose loss falls with the factored state the meter measures, and a checkpoint that keeps its fp32 state."""

import json

import pytest
import torch
from torch import nn

from baselines import adafactor
from experiments import methods
from experiments.results import read_metrics
from tests.test_runner import run as run_micro


def run(tmp_path, *overrides):
    return run_micro(tmp_path, "method=adafactor", *overrides)


def test_settings_are_checked():
    for bad in ({"lr": 0.0}, {"beta1": 1.0}, {"decay_rate": 0.5}, {"clip_threshold": 0.0}, {"eps1": 0.0},
                {"weight_decay": -1.0}):
        with pytest.raises(ValueError, match="method."):
            adafactor.Config(**bad)
    assert "adafactor" not in methods.fsdp2_names()  # row shards' row means are not the weight's


def test_loss_falls_and_the_state_is_factored(tmp_path):
    summary = run(tmp_path, "train.steps=40", "train.warmup_steps=5", "train.eval_every=20", "method.lr=3e-3",
                  "run_id=a")
    rows = read_metrics(tmp_path / "a")
    first, last = rows[0]["loss/train"], sum(r["loss/train"] for r in rows[-5:]) / 5
    assert last < first - 0.5, (first, last)
    # fp32 row + column means per matrix, the full second moment per vector, a 0-d fp32 RMS per tensor; no first
    # moment: per layer 4 attention (64 + 64) + 3 MLP (176 + 64) + 2 norms (64), embedding and head (512 + 64) each,
    # the final norm (64); 21 tensors
    elements = 2 * (4 * 128 + 3 * 240 + 2 * 64) + 2 * 576 + 64
    assert summary["memory"]["peak_by_category_bytes"]["optimizer"] == 4 * elements + 4 * 21
    assert summary["method_summary"]["optim/factored_params"] == 16
    assert summary["memory"]["peak_by_category_bytes"]["params"] == 2 * summary["params_trainable"]  # bf16 weights


def test_dry_run_traces_it(tmp_path):
    summary = run(tmp_path, "mode=dryrun", "model.num_layers=1", "train.seq_len=32", "train.batch_size=1",
                  "run_id=d")
    assert summary["dryrun"]["traceable"] is True and summary["dryrun"]["assumed_scalars"] == {}
    assert json.loads((tmp_path / "d" / "summary.json").read_text())["memory"]["peak_by_category_bytes"][
        "optimizer"] > 0


def test_a_checkpoint_keeps_the_fp32_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4)).to(torch.bfloat16)

    def stepped(method):
        method.attach(model, max_grad_norm=1.0)
        return method

    def one_step(method):
        model(torch.randn(3, 8, dtype=torch.bfloat16)).float().square().mean().backward()
        method.step()
        method.zero_grad()

    a = stepped(methods.make_method(adafactor.Config(lr=1e-2)))
    for _ in range(2):
        one_step(a)
    saved = a.state_dict()
    b = methods.make_method(adafactor.Config(lr=1e-2))
    b.attach(model, max_grad_norm=1.0)
    b.load_state_dict(saved)
    opt_a, opt_b = a.torch_optimizer(), b.torch_optimizer()
    for p in model.parameters():
        for key, value in opt_a.state[p].items():
            if isinstance(value, torch.Tensor):
                assert opt_b.state[p][key].dtype == torch.float32 and torch.equal(opt_b.state[p][key], value), key
                assert opt_b.state[p][key].data_ptr() != value.data_ptr()
