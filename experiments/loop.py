"""The training loop: warmup + cosine LR, gradient accumulation, BF16 autocast, periodic validation, the memory
meter around the first ``METERED_STEPS`` steps (of this process: a resumed run meters its first steps after the
checkpoint), throughput measured on the steps after them (so the meter's Python dispatch overhead never
inflates step time), metrics to the results store and W&B, checkpoints and preemption
(``experiments.checkpoint.manager``).

A step whose loss or gradient is not finite is skipped (no update; counted as ``skipped``); after
``train.max_bad_steps`` such steps in a row the run fails with ``TooManyBadSteps``, leaving its checkpoints. After
``train.max_spike_steps`` steps in a row that broke a divergence rule (a loss above the step-0 loss, a grad-norm
explosion, a collapse to a zero gradient: ``experiments.step_tally``) it stops with ``Diverged`` (a
``TooManyBadSteps``) the same way; a periodic checkpoint due while such a streak is under way is not written, so the
newest checkpoint precedes the streak (``train.on_spike=lower_lr`` resumes from it).

Host syncs: a step reads nothing to the host. The finite decision is made on the device (``train_step``, the
method's ``step``), and the loss, grad norm, skipped count and bad steps in a row stay on the device
(``experiments.step_tally``) until a *read step*: a logging step (``step % log_every == 0``), an eval step, the
last step, a checkpoint step or a preemption. Hence a run with ``max_bad_steps`` bad steps in a row fails at the
first read step at or after the step that completed the streak (the message names that streak's steps), and a
skipped step between logging steps shows only in the next logged ``skipped_steps``. Checkpoints are written only
at read steps, after that check, so none holds the state of a tripped run. The divergence check trips the same way:
at the first read step at or after the step that completed its streak."""

from __future__ import annotations

import contextlib
import functools
import math
import resource
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from experiments.checkpoint.manager import Checkpointer, LoopState, TooManyBadSteps
from experiments.config import TrainConfig, cooldown_steps
from experiments.errors import UserError
from experiments.memory import gpu_stats
from experiments.memory.meter import MemoryMeter
from experiments.step_tally import Diverged, Reading, SpikeRules, StepClock, StepTally
from hmt_core.fused_ce import causal_lm_loss, resolve_head
from hmt_core.method import Method

GIB = 2**30
METERED_STEPS = 3  # steady state from step 2 on: lazily created optimizer state exists by then


def lr_scale(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1 over ``warmup_steps``, then (``train.schedule``) cosine decay to ``min_lr_ratio`` at
    ``steps``, or wsd (warmup-stable-decay; Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond
    Fixed Training Durations"): 1 until the cool-down's first step D = steps − ``cooldown_steps``, then linear,
    1 − (1 − min_lr_ratio)·(step − D)/(steps − D). Before D a wsd run's rate does not depend on ``steps``, so a run
    of any horizon H equals a longer one up to H's D: a cool-down branch resumes the longer run's checkpoint at D
    (``experiments.sweeps.branches``)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        decay = cooldown_steps(cfg.steps, cfg.cooldown_frac)
        start = cfg.steps - decay
        return 1.0 if step < start else 1 - (1 - cfg.min_lr_ratio) * min(1.0, (step - start) / decay)
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def autocast_context(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if enabled and (device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cpu_rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch on ``device``: to CUDA from pinned memory without blocking the host (a pageable copy may wait for
    the stream); elsewhere ``.to``."""
    if device.type == "cuda":
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


def lm_loss(model: nn.Module, ids: torch.Tensor, *, fused_ce: bool = True,
            ce_chunk_tokens: int = 1024) -> torch.Tensor:
    """The next-token loss of ``ids`` (batch, seq_len): the model's own ``labels=`` loss, or with ``fused_ce`` the
    same loss from the hidden states and the LM head in chunks of ``ce_chunk_tokens`` tokens (``hmt_core.fused_ce``:
    the (tokens x vocab) logits are never materialized)."""
    if fused_ce:
        return causal_lm_loss(model, ids, chunk_tokens=ce_chunk_tokens)
    return model(input_ids=ids, labels=ids).loss


def check_lm_loss(model: nn.Module, cfg: TrainConfig) -> None:
    """Before any compute: a ``UserError`` if ``train.fused_ce=true`` cannot stand in for this model's own loss."""
    if cfg.fused_ce:
        try:
            resolve_head(model)
        except ValueError as e:
            raise UserError(str(e)) from None


def train_step(model: nn.Module, method: Method, micro_batches: list[torch.Tensor], *, meter: MemoryMeter | None,
               autocast: Callable[[], contextlib.AbstractContextManager],
               skip_nonfinite: bool = False, fused_ce: bool = True,
               ce_chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step over ``micro_batches`` (each (batch, seq_len) token ids).

    Returns (mean loss, ``method.step()``'s global grad norm or None), both 0-dim tensors on the device: nothing
    here reads a value to the host, so a step makes no host sync of its own and the same function runs under
    FakeTensorMode (dry run), where tensors have no values. ``skip_nonfinite``: a micro-batch loss that is not
    finite seeds its backward with NaN instead of 1 (decided on the device), so its gradients are NaN and
    ``method.step`` skips the step like any step with non-finite gradients (weights and optimizer state unchanged,
    a non-finite grad norm returned); under ``dist`` the gradient reduction carries the NaN to every rank, so
    all ranks skip the step or none. ``fused_ce``, ``ce_chunk_tokens``: how the loss is computed (``lm_loss``).
    """
    phase = meter.phase if meter is not None else (lambda name: contextlib.nullcontext())
    if meter is not None:
        meter.track(micro_batches, "other")
    total = torch.zeros((), device=micro_batches[0].device)  # the loss stays on its device: no host sync per step
    count = len(micro_batches)
    for i, ids in enumerate(micro_batches):
        method.start_micro_batch(i, count)
        with phase("forward"), autocast():
            loss = lm_loss(model, ids, fused_ce=fused_ce, ce_chunk_tokens=ce_chunk_tokens) / count
        with phase("backward"):
            loss.backward(_nan_if_nonfinite(loss) if skip_nonfinite else None)
        total += loss.detach()
        del loss
    with phase("optimizer"):
        grad_norm = method.step()
    if meter is not None:
        meter.mark(method.state_tensors(), "optimizer")
    method.zero_grad()
    return total, grad_norm


@torch.no_grad()
def _nan_if_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """The backward seed of ``loss``: 1, or NaN where ``loss`` is not finite (every gradient it reaches is then NaN;
    0-dim bool mask: an elementwise fill, no host sync)."""
    return torch.ones_like(loss).masked_fill_(torch.isfinite(loss).logical_not_(), float("nan"))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[torch.Tensor], device: torch.device,
             autocast: Callable[[], contextlib.AbstractContextManager], *, fused_ce: bool = True,
             ce_chunk_tokens: int = 1024) -> float:
    was_training = model.training
    model.eval()
    losses = []
    for ids in batches:
        ids = ids.to(device)
        with autocast():
            losses.append(float(lm_loss(model, ids, fused_ce=fused_ce, ce_chunk_tokens=ce_chunk_tokens)))
    model.train(was_training)
    return sum(losses) / len(losses)


@dataclass
class LoopResult:
    train_loss: float
    val_loss: float | None
    steps: int
    tokens: int
    tokens_per_s: float
    step_time_s: float
    step_time_median_s: float
    meter: MemoryMeter
    history: list[dict] = field(default_factory=list)
    skipped_steps: int = 0
    start_step: int = 0
    divergence: dict = field(default_factory=dict)  # the divergence check's references (summary.json)


def run_training(model: nn.Module, method: Method, corpus, cfg: TrainConfig, device: torch.device, *,
                 log: Callable[[dict], None], meter: MemoryMeter, wandb_run=None,
                 profiler: contextlib.AbstractContextManager | None = None,
                 extra_metrics: Callable[[], dict] | None = None, checkpointer: Checkpointer | None = None,
                 state: LoopState | None = None, sync=None) -> LoopResult:
    """Train from ``state.next_step`` (0 for a fresh run) to ``cfg.steps``. ``sync`` (multi-process:
    ``experiments.dist.context.DistContext``): the logged loss is the mean over ranks, a step is skipped on every
    rank or none, and per-rank peak memory is reduced to ``memory/peak_max(GiB)``/``memory/peak_mean(GiB)``.

    Values reach the host only on read steps (module docstring): logging (``step % log_every == 0``), eval, last,
    checkpoint and preemption steps; every other step runs without a host sync."""
    from tqdm.auto import tqdm

    check_lm_loss(model, cfg)
    state = state or LoopState()
    autocast = functools.partial(autocast_context, device, cfg.autocast)
    run = _Run(cfg=cfg, method=method, model=model, device=device, sync=sync, meter=meter, state=state,
               start=state.next_step, checkpointer=checkpointer, autocast=autocast,
               metrics=MetricsLogger(log=log, wandb_run=wandb_run, method=method, device=device, sync=sync,
                                     extra=extra_metrics),
               validator=Validator(model, corpus.val.fixed_batches(cfg.eval_batches), device, autocast, cfg),
               tally=StepTally(state, device, max_bad_steps=cfg.max_bad_steps, spike=SpikeRules.of(cfg)),
               clock=StepClock(device),
               pcie=gpu_stats.PcieSampler.for_device(device))  # pcie: None on CPU or without NVML
    bar = tqdm(range(run.start, cfg.steps), disable=not cfg.progress, dynamic_ncols=True, desc=method.name,
               initial=run.start, total=cfg.steps)
    with profiler or contextlib.nullcontext():
        for step in bar:
            method.set_lr_scale(lr_scale(step, cfg))
            micro = [to_device(corpus.train.batch(step * cfg.grad_accum + k), device) for k in range(cfg.grad_accum)]
            run.step(step, micro, bar)
            if profiler is not None and hasattr(profiler, "step"):
                profiler.step()
    if checkpointer is not None:
        checkpointer.stop_preempt_checks()
        if checkpointer.every > 0:
            checkpointer.save(state)  # the final checkpoint
    return run.result()


@dataclass
class Validator:
    """The validation loss on the same fixed batches at every eval step."""

    model: nn.Module
    batches: list[torch.Tensor]
    device: torch.device
    autocast: Callable[[], contextlib.AbstractContextManager]
    cfg: TrainConfig

    def __call__(self) -> float:
        return evaluate(self.model, self.batches, self.device, self.autocast, fused_ce=self.cfg.fused_ce,
                        ce_chunk_tokens=self.cfg.ce_chunk_tokens)


@dataclass
class MetricsLogger:
    """A logged step's record completed (memory, device and method figures) and written: to ``log`` (the results
    store) and to W&B."""

    log: Callable[[dict], None]
    wandb_run: object
    method: Method
    device: torch.device
    sync: object  # DistContext | None: per-rank peaks reduced over ranks
    extra: Callable[[], dict] | None

    def write(self, step: int, record: dict, peak_mib: float, pcie_metrics: dict) -> None:
        record["memory/peak(GiB)"] = peak_mib / 1024
        if self.sync is not None:
            record.update(self.sync.memory_metrics(peak_mib * 2**20))
        record.update(gpu_stats.step_metrics(self.device), **pcie_metrics)
        record.update(self.method.metrics())
        if self.extra is not None:
            record.update(self.extra())
        self.log(record)
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=step)


@dataclass
class _Run:
    """``run_training``'s state between read steps: one step (timed, metered on the first ``METERED_STEPS``), and
    what a read step does (tallies, eval, log record, checkpoint)."""

    cfg: TrainConfig
    method: Method
    model: nn.Module
    device: torch.device
    sync: object
    meter: MemoryMeter
    state: LoopState
    start: int
    checkpointer: Checkpointer | None
    autocast: Callable[[], contextlib.AbstractContextManager]
    metrics: MetricsLogger
    validator: Validator
    tally: StepTally
    clock: StepClock
    pcie: gpu_stats.PcieSampler | None
    metered: list[bool] = field(default_factory=list)  # per step since the last read
    has_norm: bool = False
    spike_in_row: int = 0  # at the last read: steps in a row that broke a divergence rule
    peak_mib: float = 0.0
    timed_s: float = 0.0
    step_times: list[float] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len * self.cfg.grad_accum

    def step(self, step: int, micro: list[torch.Tensor], bar) -> None:
        """Train one step; at a read step read its figures, then checkpoint (preemption, ``checkpoint_every``)."""
        cfg, state, ckpt = self.cfg, self.state, self.checkpointer
        evals = (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps
        logged = step % cfg.log_every == 0 or evals
        pcie_metrics = self._train(micro, metered=step - self.start < METERED_STEPS, sampled=logged)
        state.next_step = step + 1
        preempt = ckpt is not None and ckpt.preempt_requested()
        save = ckpt is not None and ckpt.due(step + 1) and step + 1 < cfg.steps
        if not (logged or preempt or save):
            return
        dt = self.read_step(step, evals=evals, logged=logged, pcie_metrics=pcie_metrics)
        if preempt:
            ckpt.preempt(state)
        if save and not self.spike_in_row:  # none mid-streak: the newest checkpoint precedes a divergence
            ckpt.save(state)
        if state.loss_ema is not None:
            bar.set_postfix(loss=f"{state.loss_ema:.3f}", tok_s=f"{self.tokens_per_step / dt:.0f}",
                            mem=f"{self.peak_mib:.0f}MiB")

    def _train(self, micro: list[torch.Tensor], *, metered: bool, sampled: bool) -> dict:
        """``train_step`` timed, under the meter when ``metered``; PCIe counters are sampled only through the steps
        that are logged anyway (``sampled``: a sampler costs the host up to one NVML window per step)."""
        meter, pcie = self.meter, self.pcie if sampled else None
        if pcie is not None:
            pcie.start()
        try:
            self.clock.start()
            with meter if metered else contextlib.nullcontext():
                loss_t, grad_norm = train_step(self.model, self.method, micro, meter=meter if metered else None,
                                               autocast=self.autocast, skip_nonfinite=True,
                                               fused_ce=self.cfg.fused_ce, ce_chunk_tokens=self.cfg.ce_chunk_tokens)
            self.tally.add(loss_t, grad_norm)
            self.clock.stop()
        finally:
            pcie_metrics = pcie.stop() if pcie is not None else {}
        self.metered.append(metered)
        self.has_norm = grad_norm is not None
        if self.sync is not None:
            self.sync.count_step()
        if metered:
            self.peak_mib = meter.report().peak_bytes / 2**20
        return pcie_metrics

    def read_step(self, step: int, *, evals: bool, logged: bool, pcie_metrics: dict) -> float:
        """The one host read of the steps since the previous read: their times, the tallies (``state`` updated),
        the eval, the log record; a ``TooManyBadSteps`` once ``max_bad_steps`` bad steps in a row were seen, a
        ``Diverged`` once the divergence check tripped. Returns this step's time (s)."""
        cfg, state, sync = self.cfg, self.state, self.sync
        reading = self.tally.read(state, sync)
        times = self.clock.read()
        for dt, metered in zip(times, self.metered):
            if not metered:
                self.timed_s += dt
                self.step_times.append(dt)
        dt, metered, self.metered = times[-1], self.metered[-1], []
        if evals:
            with sync.counted_as("eval") if sync is not None else contextlib.nullcontext():
                state.val_loss = self.validator()
        if logged:
            record = {"step": step, "loss/train": reading.loss, "lr_scale": lr_scale(step, cfg), "time/step_s": dt,
                      "throughput/tokens_per_s": self.tokens_per_step / dt, "metered": metered}
            if self.has_norm:
                record["optim/grad_norm"] = reading.grad_norm
            if reading.skipped:
                record["skipped"] = True
            record["skipped_steps"] = state.skipped_steps
            if evals:
                record["loss/val"] = state.val_loss
            self.metrics.write(step, record, self.peak_mib, pcie_metrics)
        self.stop_if_tripped(reading)
        return dt

    def stop_if_tripped(self, reading: Reading) -> None:
        """``TooManyBadSteps`` after ``max_bad_steps`` bad steps in a row, ``Diverged`` after the divergence
        check's streak (each naming the last checkpoint)."""
        cfg, state = self.cfg, self.state
        self.spike_in_row = reading.spike_in_row
        if reading.tripped_at is None and reading.diverged is None:
            return
        saved = self.checkpointer.saved if self.checkpointer is not None else []
        last = f"last checkpoint: {saved[-1]['path'] if saved else 'none written'}"
        if reading.tripped_at is not None:
            n, end = cfg.max_bad_steps, reading.tripped_at
            raise TooManyBadSteps(f"{n} consecutive steps with a non-finite loss or gradient (steps {end + 1 - n}.."
                                  f"{end}, each skipped; train.max_bad_steps={n}); {last}")
        what = reading.diverged.describe(self.tally.spike, state.first_loss)
        raise Diverged(f"{what}; {last}", step=reading.diverged.step)

    def result(self) -> LoopResult:
        cfg, state, n = self.cfg, self.state, len(self.step_times)
        step_time = self.timed_s / n if n else float("nan")
        return LoopResult(train_loss=state.last_loss, val_loss=state.val_loss, steps=cfg.steps,
                          tokens=cfg.steps * self.tokens_per_step,
                          tokens_per_s=self.tokens_per_step / step_time if n else float("nan"),
                          step_time_s=step_time,
                          step_time_median_s=statistics.median(self.step_times) if n else float("nan"),
                          meter=self.meter, skipped_steps=state.skipped_steps, start_step=self.start,
                          divergence={"first_loss": state.first_loss,
                                      "grad_norm_level": math.exp(state.grad_norm_log_level)})
