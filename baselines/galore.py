"""GaLore baseline (Zhao et al., 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection",
Alg. 2): galore-torch 1.0's ``GaLoreAdamW`` (or ``GaLoreAdamW8bit`` with ``eight_bit=True``) used as published,
not re-implemented.

Published defaults: projection gap T = 200, scale α = 0.25, lr 0.01, one-sided "std" projection, Adam eps 1e-6
(galore-torch's default; the paper writes 1e-8). The rank is set per model size ("per phase"): the paper uses
128 / 256 / 256 / 512 for LLaMA 60M / 130M / 350M / 1B; set ``rank`` accordingly. Only the 2-D weights of
``nn.Linear`` and ``Conv1D`` (GPT-2) modules whose name matches ``target_patterns`` ("attn", "mlp", as in
galore-torch's scripts; ``hmt_core.selection.projected_weight_names``) are projected; everything else is a plain group
of the same optimizer. galore-torch picks the projected side from the gradient's shape, so a ``Conv1D``
weight's (in, out) layout changes nothing for a non-square weight (see ``hmt_core.hmt`` on square ones).

Notes: ``GaLoreAdamW8bit`` calls ``torch.cuda.synchronize()`` in every step, so it only runs on CUDA machines.
Per-layer (in-backward) GaLore is not offered here: galore-torch's own layer-wise mode refuses gradient
accumulation; HMT's ``per_layer`` is the comparison point for that.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from baselines.driver import Built, OptimizerMethod, dist_error
from hmt_core.selection import DEFAULT_PATTERNS, projected_elements, require_projected_weights


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "galore"
    fsdp2: ClassVar[bool] = True  # galore-torch steps DTensor shards (experiments.checkpoint.dtensor_state)
    lr: float = 1e-2
    rank: int = 128
    update_proj_gap: int = 200
    scale: float = 0.25
    proj_type: str = "std"
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    eight_bit: bool = False
    target_patterns: tuple[str, ...] = DEFAULT_PATTERNS

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_patterns", tuple(self.target_patterns))
        if not self.lr > 0:
            raise ValueError(f"method.lr must be > 0, got {self.lr}")
        if self.rank <= 0:
            raise ValueError(f"method.rank must be > 0, got {self.rank}")
        if self.update_proj_gap <= 0:
            raise ValueError(f"method.update_proj_gap must be > 0, got {self.update_proj_gap}")
        if not self.scale > 0:
            raise ValueError(f"method.scale must be > 0, got {self.scale}")
        if self.proj_type not in ("std", "reverse_std", "left", "right", "full"):
            raise ValueError(f"method.proj_type must be one of std, reverse_std, left, right, full, "
                             f"got {self.proj_type!r}")
        if self.weight_decay < 0:
            raise ValueError(f"method.weight_decay must be >= 0, got {self.weight_decay}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"method.{key} must be in [0, 1), got {getattr(self, key)}")

    def check(self, run: Any) -> None:
        """Nothing else in the run clashes with these settings (``hmt_core.method.MethodConfig``)."""

    def dist_error(self, dist: Any) -> str | None:
        return dist_error(self.name, dist, fsdp2_refusal=None if not self.eight_bit else (
            "dist=fsdp2 with method=galore does not support method.eight_bit=true (bitsandbytes' 8-bit state does "
            "not step DTensor shards); use dist=ddp"))


def split_params(model: nn.Module, patterns: tuple[str, ...], rank: int) -> tuple[list, list]:
    """(regular, low-rank) trainable parameters; the low-rank ones are ``hmt_core.selection``'s projected weights (2-D
    ``nn.Linear``/``Conv1D`` weights matching ``patterns``; none matching is a ``ValueError``). Raises if ``rank``
    exceeds a projected weight's min(rows, cols)."""
    lowrank_names = require_projected_weights(model, patterns)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for name, p in named:
        if name in lowrank_names and rank > min(p.shape):
            raise ValueError(f"method.rank={rank} exceeds min(out, in)={min(p.shape)} of {name} {tuple(p.shape)}")
    return [p for n, p in named if n not in lowrank_names], [p for n, p in named if n in lowrank_names]


def build(model: nn.Module, config: Config) -> Built:
    from galore_torch import GaLoreAdamW, GaLoreAdamW8bit

    c = config
    if c.eight_bit and not any(p.is_cuda for p in model.parameters()):
        raise ValueError("method.eight_bit=true needs a CUDA device: galore-torch's GaLoreAdamW8bit calls "
                         "torch.cuda.synchronize() in every step")
    regular, lowrank = split_params(model, c.target_patterns, c.rank)
    groups = [{"params": regular},
              {"params": lowrank, "rank": c.rank, "update_proj_gap": c.update_proj_gap, "scale": c.scale,
               "proj_type": c.proj_type}]
    kw = dict(lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay)
    opt = GaLoreAdamW8bit(groups, **kw) if c.eight_bit else GaLoreAdamW(groups, no_deprecation_warning=True, **kw)
    return Built(opt, summary={"rank/fixed": c.rank, "optim/projected_params": len(lowrank),
                               "projected_params": projected_elements(lowrank)},
                 metrics={"rank/mean": float(c.rank)})


def make(config: Config) -> OptimizerMethod:
    return OptimizerMethod("galore", build=functools.partial(build, config=config))
