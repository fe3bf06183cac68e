"""The training loop's per-step bookkeeping, kept on the device so that a step which is not logged makes no host
sync (``experiments.loop``).

``StepTally`` holds, as 0-dim device tensors, the last step's loss, grad norm and whether it was skipped (a
non-finite loss or gradient), the skipped-step count, the bad steps in a row, the step at which they first reached
``train.max_bad_steps``, the last good loss and its EMA, updated with device ops only. ``read`` brings all of them
to the host in one copy (the loop calls it on logging, eval, checkpoint, preemption and last steps); under ``dist``
the loss figures are first averaged over ranks in one all-reduce. ``StepClock`` times each step without a host sync
on CUDA (events, resolved at the next read).

The divergence check (``SpikeRules``, from ``train.max_spike_steps`` and the ``spike_*`` keys) runs on the same
device values. A step with a finite loss and grad norm *breaks a rule* when

- **loss**: after warm-up (step >= ``max(train.warmup_steps, 1)``), its loss is above the run's first (step-0) loss
  plus ``train.spike_loss_margin`` nats (default 1.0): the model is worse than the untrained one. The margin keeps
  a fine-tuning run, whose step-0 loss is one batch's and so noisy, from tripping on its batch-to-batch spread;
- **grad norm**: after warm-up, its grad norm is above ``train.spike_grad_factor`` (default 100) times the norm's
  running level, the exponential moving average (weight 0.1 per step) of the log norm over the earlier steps that
  broke no rule. A geometric mean follows the norm's slow drift over training but not a spike, which is left out
  of its own reference; 100x is far beyond a healthy step's jump (``model=tiny``: at most 1.4x), and a norm growing
  by 1.6x or more per step for long reaches it too (the average lags about 10 steps behind the step it judges);
- **collapse**: at any step, its grad norm is exactly 0 while the loss is finite: no gradient reaches the weights
  (e.g. a model whose outputs went constant, loss ln(vocab), after one huge update), which no later step undoes.

``max_spike_steps`` such steps in a row (a skipped, non-finite step neither counts nor breaks the streak; 0 turns
the check off) trip the run: ``Diverged`` is raised at the next read step. Under ``dist`` the grad norm is global but
each rank compares its own loss; a trip on any rank is agreed at the read (the all-reduce the loss figures take
anyway), so every rank stops at the same step."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from experiments.checkpoint.manager import LoopState, TooManyBadSteps

NAN = float("nan")
LEVEL_WEIGHT = 0.1  # weight of each step in the grad norm's running level (the EMA of its log)
LOSS, GRAD, COLLAPSE = 1, 2, 4  # the rules a step broke, as bits


@dataclass(frozen=True)
class SpikeRules:
    """The divergence rules (module docstring); ``max_steps`` 0: no check."""

    max_steps: int = 0
    loss_margin: float = 1.0
    grad_factor: float = 100.0
    after_step: int = 1  # the first step the loss and grad-norm rules apply to: the end of warm-up

    @classmethod
    def of(cls, cfg) -> SpikeRules:
        """The rules of a ``TrainConfig``."""
        return cls(max_steps=cfg.max_spike_steps, loss_margin=cfg.spike_loss_margin,
                   grad_factor=cfg.spike_grad_factor, after_step=max(cfg.warmup_steps, 1))


class Diverged(TooManyBadSteps):
    """``SpikeRules.max_steps`` steps in a row broke a divergence rule: the run stops with status ``diverged``
    (``experiments.run``: exit 1, one ``error: training diverged:`` line), or with ``train.on_spike=lower_lr`` goes
    on from its last checkpoint at half the learning rate (``experiments.replan``). ``advice``: the settings to
    change, added by the trainer, which knows the configuration in force."""

    def __init__(self, what: str, *, step: int) -> None:
        super().__init__(what)
        self.what, self.step, self.advice = what, step, ""

    def __str__(self) -> str:
        return "; ".join(part for part in (self.what, self.advice) if part)


class Trip(NamedTuple):
    """Where the divergence check tripped (``step`` -1: on another rank), the streak's first step, the rules the
    tripping step broke (``LOSS | GRAD | COLLAPSE`` bits) and its loss, grad norm and the norm's running level then."""

    step: int
    start: int
    rules: int
    loss: float
    grad_norm: float
    level: float

    def describe(self, spike: SpikeRules, first_loss: float) -> str:
        """What happened, in words, for the error line."""
        if self.step < 0:
            return "another rank's steps broke a divergence rule"
        n, broke = spike.max_steps, []
        if self.rules & LOSS:
            broke.append(f"loss {self.loss:.4g} above the step-0 loss {first_loss:.4g} + "
                         f"train.spike_loss_margin={spike.loss_margin:g}")
        if self.rules & GRAD:
            broke.append(f"grad norm {self.grad_norm:.4g} above train.spike_grad_factor={spike.grad_factor:g} x its "
                         f"running level {math.exp(self.level):.4g}")
        if self.rules & COLLAPSE:
            broke.append("grad norm exactly 0 (collapsed: no gradient reaches the weights)")
        if not self.rules & LOSS:
            broke.append(f"loss {self.loss:.4g} (step-0 loss {first_loss:.4g})")
        if not self.rules & (GRAD | COLLAPSE):
            broke.append(f"grad norm {self.grad_norm:.4g}")
        return (f"{n} steps in a row broke a divergence rule (steps {self.start}..{self.step}; "
                f"train.max_spike_steps={n}): at step {self.step} " + ", ".join(broke))


class Reading(NamedTuple):
    """The host values of a read: the last step's (``loss``: the mean over ranks under ``dist``; ``grad_norm``
    NaN where the method returned none; ``skipped``) and ``tripped_at``, the step at which ``max_bad_steps``
    bad steps in a row were first reached (None: not yet); ``diverged``, ``spike_in_row``: the divergence check."""

    loss: float
    grad_norm: float
    skipped: bool
    tripped_at: int | None
    diverged: Trip | None = None  # the divergence check tripped (on this rank, or on another: step -1)
    spike_in_row: int = 0  # steps in a row so far that broke a divergence rule


class StepTally:
    """Per-step values on ``device``, seeded from ``state`` (a resumed run's counters). ``max_bad_steps``: the
    length of the bad streak that trips the run (``train.max_bad_steps``); ``spike``: the divergence rules (none
    checked by default)."""

    def __init__(self, state: LoopState, device: torch.device, *, max_bad_steps: int,
                 spike: SpikeRules = SpikeRules()) -> None:
        def full(value: float, dtype: torch.dtype) -> Tensor:  # a fill kernel: no host-to-device copy
            return torch.full((), value, dtype=dtype, device=device)

        self.device, self.max_bad_steps, self.spike = device, max_bad_steps, spike
        self.steps = full(state.next_step, torch.int64)  # () steps done
        self.skipped = full(state.skipped_steps, torch.int64)
        self.bad_in_row = full(state.bad_in_row, torch.int64)
        self.tripped_at = full(-1, torch.int64)  # () the step where bad_in_row first reached max_bad_steps
        # fp64, as the host floats these replace: the EMA is computed exactly as before (0.9 * ema + 0.1 * loss)
        self.last_loss = full(state.last_loss, torch.float64)
        self.loss_ema = full(NAN if state.loss_ema is None else state.loss_ema, torch.float64)  # NaN: none yet
        self.loss, self.grad_norm = full(NAN, torch.float64), full(NAN, torch.float64)
        self.bad = full(False, torch.bool)
        self.first_loss, self.level = full(state.first_loss, torch.float64), full(state.grad_norm_log_level,
                                                                                  torch.float64)
        self.spike_in_row, self.spike_at = full(state.spike_in_row, torch.int64), full(-1, torch.int64)
        self.spike_rules = full(0, torch.int64)  # the rules the tripping step broke
        # the streak's first step (a resumed streak: counted back from the checkpoint), and the tripping streak's
        self.spike_start = full(state.next_step - state.spike_in_row, torch.int64)
        self.spike_from = full(-1, torch.int64)
        self.spike_values = torch.full((3,), NAN, dtype=torch.float64, device=device)  # its loss, norm, level

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
        if self.spike.max_steps:
            self._watch(loss, norm, good)

    def _watch(self, loss: Tensor, norm: Tensor, good: Tensor) -> None:
        """The divergence rules on one step (module docstring), with device ops only."""
        spike, step, level = self.spike, self.steps - 1, self.level
        warm = step >= spike.after_step
        log_norm = norm.log()  # -inf for 0, NaN for none
        rules = ((warm & (loss > self.first_loss + spike.loss_margin)) * LOSS
                 + (warm & (log_norm > level + math.log(spike.grad_factor))) * GRAD + (norm == 0) * COLLAPSE)
        broke = good & (rules > 0)
        self.spike_in_row = torch.where(good, (self.spike_in_row + 1) * broke, self.spike_in_row)
        self.spike_start = torch.where(broke & (self.spike_in_row == 1), step, self.spike_start)
        first = (self.spike_at < 0) & (self.spike_in_row >= spike.max_steps)
        self.spike_at, self.spike_from = torch.where(first, step, self.spike_at), torch.where(
            first, self.spike_start, self.spike_from)
        self.spike_rules = torch.where(first, rules, self.spike_rules)
        self.spike_values = torch.where(first, torch.stack([loss, norm, level]), self.spike_values)
        calm = good & broke.logical_not() & (norm > 0)
        moved = torch.where(level.isnan(), log_norm, (1 - LEVEL_WEIGHT) * level + LEVEL_WEIGHT * log_norm)
        self.level = torch.where(calm, moved, level)
        self.first_loss = torch.where(self.first_loss.isnan() & good, loss, self.first_loss)

    def read(self, state: LoopState, sync=None) -> Reading:
        """The one host read: fills ``state``'s counters and loss figures and returns the last step's values.
        ``sync`` (``experiments.dist.context.DistContext``): losses averaged over ranks first; the counters are this
        rank's (every rank skips the same steps: the gradients a non-finite loss makes NaN are reduced across
        ranks, so every rank's grad norm is non-finite)."""
        # (4,) fp64: the loss figures and whether this rank's divergence check tripped (> 0 after the mean: any rank)
        losses = torch.stack([self.loss, self.loss_ema, self.last_loss, (self.spike_at >= 0).double()])
        if sync is not None:
            losses = sync.mean_over_ranks(losses)
        counts = torch.stack([self.skipped, self.bad_in_row, self.tripped_at, self.bad.long(), self.spike_in_row,
                              self.spike_at, self.spike_from, self.spike_rules]).double()
        loss, ema, last, any_trip, norm, skipped, in_row, tripped, bad, spikes, end, start, rules, first, level, *at = \
            torch.cat([losses, self.grad_norm.reshape(1), counts, self.first_loss.reshape(1), self.level.reshape(1),
                       self.spike_values]).tolist()
        state.skipped_steps, state.bad_in_row, state.last_loss = int(skipped), int(in_row), last
        state.loss_ema = None if math.isnan(ema) else ema
        state.first_loss, state.grad_norm_log_level, state.spike_in_row = first, level, int(spikes)
        diverged = Trip(int(end), int(start), int(rules), *at) if any_trip > 0 else None
        return Reading(loss=loss, grad_norm=norm, skipped=bool(bad), tripped_at=None if tripped < 0 else int(tripped),
                       diverged=diverged, spike_in_row=int(spikes))


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
