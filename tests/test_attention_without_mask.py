"""``experiments.models.causal_attention_without_mask``: a built model on ``sdpa`` whose layers are all causal runs
the same SDPA function without a mask (``is_causal=True``) — the same logits and gradients bit for bit, and no
host sync in the forward (``transformers`` reads the position ids on the host to look for packed sequences when
it builds the mask)."""

from __future__ import annotations

import dataclasses

import torch
import pytest
from transformers import MistralConfig, Qwen2Config

from experiments.config import MODEL_PHASES
from experiments.dispatch_counter import DispatchCounter
from experiments.models import SDPA_CAUSAL, _build_model, build_model, causal_attention_without_mask

TINY = dataclasses.replace(MODEL_PHASES["tiny"], hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                           vocab_size=256, dtype="fp32")
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 64, "vocab_size": 64}


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_same_logits_and_gradients_as_sdpa_without_a_host_sync():
    torch.manual_seed(0)
    plain = _build_model(TINY)
    causal = build_model(TINY)
    causal.load_state_dict(plain.state_dict())
    assert (plain.config._attn_implementation, causal.config._attn_implementation) == ("sdpa", SDPA_CAUSAL)
    ids = torch.randint(0, TINY.vocab_size, (2, 32))
    loss_a, grads_a = _loss_and_grads(plain, ids)
    loss_b, grads_b = _loss_and_grads(causal, ids)
    # same SDPA call (mask None, is_causal=True) in both: identical, not merely close
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    with DispatchCounter() as counter, torch.no_grad():
        causal(input_ids=ids)
    assert counter.report().host_syncs == 0, counter.report().sync_sites
    with DispatchCounter() as counter, torch.no_grad():
        plain(input_ids=ids)
    assert counter.report().host_syncs >= 1  # what the switch removes: transformers' packed-sequence check


@pytest.mark.parametrize("config", [
    MistralConfig(sliding_window=16, **SMALL),
    Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=1, **SMALL),
], ids=["mistral-sliding-window", "qwen2-sliding-layers"])
def test_sliding_window_layers_keep_their_mask(config):
    from transformers import AutoModelForCausalLM

    model = causal_attention_without_mask(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
    assert model.config._attn_implementation == "sdpa"
