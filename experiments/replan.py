"""``train.on_oom=replan``: a run that survives its own out-of-memory error (design: ``docs/gpu_runs.md``).

On ``torch.OutOfMemoryError`` — from the CUDA allocator, or from the memory meter when live device bytes pass
``train.memory_cap_gib`` (``experiments.memory.meter.MemoryMeter.cap_bytes``) — the failed attempt has already written its
metrics and keeps its checkpoints (``experiments.train``); ``train_with_replans`` then asks the memory planner for
the next plan (``experiments.planner.oom.next_plan``: the best plan whose predicted peak, in the planner's cost model
corrected by the failed attempt's measured peak, fits under the failing bytes minus a margin, among the choices the
checkpoint resumes with), says in one line what changed, and runs again from the last checkpoint (the metrics rows of
the steps after it are replaced by the new attempt's, so every step is logged once). After ``train.max_replans``
steps down, or when nothing leaner fits, the run ends in one ``error:`` line.

Where the planner cannot answer (a method other than ``hmt``, settings outside its choice space, costs that take too
long to trace) the one line says so and the fixed ladder ``ladder_plan`` is taken instead, in the order of the
planner's own objective (tokens per micro-batch first, then step time), so time is given up before the micro-batch:

1. full layer recomputation (``activation.layer_recompute=true``, the other decoder-layer components ``keep``);
2. the micro-batch cut to its largest proper divisor with ``train.grad_accum`` (and ``train.eval_batches``) raised
   by the same factor, so each step sees the same sequences and validation the same rows; repeated down to 1.

Neither takes a step that leaves the checkpointed state unloadable: Mode B, 8-bit or bf16 optimizer state and INT8
weights change the optimizer state's or the weights' format, which a checkpoint of the current plan cannot be
loaded into.

``train.on_spike=lower_lr`` is the same driver for a run that diverges (``experiments.step_tally.Diverged``): the
failed attempt keeps its metrics and checkpoints (status ``diverged`` for a moment), then the run goes on from its
last checkpoint (none is written while a divergence streak is under way, so it precedes the streak; step 0 when
there is none) with ``method.lr`` halved, saying so in one line; after ``train.max_lr_drops`` halvings it ends in
one ``error: training diverged:`` line. Each drop is listed in summary.json (``lr_drops``) and the lowered rate is
an override like a step down: recorded in the later checkpoints (meta ``replan``), so the same command resumes at it.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from experiments.config import RunConfig
from experiments.memory.gpu_allowance import outside_allocator_bytes
from experiments.planner import oom
from experiments.step_tally import Diverged
from hmt_core.activations.policy import LAYER_COMPONENTS

GIB = 2**30


class OutOfMemoryGiveUp(RuntimeError):
    """Out of memory after ``train.max_replans`` steps down (or with no leaner plan left); the run failed."""


@dataclass(frozen=True, kw_only=True)
class Rung:
    """One step down the ladder: the overrides it adds (``section.key`` -> value) and what it does, in words."""

    overrides: dict[str, object]
    label: str
    record: dict = field(default_factory=dict)  # the planner's numbers, or why the ladder was taken

    def text(self) -> str:
        return " ".join(f"{k}={_show(v)}" for k, v in self.overrides.items()) + f" ({self.label})"


def _show(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def ladder_plan(run: RunConfig) -> Rung | None:
    """The next rung of the fixed ladder for ``run`` (see the module docstring), or None when none is left."""
    policy = run.activation
    if not policy.layer_recompute:
        changes = {f"activation.{c}": "keep" for c in LAYER_COMPONENTS if getattr(policy, c) != "keep"}
        return Rung(overrides={"activation.layer_recompute": True, **changes},
                    label="more recomputation: each decoder layer recomputed from its input")
    t = run.train
    if t.batch_size > 1:
        smaller = max(d for d in range(1, t.batch_size) if t.batch_size % d == 0)
        factor = t.batch_size // smaller
        return Rung(overrides={"train.batch_size": smaller, "train.grad_accum": t.grad_accum * factor,
                               "train.eval_batches": t.eval_batches * factor},
                    label=f"micro-batch {t.batch_size} -> {smaller}, {factor}x the micro-batches per step: "
                          f"{t.batch_size * t.grad_accum} sequences per step as before")
    return None


def next_plan(run: RunConfig, *, peak_bytes: int | None, limit_bytes: int | None, device_type: str,
              plan_s: float = oom.PLAN_S) -> tuple[Rung | None, str]:
    """The planner's next plan for ``run`` (the configuration in force), else the ladder's rung where the planner
    cannot answer; ``(None, why)`` when nothing leaner is left."""
    try:
        answer = oom.next_plan(run, peak_bytes=peak_bytes, limit_bytes=limit_bytes, device_type=device_type,
                               plan_s=plan_s)
    except oom.NoFit as e:
        return None, str(e)
    except oom.Unanswered as e:
        rung = ladder_plan(run)
        if rung is None:
            return None, f"the planner cannot answer ({e}) and no ladder rung is left (layer recomputation on, " \
                         "micro-batch 1)"
        return dataclasses.replace(rung, label=f"ladder, as the planner cannot answer: {e}; {rung.label}",
                                   record={"source": "ladder", "why": str(e)}), ""
    return Rung(overrides=answer.overrides, label=answer.label,
                record={"source": "planner", "budget_bytes": answer.budget_bytes,
                        "predicted_bytes": answer.predicted_bytes, "correction_bytes": answer.correction_bytes,
                        "traced": answer.traced}), ""


def apply_overrides(run: RunConfig, overrides: dict[str, object]) -> RunConfig:
    """``run`` with ``overrides`` (``activation.*``, ``train.*`` and ``method.lr`` keys) applied, validated by the
    configs."""
    sections: dict[str, dict[str, object]] = {}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    unknown = set(sections) - {"activation", "train", "method"}
    if unknown:
        raise ValueError(f"replan overrides: unsupported section(s) {sorted(unknown)}")
    activation = run.activation.replace(**sections["activation"]) if "activation" in sections else run.activation
    return dataclasses.replace(run, activation=activation,
                               method=dataclasses.replace(run.method, **sections.get("method", {})),
                               train=dataclasses.replace(run.train, **sections.get("train", {})))


@dataclass
class Attempt:
    """What one attempt leaves for the next: plain values only, so the failed attempt's tensors can be freed.
    ``experiments.train`` sets ``checkpoint``/``checkpoint_step`` to the attempt's resume point when it starts, and
    to its newest checkpoint with ``peak_bytes`` when it runs out of memory."""

    overrides: dict[str, object] = field(default_factory=dict)  # all steps down so far
    replans: list[dict] = field(default_factory=list)  # one record per step down (summary.json "replans")
    lr_drops: list[dict] = field(default_factory=list)  # one record per halved learning rate ("lr_drops")
    checkpoint: str | None = None  # newest checkpoint of the run when the attempt failed
    checkpoint_step: int | None = None
    peak_bytes: int | None = None  # measured peak of the failed attempt (meter or CUDA allocator)

    def failed(self, *, checkpoint: str | None, checkpoint_step: int | None, peak_bytes: int | None) -> None:
        self.checkpoint, self.checkpoint_step, self.peak_bytes = checkpoint, checkpoint_step, peak_bytes


def resumed_plan(run: RunConfig, recorded: dict[str, object] | None, attempt: Attempt | None
                 ) -> tuple[RunConfig, dict[str, object]]:
    """The plan to resume a checkpoint with: ``run`` with the steps down the checkpoint records (its meta
    ``replan``) on top of this process's own; returns it with all overrides in force (written into the next
    checkpoints). A later process started with the same command so continues on the plan that fitted."""
    own = attempt.overrides if attempt is not None else {}
    merged = {**(recorded or {}), **own}
    new = {k: v for k, v in merged.items() if k not in own}
    if new:
        print("resuming with the checkpoint's replanned settings: " + " ".join(f"{k}={_show(v)}" for k, v in
                                                                              new.items()), file=sys.stderr)
        run = apply_overrides(run, new)
    if attempt is not None:
        attempt.overrides = merged
    return run, merged


def limit_bytes(run: RunConfig, device: torch.device) -> int | None:
    """The device memory an attempt must fit: the meter's cap; else the CUDA device's total memory, or under a
    per-process memory fraction (``torch.cuda.set_per_process_memory_fraction``,
    ``PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:F``) the caching allocator's cap plus the GPU allowance's
    bytes outside the allocator, which the fraction does not cap (the planner takes the whole allowance off)."""
    if run.train.memory_cap_gib is not None:
        return int(run.train.memory_cap_gib * GIB)
    if device.type == "cuda":  # the fraction's getter wants an index: "cuda" alone is the current device
        index = torch.cuda.current_device() if device.index is None else device.index
        return cuda_limit_bytes(run, torch.cuda.get_device_properties(index).total_memory,
                                torch.cuda.get_per_process_memory_fraction(index))
    return None


def cuda_limit_bytes(run: RunConfig, total_bytes: int, fraction: float) -> int:
    """``limit_bytes`` on a CUDA device of ``total_bytes`` whose allocator may take ``fraction`` of them."""
    if fraction >= 1.0:
        return int(total_bytes)
    return min(int(total_bytes), int(total_bytes * fraction) + outside_allocator_bytes(run))


def _release(device: torch.device) -> None:
    """Free what the failed attempt held (its frames are gone once its exception is dropped)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def train_with_replans(run: RunConfig, device: torch.device,
                       attempt_fn: Callable[[RunConfig, Attempt], dict]) -> dict:
    """Run ``attempt_fn`` (one set-up + training from the resume point) until it completes, stepping down on each
    out-of-memory error (``train.on_oom=replan``) and halving the learning rate on each divergence
    (``train.on_spike=lower_lr``); ``attempt_fn`` gets the configuration in force and the ``Attempt`` record."""
    attempt = Attempt()
    current = run
    while True:
        try:
            return attempt_fn(current, attempt)
        except torch.OutOfMemoryError as e:
            if run.train.on_oom != "replan":
                raise
            oom_reason, diverged = (str(e).strip().splitlines() or ["out of memory"])[0], None
        except Diverged as e:
            if run.train.on_spike != "lower_lr":
                raise
            if len(attempt.lr_drops) >= run.train.max_lr_drops:
                e.what += f"; {_drops_taken(run, attempt)}"
                raise
            oom_reason, diverged = None, {"reason": e.what, "step": e.step}  # plain values: the attempt is freed
        _release(device)
        if diverged is not None:
            _lower_lr(run, attempt, diverged)
        else:
            _step_down(run, device, attempt, oom_reason)
        resume = attempt.checkpoint or "auto"
        current = apply_overrides(dataclasses.replace(run, force=False,
                                                      train=dataclasses.replace(run.train, resume=resume)),
                                  attempt.overrides)


def _resume_text(attempt: Attempt) -> str:
    return (f"step {attempt.checkpoint_step} from {attempt.checkpoint}" if attempt.checkpoint
            else "step 0 (no checkpoint yet; train.checkpoint_every=N keeps more)")


def _step_down(run: RunConfig, device: torch.device, attempt: Attempt, reason: str) -> None:
    """Add the next plan's overrides to ``attempt`` after an out-of-memory error, or raise ``OutOfMemoryGiveUp``."""
    peak, limit = attempt.peak_bytes, limit_bytes(run, device)
    measured = (f"peak {oom.show_bytes(peak)}" if peak is not None else "peak unknown") + \
               (f" > {oom.show_bytes(limit)}" if limit is not None else "")
    in_force = apply_overrides(run, attempt.overrides)  # with the steps down a resumed checkpoint recorded
    rung, why = (next_plan(in_force, peak_bytes=peak, limit_bytes=limit, device_type=device.type)
                 if len(attempt.replans) < run.train.max_replans
                 else (None, f"train.max_replans={run.train.max_replans} steps down taken"))
    if rung is None:
        raise OutOfMemoryGiveUp(f"out of memory ({reason}; {measured}) and {why}; checkpoints kept, the "
                                f"newest: {attempt.checkpoint or 'none'}")
    attempt.overrides = {**attempt.overrides, **rung.overrides}
    attempt.replans.append({"reason": reason, "peak_bytes": peak, "limit_bytes": limit,
                            "overrides": dict(rung.overrides), "label": rung.label, **rung.record,
                            "resumed_step": attempt.checkpoint_step or 0})
    print(f"out of memory ({measured}): replan {len(attempt.replans)}/{run.train.max_replans}: {rung.text()}; "
          f"resuming at {_resume_text(attempt)}", file=sys.stderr)


def _lower_lr(run: RunConfig, attempt: Attempt, diverged: dict) -> None:
    """Halve ``method.lr`` in ``attempt``'s overrides after a divergence, record it and say so in one line."""
    lr = apply_overrides(run, attempt.overrides).method.lr  # with a lowered rate a resumed checkpoint recorded
    attempt.overrides = {**attempt.overrides, "method.lr": lr / 2}
    attempt.lr_drops.append({**diverged, "lr": lr, "new_lr": lr / 2, "resumed_step": attempt.checkpoint_step or 0})
    print(f"training diverged ({diverged['reason']}): lr drop {len(attempt.lr_drops)}/{run.train.max_lr_drops}: "
          f"method.lr={lr / 2:g} (half of {lr:g}); resuming at {_resume_text(attempt)}", file=sys.stderr)


def _drops_taken(run: RunConfig, attempt: Attempt) -> str:
    first = attempt.lr_drops[0]["lr"] if attempt.lr_drops else apply_overrides(run, attempt.overrides).method.lr
    rates = [first] + [d["new_lr"] for d in attempt.lr_drops]
    return (f"train.max_lr_drops={run.train.max_lr_drops} halvings taken (method.lr "
            + " -> ".join(f"{r:g}" for r in rates) + ")")


def divergence_advice(run: RunConfig) -> str:
    """What to change after a divergence, for the error line: half the learning rate in force (and the method's
    default where the rate is far above it), a longer warm-up where there is room, ``train.on_spike=lower_lr``."""
    lr, t = run.method.lr, run.train
    default = next((f.default for f in dataclasses.fields(run.method) if f.name == "lr"), None)
    far = isinstance(default, float) and lr > 10 * default
    hint = f"; the default for method={run.method.name} is {default:g}" if far else ""
    warmup = max(2 * t.warmup_steps, 10)
    longer = f", or a longer warm-up: train.warmup_steps={warmup}" if warmup < t.steps else ""
    auto = "" if t.on_spike == "lower_lr" else " (train.on_spike=lower_lr halves it and resumes by itself)"
    return f"lower the learning rate: method.lr={lr / 2:g} (half of {lr:g}{hint}){longer}{auto}"


def restore_at_lr(checkpointer, method, point, device: torch.device):
    """``checkpointer.restore(point)`` (None without a point) keeping the base learning rates ``method`` was built
    with: a torch optimizer's checkpointed groups carry the rates in force when it was written, which a lowered
    ``method.lr`` replaces (a method without a torch optimizer takes its rate from its configuration)."""
    if point is None:
        return None

    def groups() -> list[dict]:
        optimizer = method.torch_optimizer()
        return optimizer.param_groups if optimizer is not None else []

    bases = [group.get("initial_lr") for group in groups()]
    state = checkpointer.restore(point, device)
    for group, base in zip(groups(), bases, strict=True):  # loading a state dict makes new group dicts
        if base is not None:
            group["initial_lr"] = base
    return state
