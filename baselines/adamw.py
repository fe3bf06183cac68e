"""BF16 AdamW baseline: ``torch.optim.AdamW`` (Loshchilov & Hutter, 2019) on every trainable parameter.

Weight storage dtype comes from ``model.dtype`` (BF16 by default, as in GaLore's "BF16 baseline", whose
Adam moments then are BF16 too, since torch keeps moments in the parameter dtype).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hmt_core.driver import OptimizerDriver
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


class AdamWMethod:
    name = "adamw"

    def __init__(self, config: Config) -> None:
        self.config = config
        self.driver: OptimizerDriver | None = None

    def prepare(self, model: nn.Module) -> nn.Module:
        return model

    def attach(self, model: nn.Module, *, max_grad_norm: float | None) -> None:
        c = self.config
        opt = torch.optim.AdamW(trainable_parameters(model), lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                                weight_decay=c.weight_decay)
        self.driver = OptimizerDriver(opt, max_grad_norm=max_grad_norm)

    def start_micro_batch(self, index: int, count: int) -> None:
        pass

    def step(self) -> float | None:
        return self.driver.step()

    def zero_grad(self) -> None:
        self.driver.zero_grad()

    def set_lr_scale(self, scale: float) -> None:
        self.driver.set_lr_scale(scale)

    def state_tensors(self) -> Iterator[torch.Tensor]:
        return self.driver.state_tensors()

    def metrics(self) -> dict[str, float]:
        return {}

    def summary(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return self.driver.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.driver.load_state_dict(state)


def make(config: Config) -> AdamWMethod:
    return AdamWMethod(config)
