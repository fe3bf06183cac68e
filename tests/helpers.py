"""Shared test fixtures as plain functions: the tiny Llama and token batches the equivalence tests use."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)
    return LlamaForCausalLM(cfg).float()


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(n)]
