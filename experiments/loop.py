"""The training loop: warmup + cosine LR, gradient accumulation, BF16 autocast, periodic validation, the memory
meter around the first ``METERED_STEPS`` steps (of this process: a resumed run meters its first steps after the
checkpoint), throughput measured on the steps after them (so the meter's Python dispatch overhead never
inflates step time), metrics to the results store and W&B, checkpoints and preemption
(``experiments.checkpointing``).

A step whose loss or gradient is not finite is skipped (no update; counted as ``skipped``); after
``train.max_bad_steps`` such steps in a row the run fails with ``TooManyBadSteps``, leaving its checkpoints."""

from __future__ import annotations

import contextlib
import math
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from experiments import gpu_stats
from experiments.checkpointing import Checkpointer, LoopState, TooManyBadSteps
from experiments.config import TrainConfig
from experiments.meter import MemoryMeter
from hmt_core.fused_ce import causal_lm_loss, resolve_head
from hmt_core.method import Method

GIB = 2**30
METERED_STEPS = 3  # steady state from step 2 on: lazily created optimizer state exists by then


def lr_scale(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1 over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def autocast_context(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if enabled and (device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cpu_rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


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
    from experiments.errors import UserError

    if cfg.fused_ce:
        try:
            resolve_head(model)
        except ValueError as e:
            raise UserError(str(e)) from None


def train_step(model: nn.Module, method: Method, micro_batches: list[torch.Tensor], *, meter: MemoryMeter | None,
               autocast: Callable[[], contextlib.AbstractContextManager],
               skip_nonfinite: bool = False, fused_ce: bool = True, ce_chunk_tokens: int = 1024,
               all_finite: Callable[[torch.Tensor], bool] | None = None) -> tuple[torch.Tensor, float | None]:
    """One optimizer step over ``micro_batches`` (each (batch, seq_len) token ids).

    Returns (mean loss as a 0-dim tensor, global grad norm or None); the caller converts, so the same function
    runs under FakeTensorMode, where tensors have no values. ``skip_nonfinite`` (real tensors only): a
    micro-batch loss that is not finite ends the step before its backward, and non-finite gradients left for
    ``method.step`` skip it; both discard the gradients and return a NaN grad norm (and a NaN loss in the first
    case). HMT checks the gradients it consumes inside backward itself and returns a NaN norm. ``fused_ce``,
    ``ce_chunk_tokens``: how the loss is computed (``lm_loss``). ``all_finite`` (multi-process: agreed across
    ranks, so all skip or none) replaces the local finiteness check of the loss.
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
        if skip_nonfinite and not (all_finite(loss) if all_finite else bool(torch.isfinite(loss))):
            return _discard_step(method, torch.full((), float("nan"), device=loss.device))
        with phase("backward"):
            loss.backward()
        total += loss.detach()
        del loss
    if skip_nonfinite and not _grads_finite(model):
        return _discard_step(method, total)
    with phase("optimizer"):
        grad_norm = method.step()
    if meter is not None:
        meter.mark(method.state_tensors(), "optimizer")
    method.zero_grad()
    return total, grad_norm


def _discard_step(method: Method, loss: torch.Tensor) -> tuple[torch.Tensor, float]:
    method.zero_grad()
    return loss, float("nan")


@torch.no_grad()
def _grads_finite(model: nn.Module) -> bool:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return not grads or bool(torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(grads)])).all())


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


def run_training(model: nn.Module, method: Method, corpus, cfg: TrainConfig, device: torch.device, *,
                 log: Callable[[dict], None], meter: MemoryMeter, wandb_run=None,
                 profiler: contextlib.AbstractContextManager | None = None,
                 extra_metrics: Callable[[], dict] | None = None, checkpointer: Checkpointer | None = None,
                 state: LoopState | None = None, sync=None) -> LoopResult:
    """Train from ``state.next_step`` (0 for a fresh run) to ``cfg.steps``. ``sync`` (multi-process:
    ``experiments.distributed.DistContext``): the logged loss is the mean over ranks, a step is skipped on every
    rank or none, and per-rank peak memory is reduced to ``memory/peak_max(GiB)``/``memory/peak_mean(GiB)``."""
    from tqdm.auto import tqdm

    def autocast() -> contextlib.AbstractContextManager:
        return autocast_context(device, cfg.autocast)

    check_lm_loss(model, cfg)
    state = state or LoopState()
    start = state.next_step
    val_batches = corpus.val.fixed_batches(cfg.eval_batches)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    timed_s, timed_steps, step_times, peak_mib = 0.0, 0, [], 0.0
    pcie = gpu_stats.PcieSampler.for_device(device)  # None on CPU or without NVML
    bar = tqdm(range(start, cfg.steps), disable=not cfg.progress, dynamic_ncols=True, desc=method.name,
               initial=start, total=cfg.steps)
    with profiler or contextlib.nullcontext():
        for step in bar:
            method.set_lr_scale(lr_scale(step, cfg))
            micro = [corpus.train.batch(step * cfg.grad_accum + k).to(device) for k in range(cfg.grad_accum)]
            metered = step - start < METERED_STEPS
            gpu_stats.synchronize(device)
            t0 = time.perf_counter()
            # PCIe counters are sampled only through the steps that are logged anyway (a sampler costs the host up
            # to one NVML window per step)
            sampled = pcie is not None and (step % cfg.log_every == 0 or (step + 1) % cfg.eval_every == 0
                                            or step + 1 == cfg.steps)
            if sampled:
                pcie.start()
            try:
                with meter if metered else contextlib.nullcontext():
                    loss_t, grad_norm = train_step(model, method, micro, meter=meter if metered else None,
                                                   autocast=autocast, skip_nonfinite=True, fused_ce=cfg.fused_ce,
                                                   ce_chunk_tokens=cfg.ce_chunk_tokens,
                                                   all_finite=sync.all_finite if sync is not None else None)
                loss = float(loss_t) if sync is None else sync.mean(loss_t)
                grad_norm = None if grad_norm is None else float(grad_norm)  # a 0-dim device tensor (or a float)
                gpu_stats.synchronize(device)
                dt = time.perf_counter() - t0
            finally:
                pcie_metrics = pcie.stop() if sampled else {}
            if not metered:
                timed_s, timed_steps = timed_s + dt, timed_steps + 1
                step_times.append(dt)
            skipped = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))
            state.next_step = step + 1
            if skipped:
                state.skipped_steps, state.bad_in_row = state.skipped_steps + 1, state.bad_in_row + 1
            else:
                state.bad_in_row, state.last_loss = 0, loss
                state.loss_ema = loss if state.loss_ema is None else 0.9 * state.loss_ema + 0.1 * loss
            if metered:
                peak_mib = meter.report().peak_bytes / 2**20
            record = {"step": step, "loss/train": loss, "lr_scale": lr_scale(step, cfg), "time/step_s": dt,
                      "throughput/tokens_per_s": tokens_per_step / dt, "metered": metered}
            if grad_norm is not None:
                record["optim/grad_norm"] = grad_norm
            if skipped:
                record["skipped"] = True
            record["skipped_steps"] = state.skipped_steps
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                with sync.counted_as("eval") if sync is not None else contextlib.nullcontext():
                    state.val_loss = evaluate(model, val_batches, device, autocast, fused_ce=cfg.fused_ce,
                                              ce_chunk_tokens=cfg.ce_chunk_tokens)
                record["loss/val"] = state.val_loss
            if step % cfg.log_every == 0 or "loss/val" in record or step + 1 == cfg.steps or skipped:
                record["memory/peak(GiB)"] = peak_mib / 1024
                if sync is not None:
                    record.update(sync.memory_metrics(peak_mib * 2**20))
                record.update(gpu_stats.step_metrics(device), **pcie_metrics)
                record.update(method.metrics())
                if extra_metrics is not None:
                    record.update(extra_metrics())
                log(record)
                if wandb_run is not None:
                    wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=step)
            if state.bad_in_row >= cfg.max_bad_steps:
                last = checkpointer.saved[-1]["path"] if checkpointer and checkpointer.saved else "none written"
                raise TooManyBadSteps(f"{state.bad_in_row} consecutive steps with a non-finite loss or gradient "
                                      f"(steps {step + 1 - state.bad_in_row}..{step}, each skipped; "
                                      f"train.max_bad_steps={cfg.max_bad_steps}); last checkpoint: {last}")
            if checkpointer is not None:
                if checkpointer.preempt_requested():
                    checkpointer.preempt(state)
                if checkpointer.due(step + 1) and step + 1 < cfg.steps:
                    checkpointer.save(state)
            if state.loss_ema is not None:
                bar.set_postfix(loss=f"{state.loss_ema:.3f}", tok_s=f"{tokens_per_step / dt:.0f}",
                                mem=f"{peak_mib:.0f}MiB")
            if profiler is not None and hasattr(profiler, "step"):
                profiler.step()
    if checkpointer is not None and checkpointer.every > 0:
        checkpointer.save(state)  # the final checkpoint
    step_time = timed_s / timed_steps if timed_steps else float("nan")
    return LoopResult(train_loss=state.last_loss, val_loss=state.val_loss, steps=cfg.steps,
                      tokens=cfg.steps * tokens_per_step,
                      tokens_per_s=tokens_per_step / step_time if timed_steps else float("nan"),
                      step_time_s=step_time, step_time_median_s=statistics.median(step_times) if step_times else
                      float("nan"), meter=meter, skipped_steps=state.skipped_steps, start_step=start)
