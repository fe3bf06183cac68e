"""BF16 AdamW baseline: ``torch.optim.AdamW`` (Loshchilov & Hutter, 2019) on every trainable parameter.

Weight storage dtype comes from ``model.dtype`` (BF16 by default, as in GaLore's "BF16 baseline", whose
Adam moments then are BF16 too, since torch keeps moments in the parameter dtype).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from hmt_core.driver import Built, OptimizerMethod
from hmt_core.method import trainable_parameters


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"method.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"method.weight_decay must be >= 0, got {self.weight_decay}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"method.{key} must be in [0, 1), got {getattr(self, key)}")


def build(model: nn.Module, config: Config) -> Built:
    c = config
    opt = torch.optim.AdamW(trainable_parameters(model), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                            weight_decay=c.weight_decay)
    return Built(opt)


def make(config: Config) -> OptimizerMethod:
    return OptimizerMethod("adamw", build=functools.partial(build, config=config))
