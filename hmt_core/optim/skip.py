"""A step skipped on the device: HMT's updates run under a 0-dim bool ``found_inf`` and leave every weight and state
tensor as it was where it is True, without the host reading it (the device-side skip of ``torch.amp.GradScaler``'s
``found_inf`` in torch's fused AdamW, for HMT's own update functions). Design and costs: docs/host_syncs.md.

- Adam's moments: updated with device-side factors, ``moment_factors`` = ``where(found_inf, (0, 1, 1), (1−β₁, β₁,
  β₂))`` (one op per flag), from a gradient zeroed where found_inf (``zero``): a skipped step computes m + 0·(0 − m)
  and v·1 + 0, the same bits (``hmt_core.adam.adam_moments_``). The fused Triton Adam takes no factors: there the
  moments are copied first and put back with ``torch.where(found_inf, old, new)`` (``snapshot``/``restore``);
- the direction that reaches the weight: 0 where found_inf is True (``zeroed_where``: ``D.masked_fill(found_inf, 0)``'s
  bits, as one integer ``addcmul`` on D's bits), so the weight (its fp32 master, a
  stochastically rounded BF16 weight) is left bit for bit unless something else changes it; where something does
  (decoupled weight decay, INT8 requantization, stochastic rounding) the writer keeps the rows (``keep``);
- the host's step counters advance and are taken back by ``reconcile`` when the host reads values anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from hmt_core.adam import moment_factors
from hmt_core.optim.slot import StepClock


class DeviceSkip:
    def __init__(self) -> None:
        self.flag: Tensor | None = None  # () bool on the device while updates run ``under`` it; None: no decision
        self._factors: Tensor | None = None  # (3,) fp32: ``moment_factors`` under ``flag`` (made on first use)
        self._choices: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}  # (run, skip) factors by betas, device
        self._later: list[tuple[StepClock, Tensor]] | None = None  # (clock, flag) counted by ``flush_counts``; None: at once

    @contextmanager
    def under(self, found_inf: Tensor | None) -> Iterator[None]:
        prev = self.flag, self._factors
        self.flag, self._factors = found_inf, None
        try:
            yield
        finally:
            self.flag, self._factors = prev

    def moment_factors(self, beta1: float, beta2: float) -> Tensor | None:
        """(3,) fp32 ``factors`` of ``hmt_core.adam.adam_moments_`` under the flag: (1−β₁, β₁, β₂), or (0, 1, 1)
        where it is True; one ``where`` per flag (the two choices are filled once per device)."""
        if self.flag is None:
            return None
        if self._factors is None:
            key = (beta1, beta2, self.flag.device, is_fake(self.flag))  # a dry run's fake ones apart
            if key not in self._choices:
                self._choices[key] = moment_factors(beta1, beta2, self.flag.device)
            run, skip = self._choices[key]
            self._factors = torch.where(self.flag, skip, run)
        return self._factors

    def snapshot(self, *state: Tensor) -> tuple[Tensor, ...] | None:  # copies of the state an update mutates
        return None if self.flag is None else tuple(t.clone() for t in state)

    def restore(self, old: tuple[Tensor, ...] | None, *state: Tensor) -> None:
        if old is not None:
            for t, o in zip(state, old):
                torch.where(self.flag, o, t, out=t)

    def zero(self, d: Tensor) -> Tensor:  # a skipped step's direction or gradient: 0 (also where d is NaN)
        return d if self.flag is None else zeroed_where(d, self.flag)

    def keep(self, needed: bool) -> Tensor | None:  # the writer's ``keep``: only where a zero direction is not enough
        return self.flag if needed else None

    def on_host(self) -> bool:  # for an update that cannot skip on the device (bitsandbytes): one host read
        return self.flag is not None and not is_fake(self.flag) and bool(self.flag)

    def count_many(self, clocks: list[StepClock]) -> None:  # ``count`` of each clock, one ``_foreach_add_`` for all
        if self.flag is None:
            return
        live = [c.skipped for c in clocks if c.skipped is not None]
        if live:  # a list of the flag, not the flag as a scalar: the latter is read on the host (.item()) on CPU
            torch._foreach_add_(live, [self.flag] * len(live))
        for c in clocks:
            if c.skipped is None:
                c.skipped = self.flag.to(torch.int32)

    def count(self, clock: StepClock) -> None:  # clock.skipped: () int32 on the device, not yet reconciled
        if self.flag is None:
            return
        if self._later is not None:
            self._later.append((clock, self.flag))
            return
        clock.skipped = self.flag.to(torch.int32) if clock.skipped is None else clock.skipped.add_(self.flag)

    def count_later(self) -> None:
        """Keep each ``count`` until ``flush_counts``, which adds the flags of many clocks in one ``_foreach_add_``
        (the per-layer engine's step: its in-backward updates each run under their own flag)."""
        if self._later is None:
            self._later = []

    def flush_counts(self) -> None:
        later, self._later = self._later, None
        live, flags, seen = [], [], set()
        for clock, flag in later or ():
            if clock.skipped is None:
                clock.skipped = flag.to(torch.int32)
            elif id(clock) in seen:  # twice in one list: the multi-tensor kernel would race
                clock.skipped.add_(flag)
            else:
                seen.add(id(clock))
                live.append(clock.skipped)
                flags.append(flag)
        if live:
            torch._foreach_add_(live, flags)


def zeroed_where(d: Tensor, flag: Tensor) -> Tensor:  # d: any shape; flag: () bool on d's device
    """``d.masked_fill(flag, 0)``, bit for bit, for every value of d (NaN, ±inf, −0 included): on d's bits read as
    int16, b − b·flag, one elementwise integer ``addcmul`` (int16 products are computed in int: no overflow). The
    same allocation as the masked fill; on CPU 6–12× faster than a masked fill by a broadcast 0-dim mask (the
    measurement: docs/host_syncs.md). Falls back to the masked fill where d's bits cannot be read as int16."""
    if d.dim() == 0 or d.element_size() not in (2, 4) or (d.element_size() == 4 and d.stride(-1) != 1):
        return d.masked_fill(flag, 0.0)
    bits = d.view(torch.int16)  # a 4-byte element: two int16 halves along the last dimension
    return torch.addcmul(bits, bits, flag.view(torch.int8), value=-1).view(d.dtype)


def reconcile(clocks: Iterable[StepClock]) -> None:
    """Take updates skipped on the device off each clock's step counters (``step``, ``adam_t``): one host read of
    every count, where the host reads values anyway (logging steps, checkpoints). Until then a skipped step has
    advanced the bias-correction clock and the refresh schedule (docs/host_syncs.md)."""
    live = [c for c in clocks if c.skipped is not None]
    if live and not any(is_fake(c.skipped) for c in live):
        for c, n in zip(live, torch.stack([c.skipped for c in live]).tolist()):
            c.step, c.adam_t = c.step - n, c.adam_t - n
    for c in live:
        c.skipped = None
