"""Bookkeeping shared by methods that update through an ordinary ``torch.optim.Optimizer`` step.

A method composes one ``OptimizerDriver`` (no inheritance): it clips the global gradient norm, steps,
zeroes gradients, applies the loop's LR scale to every group's base LR, and lists the optimizer's state
tensors for the memory meter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake


def iter_state_tensors(state: Any) -> Iterator[torch.Tensor]:
    """All tensors inside a (nested) optimizer-state structure."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from iter_state_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from iter_state_tensors(value)
    else:  # objects such as galore-torch's projectors keep tensors as attributes
        attrs = getattr(state, "__dict__", None)
        if attrs:
            yield from iter_state_tensors(attrs)


class OptimizerDriver:
    def __init__(self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None) -> None:
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self) -> float | None:
        params = [p for p in self.params() if p.grad is not None]
        limit = self.max_grad_norm if self.max_grad_norm else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, limit) if params else torch.zeros(())
        self.optimizer.step()
        return None if is_fake(norm) else float(norm)  # a fake tensor (dry run) has no value

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr_scale(self, scale: float) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * scale

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from iter_state_tensors(self.optimizer.state)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.base_lrs = list(state["base_lrs"])
