"""HMT optimizer: identity projection == torch AdamW, per-layer == ordinary step (clipping, accumulation),
config errors, exact resume, robustness, state accounting."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hmt_core import hmt


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)
    return LlamaForCausalLM(cfg).float()


def batches(n: int, seed: int = 1, batch: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, 16), generator=gen) for _ in range(n)]


def train(model, method, data, micro: int = 1) -> list[float]:
    norms = []
    for x in data:
        for i, chunk in enumerate(x.chunk(micro)):
            method.start_micro_batch(i, micro)
            (model(input_ids=chunk, labels=chunk).loss / micro).backward()
        norms.append(method.step())
        method.zero_grad()
    return norms


def attached(model, max_grad_norm=None, **kw):
    method = hmt.make(hmt.Config(**kw))
    method.attach(model, max_grad_norm=max_grad_norm)
    return method


def assert_same_params(a, b, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.mark.parametrize("per_layer", [False, True])
def test_identity_full_rank_equals_torch_adamw(per_layer):
    init = tiny_llama()
    ref = copy.deepcopy(init)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-8)
    for x in batches(8):
        ref(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    model = copy.deepcopy(init)
    method = attached(model, 0.5, sides="identity", scale=1.0, lr=3e-3, weight_decay=0.1, adam_style="torch",
                      per_layer=per_layer)
    train(model, method, batches(8))
    assert all(s.rank == min(s.param.shape) for s in method.opt.slots if s.projected)
    assert_same_params(model, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode,basis", [("A", "rsvd"), ("A", "svd"), ("B", "random")])
def test_per_layer_in_backward_equals_ordinary_step(mode, basis):
    """No clipping: every update happens inside backward and equals the ordinary step (Mode A: also with
    exact global clipping, deferred in low-rank space)."""
    kw = dict(mode=mode, basis=basis, rank=None, rank_candidates=(8, 16, 32), tau=0.5, update_interval=4,
              lr=3e-3, weight_decay=0.01)
    clip = 0.3 if mode == "A" else None
    init = tiny_llama()
    a, b = copy.deepcopy(init), copy.deepcopy(init)
    ma, mb = attached(a, clip, per_layer=False, **kw), attached(b, clip, per_layer=True, **kw)
    na, nb = train(a, ma, batches(9)), train(b, mb, batches(9))
    assert clip is None or min(na) > clip  # clipping was active
    torch.testing.assert_close(torch.tensor(nb), torch.tensor(na), rtol=1e-5, atol=0)
    assert ma.summary()["rank/history"] == mb.summary()["rank/history"]
    assert_same_params(b, a, rtol=1e-5, atol=1e-6)


def test_full_gradients_of_projected_weights_never_coexist():
    model = tiny_llama()
    projected = hmt.projected_weight_names(model, ("attn", "mlp"))
    params = dict(model.named_parameters())
    live = []
    for name in projected:  # registered before the method's hooks, so they run first
        params[name].register_post_accumulate_grad_hook(
            lambda p: live.append(sum(params[n].grad is not None for n in projected)))
    method = attached(model, 1.0, rank=8, basis="rsvd", per_layer=True)
    train(model, method, batches(2), micro=2)
    assert len(live) == 2 * 2 * len(projected) and max(live) == 1


def test_grad_accumulation_in_low_rank_space_matches_accumulated_step():
    """With a gradient-independent basis (seeded random) and no clipping, accumulating Ĝ per micro-batch
    equals projecting the accumulated G: per-layer with 2 micro-batches == ordinary step on the sum."""
    kw = dict(mode="A", basis="random", rank=8, update_interval=3, lr=3e-3)
    init = tiny_llama()
    a, b = copy.deepcopy(init), copy.deepcopy(init)
    train(a, attached(a, None, per_layer=False, **kw), batches(5, batch=4), micro=2)
    mb = attached(b, None, per_layer=True, **kw)
    train(b, mb, batches(5, batch=4), micro=2)
    assert_same_params(b, a, rtol=1e-5, atol=1e-6)


def test_grad_accumulation_updates_only_after_last_micro_batch():
    model = tiny_llama()
    method = attached(model, 1.0, rank=8, basis="svd", per_layer=True)
    before = copy.deepcopy(model.state_dict())
    x = batches(1, batch=4)[0]
    for i, chunk in enumerate(x.chunk(2)):
        method.start_micro_batch(i, 2)
        model(input_ids=chunk, labels=chunk).loss.backward()
        if i == 0:
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    norm = method.step()
    assert norm > 0 and any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_mode_b_per_layer_clipping_uses_previous_step_norm():
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("mlp", nn.Linear(24, 40, bias=False))
    xs = [torch.randn(8, 24) for _ in range(3)]
    kw = dict(mode="B", basis="random", rank=4, lr=1e-2, update_interval=10)
    a, b = copy.deepcopy(net), copy.deepcopy(net)
    ma, mb = attached(a, None, per_layer=False, **kw), attached(b, 0.01, per_layer=True, **kw)
    coef = 1.0
    for x in xs:
        a(x).square().sum().backward()
        a.mlp.weight.grad.mul_(coef)  # reference: ordinary step on the grad clipped by last step's coefficient
        ma.step()
        ma.zero_grad()
        b(x).square().sum().backward()
        norm = mb.step()
        mb.zero_grad()
        coef = min(1.0, 0.01 / (norm + 1e-6))
        torch.testing.assert_close(b.mlp.weight, a.mlp.weight, rtol=1e-5, atol=1e-7)
    assert coef < 0.1  # clipping really was active


@pytest.mark.parametrize("kw,msg", [
    (dict(tau=1.5), "method.tau must be in (0, 1], got 1.5"),
    (dict(tau=0.0), "method.tau must be in (0, 1]"),
    (dict(rank=0), "method.rank must be a positive integer"),
    (dict(rank=-3), "method.rank"),
    (dict(update_interval=0), "method.update_interval must be > 0"),
    (dict(sides="diagonal"), "method.sides"),
    (dict(basis="qr"), "method.basis"),
    (dict(mode="B", scaling="row"), "method.scaling"),
    (dict(mode="C"), "method.mode"),
    (dict(moment_policy="rotate"), "method.moment_policy"),
    (dict(rank_candidates=()), "method.rank_candidates"),
    (dict(state_dtype="fp8"), "method.state_dtype"),
    (dict(mode="B", sides="two_sided"), "method.scaling"),
])
def test_config_errors_name_the_key(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("[", r"\[").replace("]", r"\]")):
        hmt.Config(**kw)


def test_rank_larger_than_layer_is_rejected_in_attach():
    with pytest.raises(ValueError, match=r"method.rank=65 exceeds min\(out, in\)=64 of model.layers.0"):
        attached(tiny_llama(), rank=65)


@pytest.mark.parametrize("kw", [
    dict(mode="A", basis="rsvd", rank=None, rank_candidates=(8, 16), tau=0.5, update_interval=2,
         moment_policy="project"),
    dict(mode="B", basis="random", rank=4, update_interval=2, scaling="channel", dense_8bit=True),
])
def test_state_dict_roundtrip_resumes_exactly(kw):
    data = batches(7)
    model = tiny_llama()
    method = attached(model, 0.5, **kw)
    train(model, method, data[:3])
    saved_model, saved_state = copy.deepcopy(model.state_dict()), copy.deepcopy(method.state_dict())
    train(model, method, data[3:])
    resumed = tiny_llama(seed=123)
    resumed.load_state_dict(saved_model)
    method2 = attached(resumed, 0.5, **kw)
    method2.load_state_dict(saved_state)
    train(resumed, method2, data[3:])
    assert_same_params(resumed, model, rtol=0, atol=0)
    assert method2.summary()["rank/history"] == method.summary()["rank/history"]


def test_zero_and_nan_gradients_fall_back_without_crashing():
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("mlp", nn.Linear(24, 40, bias=False))
    for basis in ("svd", "rsvd"):
        method = attached(net, None, basis=basis, rank=None, rank_candidates=(4, 8), update_interval=1,
                          per_layer=False)
        net.mlp.weight.grad = torch.zeros(40, 24)
        method.step()
        assert method.opt.slots[0].rank == 4 and torch.isfinite(net.mlp.weight).all()
        bad = torch.randn(40, 24)
        bad[0, 0] = float("nan")
        net.mlp.weight.grad = bad
        method.opt.refresh(method.opt.slots[0], bad)  # the factorization fails: previous basis is kept
        assert method.opt.fallbacks == 1
        assert all(torch.isfinite(t).all() for t in method.opt.slots[0].basis if t is not None)


def test_state_tensors_bf16_state_and_memory():
    full = sum(p.numel() * 2 * 4 for p in tiny_llama().parameters())  # AdamW fp32 m + v
    for kw, dtype in ((dict(rank=8, state_dtype="fp32"), torch.float32), (dict(rank=8, state_dtype="bf16"),
                                                                          torch.bfloat16)):
        model = tiny_llama()
        method = attached(model, 1.0, **kw)
        train(model, method, batches(2))
        slots = [s for s in method.opt.slots if s.projected]
        assert all(s.m.dtype == dtype and s.v.dtype == dtype for s in slots)
        ids = {id(t) for t in method.state_tensors()}
        assert all(id(s.m) in ids and id(s.v) in ids and id(s.basis.right if s.basis.right is not None
                                                            else s.basis.left) in ids for s in slots)
        state_bytes = method.summary()["optim/state_bytes"]
        assert 0 < state_bytes < full
        assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("factor_shape", [(), (300, 1), (64,)], ids=["tensor", "row", "column"])
@pytest.mark.parametrize("limiter", [False, True])
def test_row_chunked_mode_b_update_equals_the_unchunked_one(factor_shape, limiter):
    from hmt_core.optim import update as upd

    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(300, 64, generator=gen)
    grad = torch.randn(300, 64, generator=gen)
    factor = torch.rand(factor_shape, generator=gen) + 0.5
    prev = torch.tensor(0.5 * float(torch.norm(grad * factor)))  # small previous norm: the limiter bites
    kw = dict(step_size=0.1, lr=0.01, weight_decay=0.1, style="torch")
    ref = w0.clone()
    scaled = grad * factor
    ref_prev = prev
    if limiter:
        scaled, ref_prev = upd.norm_growth_limit(scaled, prev, 1.01)
    upd.apply_update_(ref, scaled * 2.0, **kw)
    out = w0.clone()
    new_prev = upd.scaled_update_rows_(out, grad, factor, prev_norm=prev, gamma=1.01 if limiter else None,
                                       sqrt_scale=2.0, rows=7, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)  # the limiter norm is summed in another order
    torch.testing.assert_close(new_prev, ref_prev, rtol=1e-6, atol=0)
    assert not torch.equal(out, w0)


def test_row_chunked_dense_adam_is_bit_identical(monkeypatch):
    """Large dense weights (embedding, lm_head) are updated in row chunks: element-wise the same arithmetic."""
    from hmt_core.kernels import ops as kops
    from helpers import batches, tiny_llama

    calls = []

    def run(chunk_rows):
        model = tiny_llama()
        method = hmt.make(hmt.Config(target_patterns=("no_such_module",), state_dtype="bf16", lr=1e-3,
                                     weight_decay=0.1, per_layer=False))
        method.attach(model, max_grad_norm=None)
        if chunk_rows:
            monkeypatch.setattr(kops, "chunk_rows_for",
                                lambda shape, dtype, chunk_bytes=0: calls.append(shape) or chunk_rows)
        for ids in batches(3):
            model(input_ids=ids, labels=ids).loss.backward()
            method.step()
            method.zero_grad()
        monkeypatch.undo()
        return model

    whole, chunked = run(None), run(7)
    assert (256, 64) in calls  # the embedding / lm_head really went through the chunked path
    for (name, a), b in zip(whole.named_parameters(), chunked.parameters()):
        assert torch.equal(a, b), name
