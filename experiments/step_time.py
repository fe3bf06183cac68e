"""A training run that would take this CPU too long per step asks first (``train.confirm``).

Time model (the planner's, ``experiments.planner.model``): one optimizer step does ≈ 6 FLOPs per trainable parameter
per token (forward 2, backward 4; Kaplan et al. 2020, eq. 2.1), at the matmul rate F this CPU measures
(``experiments.planner.model.calibrate``, well under a second). Above ``CONFIRM_S`` seconds per step a CPU training run asks
(an interactive terminal: y/N) or, not interactive, is refused in one line unless ``train.confirm=true``. A GPU run
is never asked (its speed is not this machine's).
"""

from __future__ import annotations

import sys

from experiments.config import RunConfig
from experiments.errors import UserError
from experiments.models import TORCH_DTYPES
from experiments.planner.costs import target_layers
from experiments.planner.model import calibrate, weight_stats

CONFIRM_S = 600.0  # seconds per optimizer step
SLOWEST_CPU_FLOPS = 1e9  # FLOP/s any CPU exceeds: a step below CONFIRM_S even at this rate is not measured


def step_flops(run: RunConfig, params: int) -> float:
    t = run.train
    return 6.0 * params * t.batch_size * t.seq_len * t.grad_accum


def trainable_params(run: RunConfig) -> int:
    """Trainable parameters of ``run``'s model at its depth (1- and 2-layer models on fake tensors, linear in L)."""
    stats = weight_stats(run)
    n1, n2 = (sum(n for n, _ in stats[k]["weights"].values()) for k in ("L1", "L2"))
    return n1 + (target_layers(run) - 1) * (n2 - n1)


def upper_params(run: RunConfig) -> int | None:
    """A cheap upper bound for a phase model (Llama, full multi-head attention counted), None for a ``model.path``
    or card model."""
    m = run.model
    if m.hf_dir:
        return None
    h = m.hidden_size
    return m.num_layers * (4 * h * h + 3 * h * m.intermediate_size + 2 * h) + 2 * m.vocab_size * h + h


def check_step_time(run: RunConfig, device_type: str, *, ask=input) -> None:
    """Refuse (or ask about) a CPU training run slower than ``CONFIRM_S`` per step by the time model."""
    if run.mode != "train" or device_type != "cpu" or run.train.confirm:
        return
    bound = upper_params(run)
    if bound is not None and step_flops(run, bound) / SLOWEST_CPU_FLOPS <= CONFIRM_S:
        return
    rate = calibrate("cpu", TORCH_DTYPES[run.model.dtype], codecs=())["flops_per_s"]
    seconds = step_flops(run, trainable_params(run)) / rate
    if seconds <= CONFIRM_S:
        return
    what = (f"one optimizer step of this run takes about {seconds:,.0f} s on this CPU (time model: 6 FLOPs per "
            f"parameter per token at {rate / 1e9:.0f} GFLOP/s measured)")
    if sys.stdin is not None and sys.stdin.isatty():
        if ask(f"{what}; train anyway? [y/N] ").strip().lower() in ("y", "yes"):
            return
        raise UserError(f"not confirmed: {what}")
    raise UserError(f"{what}; train.confirm=true trains anyway (not asked: the input is not a terminal), or use "
                    "mode=dryrun to only trace the step")
