"""The planner's verification loop's pieces (``verify=true``, ``experiments.planner.plan``): the next choice of the
corrected cost model, each written plan's iteration record and its full-size trace, and the answer it settles on.

The loop finds the largest micro-batch that fits by tracing, after a miss by the caching allocator's slack, the
leanest choice at each candidate micro-batch (``experiments.planner.correct``). The objective ranks the expected
loss cost before a larger micro-batch (docs/planner.md), so a verified micro-batch reached by the leanest choice is
not the answer yet: the corrected model's least-loss choice at that micro-batch is traced and taken when it fits
too; a candidate over the budget asks the next to be predicted leaner by its overshoot (``settle``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from experiments.planner.correct import Corrections, same_choice
from experiments.planner.costs import GIB
from experiments.planner.efficiency import Throughput
from experiments.planner.extend import extend
from experiments.planner.milp import solve
from experiments.planner.model import build_problem
from experiments.planner.objective import failed_learning, without
from experiments.planner.prepare import Prepared

SETTLE_TRIES = 3  # traces the settling step may spend (a full-size dry run each: 1.5-2 min at 8B)
SETTLE_STEP_GIB = 0.01  # after a candidate's miss, the next is predicted at least this much leaner


@dataclass
class Verifier:
    """Writes a choice as the plan (``write(sol)`` -> its predicted peak GiB) and traces the written plan at full
    size (``trace(step)`` -> (summary, step bytes)); keeps the iterations' records and the last choice written."""

    write: Callable
    trace: Callable
    step_budget: float  # GiB the step may take
    iterations: list[dict] = field(default_factory=list)
    last: object = None

    def written(self, sol, live_budget: float, fix: Corrections) -> dict:
        """``sol`` written as the plan; its iteration's record (appended)."""
        predicted = self.write(sol)
        self.last = sol
        step = {"batch_size": sol.batch, "option": sol.option.name, "predicted_gib": sol.predicted,
                "predicted_peak_gib": predicted, "live_budget_gib": live_budget,
                "slack_allowance": self.step_budget / live_budget - 1, **fix.record()}
        self.iterations.append(step)
        return step


def corrected_problem(prep: Prepared, planner: dict, fix: Corrections, live_budget: float, scale: float,
                      model: Throughput | None):
    """The integer program with the verification's corrections, a fixed ``batch_size`` and the settings not
    offered left out."""
    prob = fix.apply(build_problem(prep.costs, space=prep.space, record=prep.record, stats=prep.stats,
                                   flops=prep.flops, cal=prep.cal, budget_gib=live_budget, llama=prep.llama,
                                   seq_scale=scale, throughput=model, streaming=prep.streaming))
    if planner.get("batch_size"):  # a fixed micro-batch: the budget goes to energy, then time
        prob = dataclasses.replace(prob, fixed_batch=int(planner["batch_size"]))
    return without(prob, planner["_not_offered"])


def next_choice(prep: Prepared, planner: dict, fix: Corrections, live_budget: float, scale: float, log,
                model: Throughput | None = None):
    """(the corrected problem, its next choice) with the predicted live peak at most ``live_budget`` GiB, solved
    again after tracing the costs the choice's micro-batch needs past the traced ones
    (``experiments.planner.extend``) until it needs none; a setting the learning check failed is not offered."""
    while True:
        prob = corrected_problem(prep, planner, fix, live_budget, scale, model)
        sol = fix.choose(prob)
        while sol is not None and failed_learning(prep.run, planner, planner["_budget"], sol.option.payload):
            log(f"learning check: {sol.option.name} failed at this model and budget; not offered")
            planner["_not_offered"].append(sol.option.name)
            prob = without(prob, [sol.option.name])
            sol = fix.choose(prob)
        if sol is None or prep.table is None or not extend(prep, sol, seq_scale=scale, log=log):
            return prob, sol


def settle(prep: Prepared, planner: dict, fix: Corrections, best: tuple, v: Verifier, *, live_budget: float,
           scale: float, model: Throughput | None, log, tries: int = SETTLE_TRIES) -> tuple:
    """The answer, ``(solution, summary)``: ``best`` (the largest verified fit), or at its micro-batch the corrected
    model's least-loss choice when its trace fits too. A candidate over the budget (by the allocator's slack, which
    the model does not predict) asks the next one to be predicted leaner by its overshoot; at most ``tries``
    traces. The plan file is left holding the answer."""
    sol, summary = best
    prob = dataclasses.replace(corrected_problem(prep, planner, fix, live_budget, scale, model),
                               fixed_batch=sol.batch)
    for _ in range(tries):
        better = solve(prob)
        if better is None or same_choice(better, sol) or better.loss >= sol.loss - 1e-12 \
                or failed_learning(prep.run, planner, planner["_budget"], better.option.payload):
            break
        log(f"verify: {sol.batch} sequences fit; the least-loss option there next ({better.option.name})")
        found, verified = v.trace(v.written(better, live_budget, fix))
        if verified <= v.step_budget * GIB:
            return better, found
        peak = max(x for x in better.predicted.values() if x is not None)  # the next: leaner by the overshoot
        prob = dataclasses.replace(prob, budget=peak - max(SETTLE_STEP_GIB, verified / GIB - v.step_budget))
    if v.last is not sol:
        v.write(sol)
        v.last = sol
    return sol, summary
