"""The training loop's side of checkpoints: where they live, when to save, how to resume, preemption signals.

- Where: ``train.checkpoint_dir`` (default ``<results_dir>/<run_id>/checkpoints``).
- When: after every ``train.checkpoint_every`` steps and at the end (0: never periodically), and whenever
  SIGTERM or SIGUSR1 arrives (Slurm preemption, ``sbatch --signal=B:USR1@120``) or SIGINT (Ctrl-C; exit 130,
  no requeue; a second Ctrl-C stops at once, keeping the checkpoints already written): the signal only sets a flag;
  the current step finishes, a checkpoint is written, then the run exits with ``PREEMPTED_EXIT_CODE`` (75,
  EX_TEMPFAIL; list it in slurm.conf's ``RequeueExit`` for automatic requeue) after asking Slurm to requeue
  the job (``scontrol requeue``) when it runs under Slurm; the run's status is ``preempted`` (resumable).
  ``train.keep_checkpoints`` bounds how many are kept. Under torchrun: ``docs/gpu_runs.md``.
- Resume: ``train.resume=auto`` (default) continues from the newest checkpoint in the checkpoint directory whose
  checksums verify (newer damaged ones are reported and skipped); ``never`` starts over (and clears old
  checkpoints of this run); a path (a ``step-*`` directory, or a checkpoint directory) resumes from there and
  fails if it does not verify. ``force=true`` always starts over. A checkpoint written under a different
  configuration (any key but where/how often things are written: ``RESUMABLE_KEYS``) is refused, naming the keys.

A checkpoint holds: trainable weights and buffers (``model.pt``), the method's state (``method.pt``: moments,
projection bases, rank history, limiter and clipping state), and ``loop.pt``: the next step (the data position
is the step: ``PackedTokens.batch`` is a pure function of (seed, step)), the loop's running values, the bad-step
counters and the state of every random generator. Restoring all of that makes the resumed trajectory equal the
uninterrupted one bit for bit on CPU.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from experiments.config import RUN_ID_IGNORED_TRAIN_KEYS, without_added_defaults
from experiments.errors import UserError
from experiments.checkpoint import store as ck

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, the shell's convention for Ctrl-C
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# test hook: seconds to pause after the first file of each checkpoint, to kill a writer mid-checkpoint
PAUSE_ENV = "HMT_CHECKPOINT_PAUSE_S"


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written; exits the process with ``PREEMPTED_EXIT_CODE``."""

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Interrupted(Preempted):
    """Ctrl-C: raised after the checkpoint is written; exits with ``INTERRUPTED_EXIT_CODE`` (no Slurm requeue)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = INTERRUPTED_EXIT_CODE


class TooManyBadSteps(FloatingPointError):
    pass


@dataclass
class LoopState:
    """What the loop carries from step to step (saved in ``loop.pt``)."""

    next_step: int = 0
    last_loss: float = float("nan")
    loss_ema: float | None = None
    val_loss: float | None = None
    skipped_steps: int = 0
    bad_in_row: int = 0
    # the divergence check (experiments.step_tally): the run's first (step-0) loss, the log of the grad norm's
    # running level, and the steps in a row that broke a rule; NaN: none yet (a checkpoint written before them)
    first_loss: float = float("nan")
    grad_norm_log_level: float = float("nan")
    spike_in_row: int = 0


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    manifest: dict
    rejected: list[str]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def checkpoint_root(run_dir: Path, checkpoint_dir: str | None) -> Path:
    return Path(checkpoint_dir).expanduser() if checkpoint_dir else Path(run_dir) / "checkpoints"


def find_resume(resume: str, root: Path, *, force: bool, config: dict | None = None) -> ResumePoint | None:
    """The checkpoint to resume from, per ``train.resume``; prints why damaged checkpoints were skipped.

    Reads only: starting over removes old checkpoints later (``clear_checkpoints``), once the run's set-up has
    passed its checks. With ``config`` given, a checkpoint written under a different configuration is refused
    with a one-line ``UserError`` listing the keys that differ (``config_differences``).
    """
    if force or resume == "never":
        return None
    if resume == "auto":
        path, manifest, rejected = ck.find_latest_good(root)
    else:
        target = Path(resume).expanduser()
        if not target.exists():
            raise UserError(f"train.resume={resume}: no such checkpoint or directory")
        if (target / ck.MANIFEST).exists() or ck.STEP_DIR.match(target.name):
            try:
                path, manifest, rejected = target, ck.verify(target), []  # an explicit checkpoint must verify
            except ck.CheckpointError as e:
                raise UserError(f"train.resume={resume}: {e}") from None
        else:
            path, manifest, rejected = ck.find_latest_good(target)
            if path is None:
                raise UserError(f"train.resume={resume}: no good checkpoint there"
                                + (f" ({'; '.join(rejected)})" if rejected else ""))
    for problem in rejected:
        print(f"warning: skipping damaged checkpoint: {problem}", file=sys.stderr)
    if path is None:
        return None
    if config is not None:
        saved = (manifest.get("meta") or {}).get("config")
        differences = config_differences(saved, config) if saved is not None else ["(no configuration recorded)"]
        if differences:
            shown = "; ".join(differences[:6]) + (f"; … {len(differences) - 6} more" if len(differences) > 6 else "")
            raise UserError(f"checkpoint {path} was written by a run with a different configuration ({shown}); "
                            "resume with the same settings, or start over with force=true or train.resume=never")
    if rejected:
        print(f"resuming from the previous good checkpoint {path}", file=sys.stderr)
    return ResumePoint(path, manifest, rejected)


# Keys a resumed run may change: where things are written and how often, not what is computed.
RESUMABLE_KEYS = ("run_id", "results_dir", "force", "wandb", "profile", "dryrun",
                  *(f"train.{key}" for key in RUN_ID_IGNORED_TRAIN_KEYS))


def _flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out: dict[str, object] = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: list(value) if isinstance(value, tuple) else value}


def config_differences(saved: dict, current: dict) -> list[str]:
    """``key: saved -> current`` for every setting that changes what the run computes (another method is one
    difference, ``method: 'hmt' -> 'adamw'``, not one per key of the two methods' configs)."""
    name_a, name_b = (saved.get("method") or {}).get("name"), (current.get("method") or {}).get("name")
    if name_a != name_b:
        rest = config_differences({**saved, "method": {}}, {**current, "method": {}})
        return [f"method: {name_a!r} -> {name_b!r}", *rest]
    a, b = _flatten(without_added_defaults(saved)), _flatten(without_added_defaults(current))
    keep = lambda k: not any(k == r or k.startswith(r + ".") for r in RESUMABLE_KEYS)  # noqa: E731
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}"
            for k in sorted(set(a) | set(b)) if keep(k) and a.get(k) != b.get(k)]


def clear_checkpoints(root: Path) -> int:
    """Remove this run's old checkpoints (starting over: they would shadow the new ones); returns how many."""
    removed = 0
    for _, path in ck.list_checkpoints(root):
        shutil.rmtree(path)
        removed += 1
    return removed


class Checkpointer:
    """Saves checkpoints of one run and turns preemption signals into "checkpoint, then exit"."""

    def __init__(self, root: Path, *, every: int, keep: int, model: nn.Module, method, meta: dict) -> None:
        self.root = ck.check_writable(root)
        self.every, self.keep = every, keep
        self.model, self.method, self.meta = model, method, meta
        self.saved: list[dict] = []
        self.signal_received: int | None = None
        self._previous_handlers: dict[int, object] = {}
        self._fingerprint: str | None = None
        self.pause_s = float(os.environ.get(PAUSE_ENV, "0") or 0)

    # ---- resume ---------------------------------------------------------------------------------------------
    def check_resume(self, point: ResumePoint) -> None:
        """Refuse ``point`` with a one-line ``UserError`` before anything is written (the single-process format
        has nothing to check beyond ``find_resume``'s config check; ``DistCheckpointer`` checks the world size)."""

    def restore(self, point: ResumePoint, device: torch.device) -> LoopState:
        """Load weights, method state and RNG states from ``point``; returns the loop state to continue from."""
        manifest, payload = ck.load_checkpoint(point.path, map_location=device)
        expected = manifest["meta"].get("frozen_fingerprint")
        if expected is not None and expected != self.fingerprint():
            raise ck.CheckpointError(f"{point.path}: the frozen (not checkpointed) weights differ from the ones "
                                     "this checkpoint was trained on (different seed, model.path or model?)")
        ck.load_model_state(self.model, payload["model"])
        self.method.load_state_dict(payload["method"])
        loop = payload["loop"]
        ck.set_rng_state(loop["rng"])
        return LoopState(**loop["state"])

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = ck.frozen_fingerprint(self.model)
        return self._fingerprint

    # ---- save -----------------------------------------------------------------------------------------------
    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0

    def save(self, state: LoopState) -> ck.SavedCheckpoint:
        payload = {"model": ck.model_state(self.model), "method": self.method.state_dict(),
                   "loop": {"state": dataclasses.asdict(state), "rng": ck.rng_state()}}
        meta = {**self.meta, "frozen_fingerprint": self.fingerprint(), "next_step": state.next_step}
        saved = ck.save_checkpoint(self.root, state.next_step, payload, meta=meta, keep=self.keep,
                                   pause_after_first_file_s=self.pause_s)
        record = {"step": saved.step, "path": str(saved.path), "bytes": saved.total_bytes,
                  "bytes_by_file": saved.bytes_by_file, "seconds": round(saved.seconds, 4)}
        self.saved.append(record)
        print(f"checkpoint step {saved.step}: {saved.total_bytes / 2**20:.2f} MiB "
              f"({', '.join(f'{k} {v / 2**20:.2f}' for k, v in saved.bytes_by_file.items())}) in "
              f"{saved.seconds:.2f} s -> {saved.path}", file=sys.stderr)
        return saved

    def summary(self) -> dict:
        last = self.saved[-1] if self.saved else None
        return {"dir": str(self.root), "saved": len(self.saved), "last": last,
                "save_seconds_total": round(sum(r["seconds"] for r in self.saved), 4)}

    # ---- preemption -----------------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        for sig in PREEMPT_SIGNALS:
            try:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: signals cannot be handled here
                return

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.signal_received == signal.SIGINT:  # a second Ctrl-C: stop now (the last checkpoint stays)
                raise KeyboardInterrupt
            print("\ninterrupted: finishing this step, then writing a checkpoint (Ctrl-C again stops at once)",
                  file=sys.stderr)
        self.signal_received = signum

    def preempt_requested(self) -> bool:
        """Whether a preemption signal arrived (checked between steps)."""
        return self.signal_received is not None

    def stop_preempt_checks(self) -> None:
        """After the last step (``DistCheckpointer``: the outstanding flag all-reduce is waited for)."""

    def preempt(self, state: LoopState) -> None:
        """Called between steps once a signal arrived: checkpoint, ask Slurm to requeue, raise ``Preempted``."""
        name = signal.Signals(self.signal_received).name
        saved = self.save(state)
        if self.signal_received == signal.SIGINT:
            raise Interrupted(f"interrupted (Ctrl-C) after step {state.next_step}; checkpoint {saved.path} "
                              "written; the same command resumes (train.resume=auto)")
        requeued = request_slurm_requeue()
        raise Preempted(f"preempted by {name} after step {state.next_step}; checkpoint {saved.path} written; "
                        f"{requeued}; the same command resumes (train.resume=auto)")


def request_slurm_requeue() -> str:
    """``scontrol requeue <job>`` when running under Slurm; returns what happened, for the log."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "not under Slurm"
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if shutil.which("scontrol") is None:
        return f"Slurm job {job}: scontrol not found, exit code {PREEMPTED_EXIT_CODE} left to RequeueExit"
    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"scontrol requeue {job} failed: {e}"
    if proc.returncode != 0:
        return f"scontrol requeue {job} failed: {proc.stderr.strip()}"
    return f"Slurm job {job} requeued"
