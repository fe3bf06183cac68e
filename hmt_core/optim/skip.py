"""A step skipped on the device: HMT's updates run under a 0-dim bool ``found_inf`` and leave every weight and state
tensor as it was where it is True, without the host reading it (the device-side skip of ``torch.amp.GradScaler``'s
``found_inf`` in torch's fused AdamW, for HMT's own update functions). Design and costs: docs/host_syncs.md.

- state an update mutates in place (moments): copied first, put back with ``torch.where(found_inf, old, new)``;
- the direction that reaches the weight: ``torch.where(found_inf, 0, D)``, so the weight (its fp32 master, a
  stochastically rounded BF16 weight) is left bit for bit unless something else changes it; where something does
  (decoupled weight decay, INT8 requantization, stochastic rounding) the writer keeps the rows (``keep``);
- the host's step counters advance and are taken back by ``reconcile`` when the host reads values anyway.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake


class DeviceSkip:
    def __init__(self) -> None:
        self.flag: Tensor | None = None  # () bool on the device while updates run ``under`` it; None: no decision

    @contextmanager
    def under(self, found_inf: Tensor | None) -> Iterator[None]:
        prev, self.flag = self.flag, found_inf
        try:
            yield
        finally:
            self.flag = prev

    def snapshot(self, *state: Tensor) -> tuple[Tensor, ...] | None:  # copies of the state an update mutates
        return None if self.flag is None else tuple(t.clone() for t in state)

    def restore(self, old: tuple[Tensor, ...] | None, *state: Tensor) -> None:
        if old is not None:
            for t, o in zip(state, old):
                torch.where(self.flag, o, t, out=t)

    def zero(self, d: Tensor) -> Tensor:  # a skipped step's direction: 0 (also where d is NaN)
        return d if self.flag is None else torch.where(self.flag, 0.0, d)

    def keep(self, needed: bool) -> Tensor | None:  # the writer's ``keep``: only where a zero direction is not enough
        return self.flag if needed else None

    def limiter(self, prev: Tensor | None, new: Tensor | None) -> Tensor | None:  # (): Mode B's ‖u‖ memory
        if self.flag is None or new is None:
            return new
        # no memory yet: +inf divides by exactly 1 on the next step (update.growth_divisor), as None does
        return torch.where(self.flag, torch.full_like(new, math.inf) if prev is None else prev, new)

    def on_host(self) -> bool:  # for an update that cannot skip on the device (bitsandbytes): one host read
        return self.flag is not None and not is_fake(self.flag) and bool(self.flag)

    def count(self, slot: Any) -> None:  # slot.skipped: () int32 on the device, updates skipped not yet reconciled
        if self.flag is not None:
            slot.skipped = self.flag.to(torch.int32) if slot.skipped is None else slot.skipped.add_(self.flag)


def reconcile(slots: Iterable[Any]) -> None:
    """Take updates skipped on the device off each slot's step counters (``step``, ``adam_t``): one host read of
    every count, where the host reads values anyway (logging steps, checkpoints). Until then a skipped step has
    advanced the bias-correction clock and the refresh schedule (docs/host_syncs.md)."""
    live = [s for s in slots if s.skipped is not None]
    if live and not any(is_fake(s.skipped) for s in live):
        for s, n in zip(live, torch.stack([s.skipped for s in live]).tolist()):
            s.step, s.adam_t = s.step - n, s.adam_t - n
    for s in live:
        s.skipped = None
