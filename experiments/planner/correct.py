"""Feedback of the planner's verification traces into its cost model (``experiments.planner.plan``, ``verify=true``).

A full-size dry run of a plan that measures more than the integer program predicted corrects the costs the
program is built from, and the program is solved again: the corrected model is the measured one at the traced
choice, so the new optimum may keep, lower or change the choice (another optimizer option at a larger micro-batch
included) instead of backing off by the overshoot.
"""

from __future__ import annotations

import dataclasses

from experiments.planner.costs import GIB
from experiments.planner.milp import Problem, Segment, Solution


class Corrections:
    """What verification traces measured beyond the cost model, fed back into the next solve: forward and backward
    per sequence (their error at b sequences / b: activations grow with b), the probe as static bytes (all choices),
    the optimizer phase as static bytes of the option that was traced (its state); the traced option is capped below
    the missed micro-batch, and the allocator's slack beyond the live peak (``dryrun.reserve=modeled``), erratic in
    b, lowers the budget only once seen twice (by the least seen). Each correction is the measured error itself, so the corrected model
    reproduces the missed trace exactly and the next solve is the optimum of the corrected model (it may keep the
    micro-batch with another option, or raise it) — no backing off by the overshoot."""

    def __init__(self) -> None:
        self.slack = 0.0
        self.slacks: list[float] = []
        self.caps: dict[str, int] = {}
        self.per_seq: dict[str, float] = {}
        self.static: dict[str, float] = {}
        self.option: dict[str, dict[str, float]] = {}

    def learn(self, summary: dict, sol: Solution, verified: int) -> None:
        """``summary``: the verification dry run's; ``verified``: its bytes against the step budget."""
        self.slacks.append((verified - summary["dryrun"]["verdict_peak_bytes"]) / GIB)
        # the allocator's slack is erratic in b (fragmentation): one miss caps the option it was measured with; from
        # the second on, the least slack seen is taken off the budget (optimistic: the smallest ever measured)
        self.slack = min(self.slacks) if len(self.slacks) > 1 else 0.0
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
        return dataclasses.replace(prob, base=base, options=options, batch_caps=caps)

    def record(self) -> dict:
        return {"corrected_slack_gib": self.slack, "batch_caps": dict(self.caps), "corrected_per_seq_gib": dict(self.per_seq),
                "corrected_static_gib": dict(self.static), "corrected_option_gib": dict(self.option)}
