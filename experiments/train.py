"""``mode=train``: build data, model and method, run the loop with the meter, write the results directory."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from experiments import methods
from experiments.checkpoint.manager import (Checkpointer, LoopState, Preempted, ResumePoint, checkpoint_root,
                                            clear_checkpoints, find_resume)
from experiments.config import RunConfig
from experiments.data.corpus import Corpus, build_corpus, has_tokenizer
from experiments.dist import parallel as distributed
from experiments.dist.context import DistContext
from experiments.dryrun import metered_probe
from experiments.errors import UserError, exit_with_error
from experiments.loop import (METERED_STEPS, LoopResult, autocast_context, check_lm_loss, cpu_rss_peak_bytes,
                              run_training)
from experiments.memory import gpu_stats
from experiments.memory.meter import MemoryMeter, StartupPeak
from experiments.models import count_params, has_weights, model_vocab_size
from experiments.replan import Attempt, divergence_advice, restore_at_lr, resumed_plan, train_with_replans
from experiments.results import RunDir, read_status
from experiments.runs import build_summary, print_summary
from experiments.step_tally import Diverged
from hmt_core.activations import apply_policy
from hmt_core.method import Method
from experiments.dist import checks as dist_checks


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def deterministic_algorithms(setting: str, device: torch.device) -> bool:
    """``train.deterministic``: ``auto`` is on for CPU and off on CUDA, where deterministic mode fills every
    ``torch.empty`` with NaN and picks slower kernels."""
    return device.type != "cuda" if setting == "auto" else setting == "true"


def set_deterministic(setting: str, device: torch.device) -> None:
    """Switch torch's deterministic algorithms (warnings, not errors, for ops without one) on or off per
    ``train.deterministic``; on CUDA, deterministic cuBLAS also needs ``CUBLAS_WORKSPACE_CONFIG`` (set to
    ``:4096:8`` unless the user set it) before the first matrix multiply."""
    on = deterministic_algorithms(setting, device)
    if on and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=True)


def make_profiler(run_dir: RunDir, device: torch.device):
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def on_trace_ready(prof) -> None:
        prof.export_chrome_trace(str(run_dir.path / "trace.json"))
        gpu_stats.memory_snapshot(device, run_dir.path / "cuda_memory_snapshot.pickle")

    if device.type == "cuda":
        torch.cuda.memory._record_memory_history()
    return profile(activities=activities, schedule=schedule(wait=METERED_STEPS, warmup=1, active=2, repeat=1),
                   on_trace_ready=on_trace_ready, profile_memory=True, record_shapes=True)


def open_wandb(run: RunConfig, run_dir: RunDir, config_dict: dict):
    if run.wandb.mode == "disabled":
        return None
    import wandb

    try:
        return wandb.init(project=run.wandb.project, entity=run.wandb.entity, mode=run.wandb.mode,
                          name=run_dir.run_id, id=run_dir.run_id, dir=str(run_dir.path), config=config_dict,
                          resume="allow")
    except Exception as e:  # wandb raises its own types (CommError, UsageError, AuthenticationError, ...)
        raise UserError(f"wandb.init failed with wandb.mode={run.wandb.mode} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); use wandb.mode=offline to log locally") from None


def execute_train(run: RunConfig, config_dict: dict, method, run_dir: RunDir, device: torch.device) -> dict:
    """``train_attempt``, or with ``train.on_oom=replan``/``train.on_spike=lower_lr`` as many attempts as
    ``experiments.replan`` steps down or lowers the learning rate (each with a new method object: the failed
    attempt's is attached to its model). ``config_dict`` (the configuration as given) is what config.yaml, the run
    id and the checkpoints' resume check see."""
    if run.train.on_oom != "replan" and run.train.on_spike != "lower_lr":
        return train_attempt(run, config_dict, method, run_dir, device)
    unused = [method]

    def attempt_fn(current: RunConfig, attempt: Attempt) -> dict:
        fresh = unused.pop() if unused else methods.make_method(current.method)
        return train_attempt(current, config_dict, fresh, run_dir, device, attempt=attempt)

    return train_with_replans(run, device, attempt_fn)


def train_attempt(run: RunConfig, config_dict: dict, method, run_dir: RunDir, device: torch.device, *,
                  attempt: Attempt | None = None) -> dict:
    """Set up (data, model, method: every check that needs them fails here, before any compute and before
    anything is written), then train and write ``run_dir``. One trainer for every launch: a single process is
    world size 1 (``DistContext.single``); under torchrun (``dist=ddp|fsdp2``) every rank runs this, rank 0 alone
    writes (``DistContext.run_dir``)."""
    ctx = distributed.setup(run, device)  # validates the launch before anything else
    try:
        trainer = Trainer.build(run, config_dict, method, ctx, ctx.run_dir(run_dir), attempt=attempt)
        return trainer.train()
    finally:
        ctx.teardown()


@dataclass
class Trainer:
    """One attempt's components, built and checked by ``build``; ``train`` runs the loop and writes the results."""

    run: RunConfig
    config_dict: dict
    method: Method
    ctx: DistContext
    run_dir: RunDir
    corpus: Corpus
    model: nn.Module
    forward_model: nn.Module  # ddp: the DDP wrapper (or the model, where the method reduces its own gradients)
    meter: MemoryMeter
    startup_peak_bytes: int
    checkpointer: Checkpointer
    resume_point: ResumePoint | None
    attempt: Attempt | None

    @classmethod
    def build(cls, run: RunConfig, config_dict: dict, method: Method, ctx: DistContext, run_dir: RunDir, *,
              attempt: Attempt | None) -> Trainer:
        ckpt_root = checkpoint_root(run_dir.path, run.train.checkpoint_dir)
        point = find_resume(run.train.resume, ckpt_root, force=run.force, config=config_dict)
        recorded = (point.manifest.get("meta") or {}).get("replan") if point else None
        given = run.method
        run, replanned = resumed_plan(run, recorded, attempt)  # steps down and lowered rates, kept in checkpoints
        method = method if run.method == given else methods.make_method(run.method)  # a lowered method.lr
        if attempt is not None:  # where the next attempt resumes unless this one saves a checkpoint
            attempt.failed(checkpoint=str(point.path) if point else None,
                           checkpoint_step=point.step if point else None, peak_bytes=None)
        seed_everything(run.seed)
        set_deterministic(run.train.deterministic, ctx.device)
        corpus = rank_corpus(run, ctx)
        model, meter, startup_peak = build_model(run, method, ctx, corpus.vocab_size)
        forward_model = distributed.wrap_for_forward(model, method, ctx)  # ddp: DDP (or the method's own reduce)
        t = run.train
        checkpointer = ctx.checkpointer(ckpt_root, every=t.checkpoint_every, keep=t.keep_checkpoints, model=model,
                                        method=method, meta={"run_id": run_dir.run_id, "config": config_dict,
                                                             **({"replan": replanned} if replanned else {})})
        if point is not None:
            checkpointer.check_resume(point)  # dist: a world-size change only where DCP reshards the state
        if ctx.is_main:
            announce_start(run, run_dir, ckpt_root, point)
        return cls(run=run, config_dict=config_dict, method=method, ctx=ctx, run_dir=run_dir, corpus=corpus,
                   model=model, forward_model=forward_model, meter=meter, startup_peak_bytes=startup_peak,
                   checkpointer=checkpointer, resume_point=point, attempt=attempt)

    def train(self) -> dict:
        """Train to ``train.steps`` and write the summary; on failure the run directory says why (status
        ``preempted`` with a checkpoint, ``failed`` with the traceback) and a dead peer is one line."""
        point = self.resume_point
        self.run_dir.start(self.config_dict, keep_metrics_before=point.step if point else None)
        wandb_run = None
        try:
            activation_summary, act_handle = activations_on(self.run, self.model, self.corpus, self.meter, self.ctx)
            params = count_params(self.model)
            state = restore_at_lr(self.checkpointer, self.method, point, self.ctx.device)  # last: sets the RNGs
            if state is not None:  # the restored optimizer state is live from the first step on (counts to the cap)
                self.meter.mark(self.method.state_tensors(), "optimizer")
            self.checkpointer.install_signal_handlers()
            wandb_run = open_wandb(self.run, self.run_dir, self.config_dict) if self.ctx.is_main else None
            result = self._loop(state, wandb_run, act_handle)
            summary = self._summary(result, params, _with_saved(activation_summary, act_handle))
            self._finish(summary, result, wandb_run)
            return summary
        except BaseException as e:
            self._failed(e)
            raise
        finally:
            self.checkpointer.restore_signal_handlers()
            if wandb_run is not None:
                with contextlib.suppress(Exception):
                    wandb_run.finish()

    def _loop(self, state: LoopState | None, wandb_run, act_handle) -> LoopResult:
        run, ctx, device = self.run, self.ctx, self.ctx.device
        gpu_stats.reset_peaks(device)
        profiler = make_profiler(self.run_dir, device) if run.profile and ctx.is_main else None
        result = run_training(self.forward_model, self.method, self.corpus, ctx.train_config(run.train), device,
                              log=_logger(self.run_dir), meter=self.meter, sync=ctx.loop_sync, wandb_run=wandb_run,
                              profiler=profiler, extra_metrics=act_handle.metrics if act_handle else None,
                              checkpointer=self.checkpointer, state=state)
        self.meter.remove_hooks()
        return result

    def _summary(self, result: LoopResult, params: tuple[int, int], activation_summary) -> dict:
        run, ctx, device = self.run, self.ctx, self.ctx.device
        rep = self.meter.report()
        memory = memory_summary(rep, self.startup_peak_bytes, device)
        return build_summary(
            run, self.run_dir.run_id, device, params_total=params[0], params_trainable=params[1],
            steps=result.steps, tokens=result.tokens, tokens_per_s=result.tokens_per_s,
            step_time_s=result.step_time_s, step_time_median_s=result.step_time_median_s,
            train_loss=result.train_loss, val_loss=result.val_loss, memory=memory,
            cpu_rss_peak_bytes=cpu_rss_peak_bytes(), host_device_bytes=rep.host_device_bytes,
            data=self.corpus.stats, method_summary=self.method.summary(), activation_summary=activation_summary,
            skipped_steps=result.skipped_steps, resume=_resume_summary(self.resume_point),
            checkpoints=self.checkpointer.summary(),
            **ctx.summary_block(memory["peak_bytes"], self.startup_peak_bytes),
            divergence=result.divergence,
            **({"replans": self.attempt.replans, "lr_drops": self.attempt.lr_drops} if self.attempt else {}))

    def _finish(self, summary: dict, result: LoopResult, wandb_run) -> None:
        if self.run.train.save_model and self.ctx.is_main:
            self.method.materialize_weights()  # e.g. rows a lazy update has not caught up yet
            save_model(self.model, self.corpus.tokenizer, self.run_dir.path / "model")
        self.run_dir.finish(summary)
        if wandb_run is not None:
            wandb_run.summary.update({"memory/peak(GiB)": summary["memory"]["peak_bytes"] / 2**30,
                                      "loss/val": result.val_loss})
        if self.ctx.is_main:
            print_summary(summary, self.run_dir.path)

    def _failed(self, e: BaseException) -> None:
        """What a run directory, the next attempt and the other ranks learn of a failure."""
        ctx, saved = self.ctx, self.checkpointer.saved
        if isinstance(e, Preempted):  # checkpoint written: resumable, status 'preempted'; exit 75 (130 after Ctrl-C)
            self.run_dir.preempt()
            if ctx.is_main:  # every rank stops alike (DistCheckpointer agrees on the flag); rank 0 says so, once
                print(e, file=sys.stderr)
            ctx.barrier()  # no rank exits before rank 0 has written the status: torchrun stops the others
            return  # (SIGTERM) as soon as one worker exits non-zero
        if isinstance(e, KeyboardInterrupt):
            self.run_dir.fail("interrupted (a second Ctrl-C): stopped without a final checkpoint\n")
            return
        if isinstance(e, Diverged):  # the settings to change, as they are in force
            e.advice = divergence_advice(self.run)
        self.run_dir.fail("".join(traceback.format_exception(e)), status="diverged" if isinstance(e, Diverged)
                          else "failed")
        if self.attempt is not None and isinstance(e, (torch.OutOfMemoryError, Diverged)):  # the next one's start
            last = saved[-1] if saved else None
            self.attempt.failed(checkpoint=last["path"] if last else self.attempt.checkpoint,
                                checkpoint_step=last["step"] if last else self.attempt.checkpoint_step,
                                peak_bytes=_oom_peak(self.meter, ctx.device))
        if ctx.is_peer_failure(e):  # another rank died: one line, not this rank's traceback
            last = saved[-1]["path"] if saved else None
            exit_with_error(ctx.peer_failure_message(e, last), code=1, every_rank=True)


def build_model(run: RunConfig, method: Method, ctx: DistContext, vocab_size: int) -> tuple[nn.Module, MemoryMeter,
                                                                                             int]:
    """The model, prepared by ``method``, sharded as ``ctx`` says, metered and with the method attached:
    (model, meter, start-up peak bytes: build + shard + init, before the first step)."""
    device, t = ctx.device, run.train
    with StartupPeak(device) as startup:  # fsdp2: built on meta, fully_shard per layer + root, shards initialised
        model = distributed.build_sharded(run.model, method, ctx, vocab_size=vocab_size, device=device)
    model.train()
    meter = MemoryMeter(source="cuda" if device.type == "cuda" else "tracker", device=device,
                        cap_bytes=None if t.memory_cap_gib is None else int(t.memory_cap_gib * 2**30))
    meter.track_model(model)
    meter.watch_grads(model.parameters())  # before the method's own hooks: grads are marked, then used
    try:
        method.attach(model, max_grad_norm=t.max_grad_norm or None)
    except ValueError as e:  # the method's settings do not fit this model (rank > dims, no weight matched, ...)
        raise UserError(str(e)) from None
    check_lm_loss(model, t)  # an architecture the fused loss cannot stand in for: refused before any write
    return model, meter, startup.peak_bytes


def rank_corpus(run: RunConfig, ctx: DistContext) -> Corpus:
    """This rank's corpus (rank 0 fills the token cache, the others read it), checked against the model's
    embedding rows before any weight is read."""
    t = run.train
    with ctx.rank_zero_first():
        corpus = build_corpus(path=run.data.path, text_field=run.data.text_field, val_fraction=run.data.val_fraction,
                              vocab_size=model_vocab_size(run.model), seq_len=t.seq_len, batch_size=t.batch_size,
                              seed=run.seed, cache_dir=run.data.cache_dir, min_year=run.data.min_year,
                              max_year=run.data.max_year, tokenizer_path=model_tokenizer(run.model.hf_dir),
                              chunk_chars=run.data.chunk_chars)
    corpus = ctx.shard(corpus)  # this rank's rows of each global batch
    rows = model_vocab_size(run.model) if run.model.hf_dir else corpus.vocab_size
    if corpus.vocab_size > rows:
        raise UserError(f"model.path={run.model.path}: its tokenizer ({corpus.stats['tokenizer_path']}) has "
                        f"{corpus.vocab_size} tokens but the model's embedding has {rows} rows (config.json "
                        f"vocab_size): token ids beyond {rows - 1} would index out of range")
    return corpus


def activations_on(run: RunConfig, model, corpus, meter: MemoryMeter, ctx: DistContext):
    """The activation policy applied to ``model``: (summary, handle), (None, None) for the identity policy.
    Single-process runs first probe it (one short sequence, one layer's gradients, taken with autograd.grad so no
    update hook fires) under its own meter; a dry run traces the same call. dist=ddp|fsdp2: the policy, no probe."""
    if run.activation.is_identity():
        return None, None
    device = ctx.device
    if ctx.distributed:
        summary = {"policy": run.activation.to_dict(), "probe": None,
                   "probe_skipped": dist_checks.probe_skipped(ctx.mode)}
        return summary, apply_policy(model, run.activation)
    gpu_stats.reset_peaks(device)
    probed = metered_probe(model, run.activation, corpus.train.batch(0).to(device), source=meter.source,
                           autocast=lambda: autocast_context(device, run.train.autocast))
    summary = {"policy": run.activation.to_dict(), "probe": probed["metrics"],
               "probe_peak_bytes": probed["peak_bytes"], "probe_tokens": probed["tokens"],
               **{f"probe_{k}": v for k, v in gpu_stats.summary(device).items() if k == "cuda_max_allocated_bytes"}}
    return summary, apply_policy(model, run.activation)


def memory_summary(rep, startup_peak_bytes: int, device: torch.device) -> dict:
    """The summary's ``memory``: the meter's report, the device's statistics, the start-up peak (build + shard +
    init, before the first step)."""
    memory = rep.to_dict()
    memory.update(gpu_stats.summary(device))
    memory["startup_peak_bytes"] = startup_peak_bytes
    if device.type == "cuda":  # the allocator's peak is the authoritative total on a GPU
        memory["tracker_peak_bytes"] = memory["peak_bytes"]
        memory["peak_bytes"] = memory["cuda_max_allocated_bytes"]
    return memory


def _oom_peak(meter: MemoryMeter, device: torch.device) -> int:
    """The failed attempt's measured peak: the CUDA allocator's, else the meter's."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return meter.report().peak_bytes


def announce_start(run: RunConfig, run_dir: RunDir, ckpt_root: Path, point) -> None:
    """Say what a (re)run continues from, or why it starts at step 0; remove stale checkpoints when starting over."""
    if point is not None:
        print(f"resuming {run_dir.run_id} at step {point.step} from {point.path}", file=sys.stderr)
        return
    previous = read_status(run_dir.path)
    if run.force or run.train.resume == "never":
        removed = clear_checkpoints(ckpt_root)
        why = "force=true" if run.force else "train.resume=never"
        if previous or removed:
            print(f"{why}: starting {run_dir.run_id} over at step 0"
                  + (f" ({removed} old checkpoint(s) removed)" if removed else ""), file=sys.stderr)
    elif previous in ("running", "failed", "diverged", "preempted"):
        print(f"starting {run_dir.run_id} at step 0: its previous attempt ended '{previous}' without a usable "
              f"checkpoint in {ckpt_root} (train.checkpoint_every=N saves every N steps)", file=sys.stderr)


def _resume_summary(point) -> dict | None:
    return None if point is None else {"from_step": point.step, "path": str(point.path),
                                       "rejected_checkpoints": point.rejected}


def _with_saved(activation_summary: dict | None, handle) -> dict | None:
    return None if activation_summary is None else {**activation_summary, "saved_bytes": handle.saved_bytes()}


def model_tokenizer(model_path: str | None) -> Path | None:
    """The model directory whose own tokenizer the corpus is encoded with, or None to train a BPE (no
    ``model.path``, or one holding only ``config.json``: random init at the config's vocab_size). A directory with
    weights but no tokenizer is a ``UserError``: a new tokenizer's ids would not match the trained embeddings. A
    model saved by this harness (``save_model``) carries its tokenizer, so fine-tuning reuses it."""
    if not model_path:
        return None
    path = Path(model_path).expanduser()
    if has_tokenizer(path):
        return path
    if has_weights(path):
        raise UserError(f"model.path={model_path} has weights but no tokenizer (tokenizer.json, tokenizer.model or "
                        "tokenizer_config.json); a new tokenizer would not match the embeddings")
    return None


def save_model(model, tokenizer, path: Path) -> None:
    """Hugging Face ``save_pretrained`` of the model and of its tokenizer (tokenizer.json + tokenizer_config.json,
    which names EOS) into ``path``, atomically (temp dir, then rename); ``model.path=<path>`` fine-tunes it."""
    import shutil

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def _logger(run_dir: RunDir):
    return lambda record: (run_dir.log(record), run_dir.flush())  # each logged step reaches the disk at once
