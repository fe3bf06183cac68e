"""The training loop's per-step bookkeeping, kept on the device so that a step which is not logged makes no host
sync (``experiments.loop``).

``StepTally`` holds, as 0-dim device tensors, the last step's loss, grad norm and whether it was skipped (a
non-finite loss or gradient), the skipped-step count, the bad steps in a row, the step at which they first reached
``train.max_bad_steps``, the last good loss and its EMA, updated with device ops only. ``read`` brings all of them
to the host in one copy (the loop calls it on logging, eval, checkpoint, preemption and last steps); under ``dist``
the loss figures are first averaged over ranks in one all-reduce. ``StepClock`` times each step without a host sync
on CUDA (events, resolved at the next read)."""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch
from torch import Tensor

from experiments.checkpoint.manager import LoopState

NAN = float("nan")


class Reading(NamedTuple):
    """The host values of a read: the last step's (``loss``: the mean over ranks under ``dist``; ``grad_norm``
    NaN where the method returned none; ``skipped``) and ``tripped_at``, the step at which ``max_bad_steps``
    bad steps in a row were first reached (None: not yet)."""

    loss: float
    grad_norm: float
    skipped: bool
    tripped_at: int | None


class StepTally:
    """Per-step values on ``device``, seeded from ``state`` (a resumed run's counters). ``max_bad_steps``: the
    length of the bad streak that trips the run (``train.max_bad_steps``)."""

    def __init__(self, state: LoopState, device: torch.device, *, max_bad_steps: int) -> None:
        def full(value: float, dtype: torch.dtype) -> Tensor:  # a fill kernel: no host-to-device copy
            return torch.full((), value, dtype=dtype, device=device)

        self.device, self.max_bad_steps = device, max_bad_steps
        self.steps = full(state.next_step, torch.int64)  # () steps done
        self.skipped = full(state.skipped_steps, torch.int64)
        self.bad_in_row = full(state.bad_in_row, torch.int64)
        self.tripped_at = full(-1, torch.int64)  # () the step where bad_in_row first reached max_bad_steps
        # fp64, as the host floats these replace: the EMA is computed exactly as before (0.9 * ema + 0.1 * loss)
        self.last_loss = full(state.last_loss, torch.float64)
        self.loss_ema = full(NAN if state.loss_ema is None else state.loss_ema, torch.float64)  # NaN: none yet
        self.loss, self.grad_norm = full(NAN, torch.float64), full(NAN, torch.float64)
        self.bad = full(False, torch.bool)

    @torch.no_grad()
    def add(self, loss: Tensor, grad_norm: Tensor | float | None) -> None:
        """One finished step: its loss (0-dim, this rank's) and the method's grad norm (a device tensor; a host
        float from a method not yet returning tensors is accepted as it is, already read)."""
        loss = loss.detach().to(self.device, torch.float64)
        bad = torch.isfinite(loss).logical_not()
        if isinstance(grad_norm, Tensor):
            norm = grad_norm.detach().to(self.device, torch.float64)
            bad = bad | torch.isfinite(norm).logical_not()
        else:
            norm = torch.full((), NAN if grad_norm is None else grad_norm, dtype=torch.float64, device=self.device)
            bad = bad | (grad_norm is not None and not math.isfinite(grad_norm))
        good = bad.logical_not()
        self.loss, self.grad_norm, self.bad = loss, norm, bad
        self.steps = self.steps + 1
        self.skipped = self.skipped + bad
        self.bad_in_row = (self.bad_in_row + 1) * bad  # reset to 0 by a good step
        first_trip = (self.tripped_at < 0) & (self.bad_in_row >= self.max_bad_steps)
        self.tripped_at = torch.where(first_trip, self.steps - 1, self.tripped_at)
        self.last_loss = torch.where(good, loss, self.last_loss)
        ema = torch.where(self.loss_ema.isnan(), loss, 0.9 * self.loss_ema + 0.1 * loss)
        self.loss_ema = torch.where(good, ema, self.loss_ema)

    def read(self, state: LoopState, sync=None) -> Reading:
        """The one host read: fills ``state``'s counters and loss figures and returns the last step's values.
        ``sync`` (``experiments.dist.context.DistContext``): losses averaged over ranks first; the counters are this
        rank's (every rank skips the same steps: the gradients a non-finite loss makes NaN are reduced across
        ranks, so every rank's grad norm is non-finite)."""
        losses = torch.stack([self.loss, self.loss_ema, self.last_loss])  # (3,) fp64
        if sync is not None:
            losses = sync.mean_over_ranks(losses)
        counts = torch.stack([self.skipped, self.bad_in_row, self.tripped_at, self.bad.long()]).double()
        loss, ema, last, norm, skipped, in_row, tripped, bad = torch.cat(
            [losses, self.grad_norm.reshape(1), counts]).tolist()
        state.skipped_steps, state.bad_in_row, state.last_loss = int(skipped), int(in_row), last
        state.loss_ema = None if math.isnan(ema) else ema
        return Reading(loss=loss, grad_norm=norm, skipped=bool(bad), tripped_at=None if tripped < 0 else int(tripped))


class StepClock:
    """Each step's wall time. CUDA: an event recorded before and after each step, their elapsed time resolved at
    ``read`` (no host sync per step; a step's time is the GPU's, from the start of its first to the end of its
    last queued work). Elsewhere: ``time.perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple] = []  # (start, end) events, or (start, end) seconds

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.pending.append((self._now(),))

    def stop(self) -> None:
        self.pending[-1] = (self.pending[-1][0], self._now())

    def read(self) -> list[float]:
        """The seconds of every step stopped since the previous read, in order (waits for the last on CUDA)."""
        done, self.pending = self.pending, []
        if self.cuda and done:
            done[-1][1].synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in done]
        return [end - start for start, end in done]
