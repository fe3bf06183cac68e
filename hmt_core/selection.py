"""Which weights a projected method projects: the 2-D ``nn.Linear``/``Conv1D`` weights whose module name matches a
pattern (GaLore's ``target_modules_list = ["attn", "mlp"]``, Zhao et al. 2024, and APOLLO's scripts, Zhu et al.
2024). One selection for HMT and the baselines (GaLore, APOLLO, AdamW's split rate), so every method projects,
splits and counts the same weights."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

DEFAULT_PATTERNS: tuple[str, ...] = ("attn", "mlp")  # galore-torch's and apollo-torch's scripts


def projectable_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every ``nn.Linear`` and ``transformers`` ``Conv1D`` module with a 2-D weight."""
    kinds: tuple[type, ...] = (nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D

        kinds = (nn.Linear, Conv1D)
    except ImportError:  # transformers is optional for hmt_core itself
        pass
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, kinds) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            yield name, module


def projected_weight_names(model: nn.Module, patterns: tuple[str, ...]) -> set[str]:
    """Qualified names of the trainable 2-D ``nn.Linear``/``Conv1D`` weights whose module name matches a
    pattern (``re.search``); empty when none does (``require_projected_weights`` makes that an error)."""
    names = set()
    for mod_name, module in projectable_modules(model):
        if module.weight.requires_grad and any(re.search(p, mod_name) for p in patterns):
            names.add(f"{mod_name}.weight" if mod_name else "weight")
    return names


def require_projected_weights(model: nn.Module, patterns: tuple[str, ...],
                              key: str = "method.target_patterns") -> set[str]:
    """``projected_weight_names``, or a ``ValueError`` naming ``key``, the model type and a few module names
    when the patterns match no weight (a projected method would otherwise silently train dense AdamW)."""
    names = projected_weight_names(model, patterns)
    if names:
        return names
    model_type = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    candidates = [n for n, _ in projectable_modules(model)] or [n for n, _ in model.named_parameters()]
    examples = list(dict.fromkeys(re.sub(r"\.\d+\.", ".N.", n) for n in candidates))[:6]
    raise ValueError(f"{key}={list(patterns)} match no 2-D Linear/Conv1D weight of {model_type}; names look like: "
                    + (", ".join(examples) if examples else "(the model has no parameters)"))


def projected_elements(params: Iterable[torch.Tensor]) -> int:
    """Elements in the projected weights ``params`` (the ``projected_params`` summary entry)."""
    return int(sum(p.numel() for p in params))
