"""Feedback of the planner's verification traces into its cost model (``experiments.planner.plan``, ``verify=true``).

A full-size dry run of a plan that measures more than the integer program predicted corrects the costs the
program is built from, and the program is solved again: the corrected model is the measured one at the traced
choice, so the new optimum may keep, lower or change the choice (another optimizer option at a larger micro-batch
included) instead of backing off by the overshoot.
"""

from __future__ import annotations

import dataclasses
import math

from experiments.planner.costs import GIB
from experiments.planner.milp import leanest, solve
from experiments.planner.problem import Problem, Segment, Solution


class Corrections:
    """What verification traces measured beyond the cost model, fed back into the next solve: forward and backward
    per sequence (their error at b sequences / b: activations grow with b), the probe as static bytes (all choices),
    the optimizer phase as static bytes of the option that was traced (its state); an option whose live peak missed
    is capped below the missed micro-batch. Each correction is the measured error itself, so the corrected model
    reproduces the missed trace's live bytes exactly and the next solve is the optimum of the corrected model (it may
    keep the micro-batch with another option, or raise it) — no backing off by the overshoot.

    The caching allocator's slack beyond the live peak (``dryrun.reserve=modeled``) is not a cost of any choice: it
    comes from fragmentation, differs between choices and between micro-batches without order (docs/planner.md), so
    a slack measured on one choice says nothing about another. A trace whose live peak fits but whose reserved bytes
    do not is answered as the capacity procedure (``experiments.planner.capacity``) answers it: the leanest choice
    (least predicted peak) at that micro-batch is traced next (unless the choice that missed is it); while the
    leanest choice misses, the micro-batch is searched between the largest verified fit and the smallest miss (the
    next guess: the measured excess over the leanest choice's predicted bytes per sequence, then bisection) — the
    plan is the largest micro-batch whose leanest choice fits with one sequence more verified over."""

    def __init__(self) -> None:
        self.caps: dict[str, int] = {}
        self.per_seq: dict[str, float] = {}
        self.static: dict[str, float] = {}
        self.option: dict[str, dict[str, float]] = {}
        self.lean_batch: int | None = None  # after a miss by the allocator's slack: the leanest choice at this b
        self.fit = 0  # the largest b whose leanest choice was verified to fit
        self.over: int | None = None  # the smallest b whose leanest choice was verified over (slack)
        self.traced_leanest = False  # the last choice was the leanest at its micro-batch
        self.pending: tuple[Solution, float] | None = None  # a slack miss (solution, GiB over) not yet the leanest's

    def fitted(self, sol: Solution) -> bool:
        """A verified fit: whether it is the answer (else ``lean_batch`` is the next micro-batch to trace)."""
        if not self.traced_leanest:
            return True
        self.fit = max(self.fit, sol.batch)
        if self.over is None or self.over <= self.fit + 1:
            return True
        self.lean_batch = (self.fit + self.over) // 2
        return False

    def learn(self, summary: dict, sol: Solution, verified: int, budget: float) -> None:
        """``summary``: the verification dry run's; ``verified``: its bytes against the step budget (``budget``
        GiB)."""
        live = summary["dryrun"]["verdict_peak_bytes"] / GIB
        if live <= budget:  # only the allocator's slack is over
            miss = (sol, verified / GIB - budget)
            if self.traced_leanest:
                self._leanest_missed(*miss)
            else:  # the leanest choice at this b next (unless it is the one just traced: ``choose``)
                self.lean_batch, self.pending = sol.batch, miss
        else:
            self.lean_batch = None
            self.caps[sol.option.name] = min(self.caps.get(sol.option.name, sol.batch), sol.batch - 1)
        measured = {**{p: b / GIB for p, b in summary["memory"]["peak_by_phase_bytes"].items()},
                    "probe": ((summary.get("activation_summary") or {}).get("probe_peak_bytes") or 0) / GIB}
        for p, gib in measured.items():
            err = gib - (sol.predicted.get(p) or 0.0)
            if err <= 0:
                continue
            err += 1e-6  # GiB: the corrected model must not predict the missed trace a rounding error below it
            if p in ("forward", "backward"):
                self.per_seq[p] = self.per_seq.get(p, 0.0) + err / sol.batch
            elif p == "optimizer":
                opt = self.option.setdefault(sol.option.name, {})
                opt[p] = opt.get(p, 0.0) + err
            else:
                self.static[p] = self.static.get(p, 0.0) + err

    def _leanest_missed(self, sol: Solution, excess: float) -> None:
        """The leanest choice at ``sol.batch`` is ``excess`` GiB over: fewer sequences by its bytes per sequence."""
        self.over = sol.batch if self.over is None else min(self.over, sol.batch)
        per_seq = max(v for v in sol.predicted.values() if v is not None) / sol.batch  # ≥ its slope
        guess = sol.batch - math.ceil(excess / max(per_seq, 1e-9))
        self.lean_batch = min(self.over - 1, max(self.fit + 1, guess))

    def learn_peak(self, measured_gib: float, predicted_gib: float, phases: tuple[str, ...]) -> float:
        """A training attempt that ran out of memory (``train.on_oom=replan``, ``experiments.planner.oom``): only its
        overall peak is known, and it is a lower bound (the attempt stopped there), so the error of the predicted
        peak, where positive, is added to every phase as static bytes: the corrected model predicts at least the
        measured peak for the failed choice, and any other choice moves by the same bytes. Returns the error."""
        err = max(0.0, measured_gib - predicted_gib)
        if err > 0:
            err += 1e-6  # GiB: as in ``learn``
            for p in phases:
                self.static[p] = self.static.get(p, 0.0) + err
        return err

    def apply(self, prob: Problem) -> Problem:
        base = tuple(Segment(s.start, {p: v + self.static.get(p, 0.0) for p, v in s.static.items()},
                             {p: v + self.per_seq.get(p, 0.0) for p, v in s.per_seq.items()}) for s in prob.base)
        options = [dataclasses.replace(o, static={p: v + self.option.get(o.name, {}).get(p, 0.0)
                                                  for p, v in o.static.items()}) for o in prob.options]
        caps = tuple((i, max(0, self.caps[o.name])) for i, o in enumerate(prob.options) if o.name in self.caps)
        top = prob.max_batch if self.over is None else max(1, min(prob.max_batch, self.over - 1))
        return dataclasses.replace(prob, base=base, options=options, batch_caps=caps, max_batch=top)

    def choose(self, prob: Problem) -> Solution | None:
        """The next choice to trace: the corrected model's optimum, or after a miss by the allocator's slack the
        leanest choice at ``lean_batch`` (fewer sequences while even that is predicted over the budget; never
        another micro-batch than a fixed one, ``prob.fixed_batch``)."""
        self.traced_leanest = self.lean_batch is not None
        if self.lean_batch is None:
            return solve(prob)
        if self.pending is not None:  # the choice that missed by its slack may already be the leanest at its b
            missed, excess = self.pending
            self.pending = None
            lean = leanest(dataclasses.replace(prob, fixed_batch=missed.batch))
            if lean is not None and same_choice(lean, missed):
                self._leanest_missed(missed, excess)
                prob = dataclasses.replace(prob, max_batch=max(1, min(prob.max_batch, self.over - 1)))
        top = min(self.lean_batch, prob.max_batch, prob.fixed_batch or prob.max_batch)
        bottom = self.fit if prob.fixed_batch is None else max(self.fit, prob.fixed_batch - 1)  # a user's fixed b
        for batch in range(top, bottom, -1):
            sol = leanest(dataclasses.replace(prob, fixed_batch=batch))
            if sol is not None and max(v for v in sol.predicted.values() if v is not None) <= prob.budget:
                return sol
        return None

    def record(self) -> dict:
        return {"lean_batch": self.lean_batch, "lean_fit": self.fit, "lean_over": self.over, "batch_caps": dict(self.caps),
                "corrected_per_seq_gib": dict(self.per_seq), "corrected_static_gib": dict(self.static),
                "corrected_option_gib": dict(self.option)}


def same_choice(a: Solution, b: Solution) -> bool:
    return (a.batch, a.option.name, a.actions, a.layer_recompute, a.layer_codec) == (
        b.batch, b.option.name, b.actions, b.layer_recompute, b.layer_codec)
