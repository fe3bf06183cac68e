"""An INT8 HMT model started on meta (``experiments.dist.parallel.quantizes_onto``: on CUDA, where a model's
full-precision weights may not fit the device whose step they fit): each module is made and initialised by
``experiments.dist.meta_init.materializer`` just before ``HMTMethod.prepare`` quantizes it. Checked here on the CPU
(the path is chosen on CUDA; the fake-CUDA tier checks the placement there): the result has the same tensors as
the model built whole and prepared, initialised by transformers' own ``_init_weights``, and the start-up never
holds the full-precision model."""

from __future__ import annotations

import torch

from experiments.config import ModelConfig
from experiments.dist.meta_init import materializer
from experiments.memory.meter import StartupPeak
from experiments.models import build_model
from hmt_core.hmt import HMTMethod
from hmt_core.hmt_config import Config as HMTConfig
from hmt_core.int8_weights import Int8Embedding, int8_layers

CPU = torch.device("cpu")
INT8 = dict(weight_dtype="int8", embedding_dtype="int8", target_patterns=("attn", "mlp", "lm_head"), rank=8)


def card(**kw) -> ModelConfig:
    """16 layers: the whole model's bf16 bytes are several times one module's, so the start-up peaks differ."""
    return ModelConfig(hidden_size=128, num_layers=16, num_heads=4, intermediate_size=352, vocab_size=1024,
                       max_position_embeddings=128, dtype="bf16", **kw)


def started(cfg: ModelConfig, *, on_meta: bool):
    method = HMTMethod(HMTConfig(**INT8))
    with StartupPeak(CPU) as peak:
        if on_meta:
            model = build_model(cfg, device="meta")
            model = method.prepare(model, device=CPU, materialize=materializer(model, CPU))
        else:
            model = method.prepare(build_model(cfg, device=CPU))
    return model, peak.peak_bytes


def tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_a_meta_start_has_the_whole_builds_tensors_and_initialisation():
    cfg = card()
    whole, whole_peak = started(cfg, on_meta=False)
    meta, meta_peak = started(cfg, on_meta=True)
    want, got = tensors(whole), tensors(meta)
    assert not [n for n, t in got.items() if t.device != CPU], [n for n, t in got.items() if t.device != CPU]
    shapes = {n: (tuple(t.shape), t.dtype, t.stride() == (0, 0)) for n, t in got.items()}
    assert shapes == {n: (tuple(t.shape), t.dtype, t.stride() == (0, 0)) for n, t in want.items()}
    assert len(int8_layers(meta)) == cfg.num_layers * 7 + 1 and isinstance(meta.get_input_embeddings(), Int8Embedding)
    for name, t in want.items():  # deterministic initial values: norms' ones, rotary inv_freq
        if "norm" in name or "inv_freq" in name:
            assert torch.equal(got[name], t), name
    # random ones: a fresh draw of transformers' normal(0, initializer_range), 0.02 here; each INT8 layer holds
    # >= 128*128 values, whose sample std is within ~1 % of the true one; 10 % cannot fail by chance, and a
    # forgotten init (uninitialised memory, zeros) is far outside it
    for layer in int8_layers(meta):
        std = layer.dequantized(torch.float32).std().item()
        assert abs(std - 0.02) < 0.002, (layer, std)
    # the start-up's live bytes: the prepared model and one full-precision module at a time (measured: 0.24 MB over
    # the prepared 3.58 MB), never the whole full-precision model (6.96 MB) that the whole build holds before it
    # quantizes (its peak: 7.89 MB). The bound allows the largest module (the 1024 x 128 table) 16 bytes an element:
    # its bf16 copy (2) and the quantizer's fp32 temporaries (at most 3 chunk copies, 12) and codes (1)
    full_bf16 = sum(p.numel() * p.element_size() for p in build_model(cfg, device="meta").parameters())
    prepared = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in got.values()}.values())
    largest = cfg.vocab_size * cfg.hidden_size
    assert meta_peak <= prepared + 16 * largest < full_bf16 < whole_peak, (meta_peak, prepared, full_bf16, whole_peak)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    loss = meta(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss), loss


def test_tied_embeddings_stay_one_tensor():
    """INT8 projected weights with a tied, bf16 embedding and LM head (the head is not projected then): the shared
    meta tensor is made once on the device, so the two modules still hold one tensor."""
    cfg = card(tie_embeddings=True)
    method = HMTMethod(HMTConfig(weight_dtype="int8", rank=8))
    model = build_model(cfg, device="meta")
    model = method.prepare(model, device=CPU, materialize=materializer(model, CPU))
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert emb.weight is head.weight and emb.weight.device == CPU, (emb.weight.device, head.weight.device)
    assert abs(emb.weight.float().std().item() - 0.02) < 0.002
