"""Activation policies on the tiny Llama and on a generic Linear stack: bytes, gradients, validation, fake mode."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from transformers import LlamaConfig, LlamaForCausalLM

from hmt_core.activations.apply import apply_policy
from hmt_core.activations.measure import cosine, flat_grad
from hmt_core.activations.probe import probe
from hmt_core.activations.policy import PRESETS, ActivationPolicy

B, S, H, F = 2, 32, 64, 176


def tiny_llama(attn="eager", dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=H, intermediate_size=F, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, attn_implementation=attn)
    model = LlamaForCausalLM(cfg)
    return model if dtype == torch.float32 else model.to(dtype)


def batch():
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(1))


def step(model, policy, ids):
    """loss, flat grads, measured saved bytes per component for one forward/backward under ``policy``."""
    model.zero_grad(set_to_none=True)
    handle = apply_policy(model, policy)
    try:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        saved = handle.saved_bytes()
    finally:
        handle.remove()
    return loss.detach(), flat_grad(model), saved


# ------------------------------------------------------------------------------------------- gradients, exactness
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_full_ckpt_and_selective_gradients_exactly_equal_none(attn):
    model, ids = tiny_llama(attn), batch()
    loss0, g0, _ = step(model, PRESETS["none"], ids)
    for name in ("full_ckpt", "selective"):
        loss, g, _ = step(model, PRESETS[name], ids)
        assert torch.equal(loss, loss0) and torch.equal(g, g0), name


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("overrides", [{}, {"attn_out": "fp8", "mlp_intermediate": "fp8"},
                                       {"attn_out": "int8", "mlp_intermediate": "fp8", "fp8_format": "e5m2"}])
def test_int8_fp8_policies_keep_gradient_cosine(attn, overrides):
    model, ids = tiny_llama(attn), batch()
    loss0, g0, _ = step(model, PRESETS["none"], ids)
    loss, g, _ = step(model, PRESETS["hmt"].replace(**overrides), ids)
    assert torch.equal(loss, loss0)  # compression touches only what backward reads: forward is exact
    assert not torch.equal(g, g0)  # ... and backward really reads the compressed form
    assert cosine(g, g0) > 0.99


def test_compressed_original_is_freed():
    """What autograd keeps is the compressed form: the original MLP gate output dies after forward under hmt."""
    model, ids = tiny_llama(), batch()
    refs = []  # the output's storage, not the tensor object (a kept tensor may be saved as a detached alias)
    hook = model.model.layers[0].mlp.gate_proj.register_forward_hook(
        lambda m, i, o: refs.append(StorageWeakRef(o.untyped_storage())))
    alive = {}
    for name in ("none", "hmt"):
        refs.clear()
        handle = apply_policy(model, PRESETS[name])
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        gc.collect()
        alive[name] = not refs[0].expired()
        loss.backward()
        handle.remove()
    hook.remove()
    assert alive == {"none": True, "hmt": False}


@pytest.mark.parametrize("name", ["none", "selective", "full_ckpt", "hmt"])
def test_a_forward_without_backward_frees_everything_it_saved(name):
    """A step skipped before its backward (a non-finite loss) drops the loss and nothing else: every tensor the
    forward saved must die with it. A pack hook that hands back the saved tensor itself makes that tensor hold its
    own grad_fn, a reference cycle through autograd's C++ graph that no collector frees (one step's activations
    leaked per skipped step). Compared: the live tensor bytes (every storage once) before and after."""
    model, ids = tiny_llama(), batch()

    def live_bytes() -> int:
        gc.collect()
        storages = {}
        for t in gc.get_objects():
            # skipped: fake tensors and wrappers (DTensor: its local shard is a tensor of its own) that other tests
            # in this process left alive hold no bytes of their own and have no data pointer to key by
            if isinstance(t, torch.Tensor) and not (is_fake(t) or is_traceable_wrapper_subclass(t)):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    handle = apply_policy(model, PRESETS[name])
    try:
        before = live_bytes()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        during = live_bytes()
        del loss
        after = live_bytes()
    finally:
        handle.remove()
    assert during > before, f"{name}: the forward saved nothing ({before} -> {during} bytes)"
    assert after == before, f"{name}: {after - before} bytes of the forward outlive its loss ({before} -> {after})"


# ------------------------------------------------------------------------------------------------ measured bytes
def test_preset_memory_ordering_eager():
    model, ids = tiny_llama(), batch()
    total = {n: sum(step(model, p, ids)[2].values()) for n, p in PRESETS.items()}
    assert total["full_ckpt"] < total["hmt"] <= total["selective"] < total["none"]


def test_int8_fp8_saved_bytes_ratio_bf16():
    """MLP tensors (B*S*H and 4 x B*S*F elements, all multiples of 128) in BF16 -> 1 byte + 4/128 per element."""
    model, ids = tiny_llama(dtype=torch.bfloat16), batch()
    base = step(model, PRESETS["none"], ids)[2]["mlp_intermediate"]
    assert base == 2 * 2 * (B * S * H + 4 * B * S * F)  # 2 layers, 2 bytes per element
    for action in ("int8", "fp8"):
        got = step(model, PRESETS["none"].replace(mlp_intermediate=action), ids)[2]["mlp_intermediate"]
        assert got / base == pytest.approx((128 + 4) / (2 * 128), abs=1e-12)  # = 0.516: 1/2 of BF16 plus scales


def test_int4_outlier_saved_bytes_ratio_bf16():
    model, ids = tiny_llama(dtype=torch.bfloat16), batch()
    base = step(model, PRESETS["none"], ids)[2]["mlp_intermediate"]
    got = step(model, PRESETS["none"].replace(mlp_intermediate="int4_outlier"), ids)[2]["mlp_intermediate"]
    rows = B * S

    def packed(channels, slots):  # codes + (scale, offset) per block + BF16 outlier columns + int64 indices
        n = rows * channels
        return n // 2 + 8 * (n // 128) + rows * slots * 2 + 8 * slots

    expected = 2 * (packed(H, 2) + 4 * packed(F, 6))  # slots = ceil(channels / 32)
    assert got == expected
    assert 0.25 < got / base < 0.33  # 1/4 of BF16 plus scales (+1/32) and outlier channels (+1/32)


def test_full_ckpt_keeps_only_layer_inputs():
    model, ids = tiny_llama(), batch()
    saved = step(model, PRESETS["full_ckpt"], ids)[2]
    assert set(saved) == {"residual", "norm", "lm_head", "other"}  # only the final norm / head run outside layers
    layer_inputs = 2 * B * S * H * 4
    shared = 2 * S * (H // 4) * 4 + B * S * S * 4 + S * 8  # cos, sin; eager float mask; position_ids
    assert saved["residual"] == layer_inputs + shared


# ------------------------------------------------------------------------------------------- metrics, probe, api
def test_probe_metrics_flat_with_units():
    model, ids = tiny_llama(), batch()
    out = probe(model, PRESETS["hmt"], lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss)
    assert out["act/grad_cos"] > 0.99
    assert 0 < out["act/attn_out/rel_err"] < 0.02 and 0 < out["act/mlp_intermediate/rel_err"] < 0.02
    assert out["act/mlp_intermediate/grad_cos"] > 0.99 and out["act/attn_out/grad_cos"] > 0.99
    assert out["act/total/saved(bytes)"] == sum(v for k, v in out.items() if k.endswith("saved(bytes)")
                                                 and k != "act/total/saved(bytes)")
    assert all(isinstance(v, float) for v in out.values())
    assert all(p.grad is None for p in model.parameters())


def test_remove_restores_model():
    model, ids = tiny_llama(), batch()
    loss0, g0, _ = step(model, PRESETS["none"], ids)
    handle = apply_policy(model, PRESETS["hmt"])
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(layer.self_attn.config is model.config for layer in model.model.layers)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert torch.equal(flat_grad(model), g0)


def test_nan_activation_is_encoded_and_reaches_the_gradients():
    """A NaN activation is compressed without a host check (its block decodes to NaN): the loss and the gradients
    below it are not finite, which skips the step (no silent garbage, no exception)."""
    model, ids = tiny_llama(), batch()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    loss, grads, _ = step(model, PRESETS["hmt"], ids)
    assert not torch.isfinite(loss) and not torch.isfinite(grads).all(), (loss, grads)


def test_fake_tensor_mode_trace_of_compressed_step():
    """The hmt step traces under FakeTensorMode (custom-op fakes) and counts the same saved bytes as real."""
    real = step(tiny_llama(), PRESETS["hmt"], batch())[2]
    with FakeTensorMode(allow_non_fake_inputs=False):
        model = tiny_llama()
        ids = torch.zeros(B, S, dtype=torch.long)
        fake = step(model, PRESETS["hmt"], ids)[2]
    assert fake == real


# ----------------------------------------------------------------------------------------- generic Linear stack
def linear_stack():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.Sequential(nn.GELU(), nn.Linear(96, 96), nn.GELU()), nn.Linear(96, 8))


def test_generic_linear_stack_int8_and_recompute():
    model, x = linear_stack(), torch.randn(64, 32, generator=torch.Generator().manual_seed(2))

    def run(policy):
        model.zero_grad(set_to_none=True)
        h = apply_policy(model, policy)
        model(x).square().mean().backward()
        h.remove()
        return flat_grad(model), h.saved_bytes()

    mods = {"mlp_intermediate": ["1"]}  # the inner Sequential: saves 3 tensors of 64 x 96
    g0, s0 = run(ActivationPolicy(modules=mods))  # keep, but measured per component
    g8, s8 = run(ActivationPolicy(mlp_intermediate="int8", block_size=64, modules=mods))
    assert s0["mlp_intermediate"] == 3 * 64 * 96 * 4
    assert s8["mlp_intermediate"] / s0["mlp_intermediate"] == pytest.approx((64 + 4) / (4 * 64))  # fp32 -> int8
    assert cosine(g8, g0) > 0.999
    gr, sr = run(ActivationPolicy(mlp_intermediate="recompute", modules=mods))
    assert torch.equal(gr, g0) and sr["mlp_intermediate"] == 64 * 96 * 4  # only the block input is kept


def test_generic_model_without_modules_raises():
    with pytest.raises(ValueError, match=r"activation\.mlp_intermediate"):
        apply_policy(linear_stack(), ActivationPolicy(mlp_intermediate="int8"))
    with pytest.raises(ValueError, match=r"activation\.attn_core"):
        apply_policy(linear_stack(), ActivationPolicy(attn_core="recompute"))


# ---------------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(("data", "key"), [
    ({"attention": "int8"}, r"activation\.attention"),
    ({"mlp_intermediate": "int3"}, r"activation\.mlp_intermediate"),
    ({"block_size": 0}, r"activation\.block_size"),
    ({"block_size": -8}, r"activation\.block_size"),
    ({"mlp_intermediate": "int4_outlier", "block_size": 33}, r"activation\.block_size"),
    ({"preset": "fast"}, r"activation\.preset"),
    ({"attn_qkv": "recompute"}, r"activation\.attn_core"),
    ({"preset": "full_ckpt", "attn_out": "int8"}, r"activation\.attn_out"),
    ({"fp8_format": "e3m4"}, r"activation\.fp8_format"),
    ({"modules": {"mlp_hidden": ["mlp"]}}, r"activation\.modules\.mlp_hidden"),
])
def test_bad_config_raises_naming_key(data, key):
    with pytest.raises(ValueError, match=key):
        ActivationPolicy.from_dict(data)


def test_policy_naming_missing_module_raises_at_apply():
    policy = ActivationPolicy(mlp_intermediate="int8", modules={"mlp_intermediate": ["model.layers.*.ffn"]})
    with pytest.raises(ValueError, match=r"activation\.modules\.mlp_intermediate.*ffn"):
        apply_policy(tiny_llama(), policy)
    with pytest.raises(ValueError, match=r"activation\.modules\.attn_core"):
        apply_policy(tiny_llama(), ActivationPolicy(modules={"attn_core": ["model.layers.0.self_attn"]}))


def test_llama_found_inside_a_wrapper():
    """A method's prepare may wrap the LM (e.g. PEFT): the Llama layout is found under its prefix."""

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            return self.inner(**kw)

    ids = batch()
    _, g_bare, s_bare = step(tiny_llama(), PRESETS["hmt"], ids)
    _, g_wrapped, s_wrapped = step(Wrapper(tiny_llama()), PRESETS["hmt"], ids)
    assert torch.equal(g_bare, g_wrapped) and s_bare == s_wrapped


def test_yaml_table_and_presets():
    text = """
preset: selective
attn_out: fp8
mlp_intermediate: int4_outlier
block_size: 64
modules:
  mlp_intermediate: ["model.layers.*.mlp"]
"""
    policy = ActivationPolicy.from_yaml(text)
    assert policy.attn_core == "recompute" and policy.attn_out == "fp8" and policy.block_size == 64
    assert policy.modules == {"mlp_intermediate": ("model.layers.*.mlp",)}
    assert ActivationPolicy.from_dict(policy.to_dict()) == policy
    assert ActivationPolicy.preset("hmt").actions() == {
        "embedding": "keep", "attn_qkv": "recompute", "attn_core": "recompute", "attn_out": "int8",
        "mlp_intermediate": "int8", "residual": "keep", "norm": "keep", "lm_head": "keep"}
    model, ids = tiny_llama(), batch()
    _, g0, _ = step(model, PRESETS["none"], ids)
    _, g, saved = step(model, policy, ids)
    assert cosine(g, g0) > 0.97 and saved["mlp_intermediate"] > 0
