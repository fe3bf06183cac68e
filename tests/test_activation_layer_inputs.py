"""Full checkpointing with the checkpointed layer inputs stored by a codec (``layer_recompute`` +
``residual: int8 | fp8 | ...``): the recompute reads the decoded input, within the codec's error; forward is exact;
the saved bytes are the codec's; unsupported actions are refused naming the key."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hmt_core.activations.apply import apply_policy
from hmt_core.activations.measure import cosine
from hmt_core.activations.policy import PRESETS, ActivationPolicy
from test_activation_policy import B, H, S, batch, step, tiny_llama  # noqa: E402

CKPT8 = PRESETS["full_ckpt"].replace(residual="int8")


def _layer_inputs(model, policy, ids):
    """Per decoder layer: the input its first norm saw in forward and in the backward recompute."""
    seen: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.input_layernorm.register_forward_pre_hook(
        lambda m, args, i=i: seen.setdefault(i, []).append(args[0].detach().clone()))
        for i, layer in enumerate(model.model.layers)]
    handle = apply_policy(model, policy)
    try:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        handle.remove()
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_reads_the_input_within_the_int8_codec_error(dtype):
    model, ids = tiny_llama(dtype=dtype), batch()
    seen = _layer_inputs(model, CKPT8, ids)
    assert sorted(seen) == [0, 1] and all(len(v) == 2 for v in seen.values())  # forward, then recompute
    for i, (x, x_hat) in seen.items():
        assert not torch.equal(x, x_hat), i  # the recompute really reads the decoded form
        blocks, err = x.float().reshape(-1, 128), (x_hat.float() - x.float()).reshape(-1, 128)
        # codec bound (codecs.py): |x - x^| <= s_b / 2 = absmax_b / 254 per 128-element block; the decode's
        # x^ = q * s_b is rounded once more to the layer's dtype: + half an ulp of |x^| <= absmax_b (2^-24 fp32,
        # 2^-9 bf16)
        bound = blocks.abs().amax(1, keepdim=True) * (1 / 254 + torch.finfo(dtype).eps)
        excess = (err.abs() - bound).max().item()
        assert excess <= 0, f"layer {i}: error exceeds the codec bound by {excess:.3e}"


def test_encoded_layer_input_is_freed_after_forward():
    """Only the codes stay: the second layer's BF16 input dies after forward (kept alive under plain full_ckpt)."""
    model, ids = tiny_llama(), batch()
    refs = []  # the storage, not the tensor object (a kept tensor is saved as a detached alias)
    hook = model.model.layers[1].register_forward_pre_hook(
        lambda m, args: refs.append(StorageWeakRef(args[0].untyped_storage())))
    alive = {}
    for name, policy in (("keep", PRESETS["full_ckpt"]), ("int8", CKPT8)):
        refs.clear()
        handle = apply_policy(model, policy)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        gc.collect()
        alive[name] = not refs[0].expired()
        loss.backward()
        handle.remove()
    hook.remove()
    assert alive == {"keep": True, "int8": False}


def test_forward_exact_and_gradients_close():
    model, ids = tiny_llama(), batch()
    loss0, g0, _ = step(model, PRESETS["full_ckpt"], ids)
    for action in ("int8", "fp8"):
        loss, g, _ = step(model, PRESETS["full_ckpt"].replace(residual=action), ids)
        assert torch.equal(loss, loss0), action  # only what backward reads is encoded
        assert not torch.equal(g, g0), action
        # 0.99: the bound test_activation_policy uses for the HMT preset's INT8/FP8 tensors, which encode more
        c = cosine(g, g0)
        assert c > 0.99, f"{action}: cosine {c:.5f}"


def test_saved_bytes_are_the_codecs():
    """BF16 layer inputs (B*S*H elements per layer, a multiple of 128) -> 1 byte + a 4-byte scale per 128."""
    model, ids = tiny_llama(dtype=torch.bfloat16), batch()
    keep = step(model, PRESETS["full_ckpt"], ids)[2]["residual"]
    shared = keep - 2 * B * S * H * 2  # cos, sin, the mask, position_ids: not encoded
    for action in ("int8", "fp8"):
        got = step(model, PRESETS["full_ckpt"].replace(residual=action), ids)[2]["residual"]
        assert got - shared == 2 * B * S * H * (128 + 4) // 128, (action, got, shared)


@pytest.mark.parametrize("action", ["offload_cpu", "recompute"])
def test_other_actions_refused_naming_the_key(action):
    with pytest.raises(ValueError, match=r"activation\.residual"):
        ActivationPolicy.from_dict({"preset": "full_ckpt", "residual": action})


def test_codec_actions_accepted_and_inner_components_still_refused():
    for action in ("int8", "fp8", "int8_outlier", "int4_outlier"):
        assert ActivationPolicy.from_dict({"preset": "full_ckpt", "residual": action}).residual == action
    with pytest.raises(ValueError, match=r"activation\.mlp_intermediate"):
        ActivationPolicy.from_dict({"preset": "full_ckpt", "residual": "int8", "mlp_intermediate": "int8"})
