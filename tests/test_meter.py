"""The memory meter against byte counts known exactly, and real vs FakeTensorMode agreement."""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.memory.meter import MemoryMeter


def _step(model, opt, meter, ids):
    meter.track([ids], "other")
    with meter.phase("forward"):
        loss = model(input_ids=ids, labels=ids).loss
    with meter.phase("backward"):
        loss.backward()
    del loss
    with meter.phase("optimizer"):
        opt.step()
    meter.mark([t for s in opt.state.values() for t in s.values()], "optimizer")
    opt.zero_grad(set_to_none=True)


def test_adamw_fp32_state_bytes_are_two_moments_plus_step_counters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = MemoryMeter()
    meter.track(model.parameters(), "params")
    meter.watch_grads(model.parameters())
    x = torch.randn(16, 96)
    with meter:
        with meter.phase("forward"):
            loss = model(x).square().mean()
        with meter.phase("backward"):
            loss.backward()
        with meter.phase("optimizer"):
            opt.step()
        meter.mark([t for s in opt.state.values() for t in s.values()], "optimizer")
    numel = sum(p.numel() for p in model.parameters())
    n_params = len(list(model.parameters()))
    rep = meter.report()
    # exp_avg + exp_avg_sq in fp32, plus one fp32 0-dim `step` tensor per parameter (torch keeps it as a tensor)
    assert rep.current_by_category_bytes["optimizer"] == 2 * numel * 4 + 4 * n_params
    assert rep.current_by_category_bytes["params"] == numel * 4
    assert rep.current_by_category_bytes["grads"] == numel * 4  # not zeroed yet: every .grad is alive
    # during the optimizer step the gradients, parameters and new states coexist
    assert rep.peak_by_phase_bytes["optimizer"] >= numel * 4 * 4


def test_linear_saved_input_is_the_activation():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 24, bias=False)
    meter = MemoryMeter()
    meter.track(lin.parameters(), "params")
    meter.watch_grads(lin.parameters())
    x = torch.randn(10, 48)
    meter.track([x], "other")

    def forward():
        h = x * 2.0  # born in forward; Linear saves it for the weight gradient
        return lin(h).sum()  # lin's output is freed (sum's backward keeps only the shape)

    with meter:
        with meter.phase("forward"):
            loss = forward()
        rep = meter.report()
        # saved input (10 x 48 fp32) + the 0-dim loss itself, which is alive too
        assert rep.current_by_category_bytes["activations"] == 10 * 48 * 4 + 4
        assert rep.current_by_category_bytes["temp"] == 0
        with meter.phase("backward"):
            loss.backward()
    del loss
    rep = meter.report()
    assert rep.current_by_category_bytes["activations"] == 0  # backward released what forward saved
    assert rep.current_by_category_bytes["grads"] == 48 * 24 * 4
    assert rep.peak_by_category_bytes["params"] == 48 * 24 * 4


def test_views_share_one_storage_and_are_counted_once():
    meter = MemoryMeter()
    with meter:
        a = torch.zeros(1000)
        views = [a[10:], a.view(10, 100), a.t() if a.dim() == 2 else a[::2]]
        assert meter.current_bytes() == 4000
        del a, views
    assert meter.current_bytes() == 0
    assert meter.report().peak_bytes == 4000


def test_unknown_category_is_rejected():
    with pytest.raises(ValueError, match="unknown memory category"):
        MemoryMeter().mark([torch.zeros(1)], "weights")


def _llama_step_report(config, fake: bool):
    from transformers import LlamaForCausalLM

    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        meter = MemoryMeter(source="fake" if fake else "tracker")
        meter.track(model.parameters(), "params")
        meter.track(model.buffers(), "other")
        meter.watch_grads(model.parameters())
        ids = torch.randint(0, config.vocab_size, (2, 32))
        for _ in range(2):
            with meter:
                _step(model, opt, meter, ids)
        return meter.report()


def test_fake_tensor_mode_gives_the_same_categorized_bytes(tiny_llama_config):
    tiny_llama_config._attn_implementation = "eager"
    real = _llama_step_report(tiny_llama_config, fake=False)
    fake = _llama_step_report(tiny_llama_config, fake=True)
    assert fake.source == "fake"
    assert real.peak_bytes == fake.peak_bytes
    assert real.peak_by_category_bytes == fake.peak_by_category_bytes
    assert real.peak_by_phase_bytes == fake.peak_by_phase_bytes
    assert real.current_by_category_bytes == fake.current_by_category_bytes
    # averages are over op ticks; the real run executes a few data-dependent mask checks that fake mode skips
    for key, value in real.avg_by_category_bytes.items():
        assert fake.avg_by_category_bytes[key] == pytest.approx(value, rel=0.01, abs=8)
    # and the exactly-known parts: fp32 weights, two fp32 moments + step per parameter
    numel = sum(p.numel() for p in _params_numel(tiny_llama_config))
    assert real.peak_by_category_bytes["params"] == 4 * numel


def _params_numel(config):
    from transformers import LlamaForCausalLM

    with FakeTensorMode():
        return list(LlamaForCausalLM(config).parameters())
