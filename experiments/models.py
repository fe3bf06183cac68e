"""Models: ``transformers`` ``LlamaForCausalLM`` built from a phase config (random init, no hub) or loaded from a
local Hugging Face directory (``model.path``)."""

from __future__ import annotations

import torch

from experiments.config import ModelConfig

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def llama_config(cfg: ModelConfig, vocab_size: int | None = None):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size or cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_embeddings, attn_implementation=cfg.attn_implementation, use_cache=False,
    )


def build_model(cfg: ModelConfig, *, vocab_size: int | None = None, device: torch.device | str = "cpu"):
    """Random-init Llama of the phase's shape (or the local model at ``cfg.path``) in ``cfg.dtype``."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    dtype = TORCH_DTYPES[cfg.dtype]
    if cfg.path:
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype, attn_implementation=cfg.attn_implementation)
        model.config.use_cache = False
        return model.to(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: no fp32 copy first (and FakeTensorMode-safe)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(cfg, vocab_size))
    finally:
        torch.set_default_dtype(previous)
    return model


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) element counts; a 4-bit packed weight counts its logical elements."""
    total = trainable = 0
    for p in model.parameters():
        n = p.numel()
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        if shape is not None:
            n = int(torch.Size(shape).numel())
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable
