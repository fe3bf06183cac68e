"""APOLLO baseline (Zhu et al., 2024, "APOLLO: SGD-like Memory, AdamW-level Performance", Alg. 1):
apollo-torch 1.0.3's ``APOLLOAdamW`` used as published, not re-implemented.

Presets (``variant``): ``apollo`` — rank d_model/4 (capped at the smallest projected weight's min(out, in):
a grouped-query k/v projection can be narrower than d/4, e.g. 1024 rows at 70B), channel-wise scaling, scale 1; ``mini`` (APOLLO-Mini) —
rank 1, tensor-wise scaling, scale 128. Both: seeded random projection refreshed every 200 steps, lr 0.01,
norm-growth limiter on. apollo-torch multiplies the update by ``√scale`` (``np.sqrt(group["scale"])``), so
Mini's effective factor is √128 ≈ 11.3; HMT's Mode B does the same. Only the 2-D weights of ``nn.Linear``
and ``Conv1D`` (GPT-2) modules whose name matches ``target_patterns`` are projected
(``hmt_core.selection.projected_weight_names``; none matching is an error); the rest is a plain AdamW group.
apollo-torch, like HMT's Mode B, takes channel-wise scaling over the longer side of the gradient, so for a
non-square ``Conv1D`` weight the channels are the same features as for the ``nn.Linear`` equivalent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from torch._subclasses.fake_tensor import is_fake
from torch import nn

from baselines.driver import Built, OptimizerMethod, dist_error
from baselines.galore import split_params
from hmt_core.selection import DEFAULT_PATTERNS, projectable_modules, projected_elements
from hmt_core.projection import next_seed

PRESETS = {"apollo": {"scaling": "channel", "scale": 1.0}, "mini": {"scaling": "tensor", "scale": 128.0}}


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "apollo"
    fsdp2: ClassVar[bool] = True  # apollo-torch steps DTensor shards (experiments.checkpoint.dtensor_state)
    variant: str = "apollo"  # "apollo" | "mini"
    lr: float = 1e-2
    rank: int | None = None  # None: d_model // 4 (apollo) or 1 (mini)
    scaling: str | None = None  # None: the variant's ("channel" | "tensor")
    scale: float | None = None  # None: the variant's (1 | 128)
    update_proj_gap: int = 200
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    target_patterns: tuple[str, ...] = DEFAULT_PATTERNS

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_patterns", tuple(self.target_patterns))
        if self.variant not in PRESETS:
            raise ValueError(f"method.variant must be one of {tuple(PRESETS)}, got {self.variant!r}")
        if self.scaling is not None and self.scaling not in ("channel", "tensor"):
            raise ValueError(f"method.scaling must be 'channel' or 'tensor', got {self.scaling!r}")
        if not self.lr > 0:
            raise ValueError(f"method.lr must be > 0, got {self.lr}")
        if self.rank is not None and self.rank <= 0:
            raise ValueError(f"method.rank must be > 0, got {self.rank}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"method.scale must be > 0, got {self.scale}")
        if self.update_proj_gap <= 0:
            raise ValueError(f"method.update_proj_gap must be > 0, got {self.update_proj_gap}")
        if self.weight_decay < 0:
            raise ValueError(f"method.weight_decay must be >= 0, got {self.weight_decay}")

    def check(self, run: Any) -> None:
        """Nothing else in the run clashes with these settings (``hmt_core.method.MethodConfig``)."""

    def dist_error(self, dist: Any) -> str | None:
        return dist_error(self.name, dist)

    def resolved(self, model: nn.Module) -> tuple[int, str, float]:
        """(rank, scaling, scale) after applying the variant's defaults."""
        preset = PRESETS[self.variant]
        rank = self.rank
        if rank is None:  # d/4, capped at the smallest projected weight's min(out, in) (GQA k/v at 70B: 1024)
            rank = 1 if self.variant == "mini" else max(1, min(_d_model(model) // 4, _smallest_side(model)))
        return rank, self.scaling or preset["scaling"], self.scale if self.scale is not None else preset["scale"]


def _d_model(model: nn.Module) -> int:
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden:
        return int(hidden)
    return _smallest_side(model)


def _smallest_side(model: nn.Module) -> int:
    return min(min(m.weight.shape) for _, m in projectable_modules(model))


def build(model: nn.Module, config: Config) -> Built:
    from apollo_torch import APOLLOAdamW

    c = config
    if any(is_fake(p) for p in model.parameters()):
        _make_seed_arithmetic_real()
    rank, scaling, scale = c.resolved(model)
    regular, lowrank = split_params(model, c.target_patterns, rank)
    groups = [{"params": regular},
              {"params": lowrank, "rank": rank, "proj": "random", "scale_type": scaling, "scale": scale,
               "update_proj_gap": c.update_proj_gap, "proj_type": "std"}]
    opt = APOLLOAdamW(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay)
    return Built(opt, summary={"rank/fixed": rank, "apollo/scaling": scaling, "apollo/scale": scale,
                               "optim/projected_params": len(lowrank), "projected_params": projected_elements(lowrank)},
                 metrics={"rank/mean": float(rank)})


def _make_seed_arithmetic_real() -> None:
    """Dry runs (FakeTensorMode): apollo-torch derives each refresh's seed with ``torch.randint(...).tolist()``,
    which a fake tensor cannot answer. Swap in ``hmt_core.projection.next_seed`` — the same draws (tested bit for
    bit against apollo-torch), computed on real tensors — so the traced step is apollo-torch's own code."""
    from apollo_torch import random_projector

    random_projector.next_seed = next_seed


def make(config: Config) -> OptimizerMethod:
    return OptimizerMethod("apollo", build=functools.partial(build, config=config))
