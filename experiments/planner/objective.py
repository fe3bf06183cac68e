"""The planner's objective beyond bytes: the micro-batch efficiency model a plan is solved with, the expected loss
cost written in its record, and the settings the learning check failed, which are not offered
(``experiments.planner.efficiency``, ``experiments.planner.prices``, ``experiments.planner.learning``)."""

from __future__ import annotations

import dataclasses

from experiments.errors import UserError
from experiments.planner.efficiency import DEFAULT_RIDGE, DEFAULT_SLACK, Throughput
from experiments.planner.learning import learning_check
from experiments.planner.problem import Problem, Solution
from experiments.planner.prices import priced_choices
from experiments.planner.recipe import written_rates
from experiments.planner.report import model_label
from experiments.planner.space import Space


def throughput_model(cal: dict, planner: dict, seq_len: int) -> Throughput:
    """The micro-batch efficiency model: the ridge point F/BW measured when the calibration ``cal`` ran on a GPU
    (unless ``ridge_flop_per_byte`` is given), else ``ridge_flop_per_byte`` (default: an H100's);
    ``efficiency_slack``."""
    measured = cal.get("device", "cpu") != "cpu" and "ridge_flop_per_byte" not in planner
    ridge = cal["flops_per_s"] / cal["bytes_per_s"] if measured else \
        float(planner.get("ridge_flop_per_byte", DEFAULT_RIDGE))
    try:
        return Throughput(seq_len=seq_len, ridge=ridge, slack=float(planner.get("efficiency_slack", DEFAULT_SLACK)))
    except ValueError as err:
        raise UserError(str(err)) from None


def loss_cost(prob: Problem, sol: Solution, space: Space) -> dict:
    """The expected loss cost of the plan's lossy choices, each beside the GiB it saves."""
    rows = priced_choices(prob, sol, space.state_budgets[0])
    return {"expected_nats": sum(r["cost_nats"] for r in rows), "choices": rows,
            "source": "results/loss_prices/loss_prices.json (python -m analysis.loss_prices)"}


def failed_learning(run, planner: dict, budget: float, choice) -> bool:
    """Whether ``choice``, at the rate the plan would write, failed the learning check at this model and budget."""
    rates = written_rates(run, choice, planner.get("_overrides", ()))
    return learning_check(model_label(run), budget, choice.label(), rates).get("passes") is False


def without(prob: Problem, names: list[str]) -> Problem:
    """``prob`` with the options named never chosen (a batch cap of 0 sequences: the option indices stay)."""
    caps = tuple((i, 0) for i, o in enumerate(prob.options) if o.name in names)
    return dataclasses.replace(prob, batch_caps=(*prob.batch_caps, *caps)) if caps else prob
