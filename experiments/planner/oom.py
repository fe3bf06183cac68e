"""The planner's next plan for a training run that ran out of memory (``train.on_oom=replan``, ``experiments.replan``).

The memory planner's integer program (``experiments.planner.milp``, costs from ``experiments.planner.costs``) is
solved again for the failed run with

- the budget: the failed attempt's limit (``train.memory_cap_gib``, or the CUDA device's memory less the GPU
  allowance ``experiments.memory.gpu_allowance.reserve_bytes``), lowered to its measured peak where that is less,
  minus ``MARGIN``;
- the cost model corrected by what was measured (``Corrections.learn_peak``, as ``experiments.planner.correct`` does
  for a verification trace that missed): the failed choice's predicted peak is raised to its measured peak;
- the choices restricted to those the run's checkpoint resumes with (``resumable_space``): the optimizer setting as
  it is (the checkpoint's state must load: mode, state budget and dtype, projected LM head, 8-bit dense state and
  INT8 weights fixed), micro-batches that divide the current one (``train.grad_accum`` raised by the same factor:
  the same sequences per optimizer step), full layer recomputation on or off, and per component the actions ``keep``
  and those the policy already uses (no new lossy codec: the loss curve continues as it would have).

``Unanswered`` says why the planner gave no answer (another method than ``hmt``, a method setting outside its choice
space, or costs that take longer than ``PLAN_S`` to trace); ``experiments.replan`` then steps down its fixed ladder.
``NoFit`` means the planner answered that nothing fits. Design and measurements: ``docs/gpu_runs.md``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from experiments import methods
from experiments.config import RunConfig
from experiments.memory.gpu_allowance import reserve_bytes
from experiments.planner.cache import Table
from experiments.planner.correct import Corrections
from experiments.planner.costs import GIB, PHASES, OptChoice, Space, Vocab
from experiments.planner.milp import solve
from experiments.planner.problem import Problem, Solution, predict
from experiments.planner.model import build_problem
from experiments.planner.prepare import SPACE_KEYS, prepare
from hmt_core.activations.policy import COMPONENTS, LAYER_COMPONENTS

MARGIN = 0.05  # the new plan's predicted peak stays 5% below the failing bytes (the model is corrected, not exact)
PLAN_S = 300.0  # seconds the planner may spend tracing missing costs before the ladder is taken instead


class Unanswered(Exception):
    """The planner cannot answer for this run (the reason, in words)."""


class NoFit(Exception):
    """The planner answered: no resumable plan fits the budget (the reason, in words)."""


class PlanTimeout(Exception):
    """Tracing the missing costs took longer than allowed."""


@dataclass(frozen=True, kw_only=True)
class Answer:
    """The planner's next plan: the overrides (``section.key`` -> value), what changed in words, and its numbers."""

    overrides: dict[str, object]
    label: str
    budget_bytes: int  # what the plan's predicted peak had to fit
    predicted_bytes: int  # the new plan's peak, predicted by the corrected model
    correction_bytes: int  # added to every phase: the failed plan's measured peak beyond its prediction
    traced: int  # cost samples traced now (the rest came from the cost tables)


def current_choice(run: RunConfig) -> OptChoice:
    """The run's optimizer setting as one of the planner's options, or ``Unanswered`` when it is not one."""
    m = run.method
    if not methods.planned(m):
        raise Unanswered(f"the planner plans method=hmt only (method={m.name})")
    head = "lm_head" in m.target_patterns
    try:
        budget = 0.0 if m.mode == "B" else float(m.state_budget)
    except (TypeError, ValueError):
        raise Unanswered(f"method.state_budget={m.state_budget} is not one of the planner's fractions of AdamW's "
                         "state") from None
    choice = OptChoice(m.mode, m.state_dtype, budget, head, m.dense_8bit, m.weight_dtype,
                       Vocab(m.embedding_dtype, m.embedding_update, m.head_update), m.weight_offload)
    if dataclasses.replace(m, **choice.method_changes(m)) != m:
        raise Unanswered(f"the method's settings are not one of the planner's options ({choice.label()} differs "
                         "from them in rank, scaling or target patterns)")
    return choice


def current_actions(run: RunConfig) -> dict[str, str]:
    """The action of each activation component (inside the layers ``keep`` under full layer recomputation)."""
    p = run.activation
    return {c: "keep" if p.layer_recompute and c in LAYER_COMPONENTS else getattr(p, c) for c in COMPONENTS}


def layer_codec(run: RunConfig) -> str:
    """How the run's full layer recomputation stores the layer inputs (``keep`` without it)."""
    return run.activation.residual if run.activation.layer_recompute else "keep"


def resumable_space(run: RunConfig, choice: OptChoice) -> Space:
    """The choices that keep the run resumable from its checkpoint (see the module docstring)."""
    in_use = tuple(sorted({a for a in current_actions(run).values() if a != "keep"}))
    codec = layer_codec(run)
    v = choice.vocab
    try:
        return Space(modes=(choice.mode,), state_budgets=(choice.budget if choice.mode == "A" else 1 / 64,),
                     state_dtypes=(choice.dtype,), weight_dtypes=(choice.weights,), dense_8bit=(choice.dense_8bit,),
                     project_head=(choice.head,), actions=("keep", *in_use), layer_recompute=(False, True),
                     embedding_dtypes=(v.embedding_dtype,), embedding_updates=(v.embedding_update,),
                     head_updates=(v.head_update,), layer_inputs=tuple(dict.fromkeys(("keep", codec))),
                     weight_offloads=(choice.offload,), max_batch_size=run.train.batch_size, mode_b_head=True)
    except ValueError as e:
        raise Unanswered(f"the activation policy is outside the planner's choices ({e})") from None


def timed_table(deadline: float) -> type[Table]:
    """A cost table that raises ``PlanTimeout`` once ``deadline`` (``time.perf_counter``) has passed."""

    class Timed(Table):
        def get(self, key: str) -> dict | None:
            if time.perf_counter() > deadline:
                raise PlanTimeout
            return super().get(key)

    return Timed


def step_budget_bytes(run: RunConfig, *, peak_bytes: int | None, limit_bytes: int | None, device_type: str) -> int:
    """The bytes the next plan's step must fit: the limit (less the GPU allowance on CUDA) or the measured peak,
    the smaller, minus ``MARGIN``."""
    limit = None if limit_bytes is None else limit_bytes - (reserve_bytes(run) if device_type == "cuda" else 0)
    known = [b for b in (limit, peak_bytes) if b is not None]
    if not known:
        raise Unanswered("neither a limit nor a measured peak is known")
    return int(min(known) * (1 - MARGIN))


def show_bytes(nbytes: float) -> str:
    """Bytes in GiB, or in MiB below one GiB (a tiny model's plans differ in the third MiB decimal)."""
    return f"{nbytes / GIB:.3f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.3f} MiB"


def _peak(sol_or_predicted: dict[str, float | None]) -> float:
    return max(v for v in sol_or_predicted.values() if v is not None)


def _solve_dividing(prob: Problem, batch: int) -> Solution | None:
    """The optimum whose micro-batch divides ``batch`` (the largest divisor at or below the free optimum's)."""
    sol = solve(prob)
    if sol is None or batch % sol.batch == 0:
        return sol
    for b in sorted((d for d in range(1, sol.batch) if batch % d == 0), reverse=True):
        fixed = solve(dataclasses.replace(prob, fixed_batch=b))
        if fixed is not None:
            return fixed
    return None


def next_plan(run: RunConfig, *, peak_bytes: int | None, limit_bytes: int | None, device_type: str,
              plan_s: float = PLAN_S) -> Answer:
    """The planner's best resumable plan under the failed attempt's bytes (``Unanswered``, ``NoFit``)."""
    choice = current_choice(run)
    space = resumable_space(run, choice)
    budget = step_budget_bytes(run, peak_bytes=peak_bytes, limit_bytes=limit_bytes, device_type=device_type)
    planner = {k: getattr(space, k) for k in SPACE_KEYS}
    planner["workers"] = 1  # in the training process, bounded by the deadline its table checks before each trace
    try:
        prep = prepare(run, planner, log=lambda _: None, table_type=timed_table(time.perf_counter() + plan_s))
    except PlanTimeout:
        raise Unanswered(f"its cost table lacks this model and tracing the costs took over {plan_s:g} s") from None
    prob = build_problem(prep.costs, space=space, record=prep.record, stats=prep.stats, flops=prep.flops,
                         cal=prep.cal, budget_gib=budget / GIB, llama=prep.llama, streaming=prep.streaming)
    (option,) = prob.options
    t = run.train
    actions = {c: a for c, a in current_actions(run).items() if c in prob.actions}
    lr = run.activation.layer_recompute and prob.layer_recompute is not None
    before = _peak(predict(prob, t.batch_size, option, actions, lr, layer_codec(run)))
    fix = Corrections()
    err = fix.learn_peak((peak_bytes or 0) / GIB, before, PHASES)
    if run.method.head_update == "in_loss":  # no gradient accumulation with it: the micro-batch stays
        prob = dataclasses.replace(prob, fixed_batch=t.batch_size)
    sol = _solve_dividing(fix.apply(prob), t.batch_size)
    if sol is None:
        raise NoFit(f"the planner has no resumable plan under {show_bytes(budget)} (its model corrected by "
                    f"+{show_bytes(err * GIB)} from the measured peak)")
    overrides = _overrides(run, sol, lr)
    label = (f"planner: {_describe(run, sol, lr)}; predicted peak {show_bytes(_peak(sol.predicted) * GIB)}"
             f" <= {show_bytes(budget)} (the model +{show_bytes(err * GIB)} from the measured peak)")
    return Answer(overrides=overrides, label=label, budget_bytes=budget,
                  predicted_bytes=math.ceil(_peak(sol.predicted) * GIB), correction_bytes=round(err * GIB),
                  traced=int(prep.record["traces"]))


def _overrides(run: RunConfig, sol: Solution, lr: bool) -> dict[str, object]:
    out: dict[str, object] = {}
    if sol.layer_recompute != lr:
        out["activation.layer_recompute"] = sol.layer_recompute
    now = sol.policy_actions()  # the layer inputs' codec under layer recomputation is residual's action
    out.update({f"activation.{c}": a for c, a in now.items() if a != getattr(run.activation, c)})
    t = run.train
    if sol.batch != t.batch_size:
        factor = t.batch_size // sol.batch
        out.update({"train.batch_size": sol.batch, "train.grad_accum": t.grad_accum * factor,
                    "train.eval_batches": t.eval_batches * factor})
    return out


def _describe(run: RunConfig, sol: Solution, lr: bool) -> str:
    t, parts = run.train, []
    if sol.layer_recompute != lr:
        parts.append("each decoder layer recomputed from its input" if sol.layer_recompute
                     else "layer recomputation off")
    parts += [f"{c} {getattr(run.activation, c)} -> {a}" for c, a in sol.policy_actions().items()
              if a != getattr(run.activation, c)]
    if sol.batch != t.batch_size:
        factor = t.batch_size // sol.batch
        parts.append(f"micro-batch {t.batch_size} -> {sol.batch}, {factor}x the micro-batches per step: "
                     f"{t.batch_size * t.grad_accum} sequences per step as before")
    return ", ".join(parts)
