"""What the planner's lossy choices are expected to cost in loss: each priced by the tuned campaign's rows
(``results/loss_prices/loss_prices.json``, written by ``python -m analysis.loss_prices``: the paired validation-loss
difference, tiny Llama at 300 steps, seeds 1-3, between the row that makes the choice and the row it changes).

A choice's price is its measured mean difference floored at 0: a saving never counts as lowering the loss (none of
the savings measured lower differed at p < 0.05). A choice no campaign row isolates (FP8 or outlier codecs, a
projected LM head, Mode B on the head) is listed as not priced and counts 0; Mode A's state budgets are ordered by
the retained-energy bound instead (``experiments.planner.model``). The prices are measured on a 5 M-parameter model:
they order the choices, they do not predict a large model's loss (docs/planner.md, "Plans that learn").
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from experiments.planner.problem import Problem, Solution, predict
from experiments.planner.space import OptChoice

PRICES_FILE = Path(__file__).resolve().parents[2] / "results" / "loss_prices" / "loss_prices.json"


@dataclass(frozen=True, kw_only=True)
class Priced:
    """One lossy choice's price: ``nats`` the campaign's mean difference (None: not priced), ``differs`` its
    paired test's verdict."""

    name: str
    nats: float | None
    differs: bool | None = None

    @property
    def cost(self) -> float:
        return max(0.0, self.nats) if self.nats is not None else 0.0


@functools.cache
def _table(path: Path = PRICES_FILE) -> dict[str, dict]:
    return json.loads(path.read_text())["prices"] if path.is_file() else {}


def priced(name: str) -> Priced:
    row = _table().get(name, {})
    return Priced(name=name, nats=row.get("delta_nats"), differs=row.get("differs"))


def option_prices(choice: OptChoice) -> list[Priced]:
    """The lossy parts of an optimizer setting, each with its price."""
    names = (["mode_b"] if choice.mode == "B" else []) \
        + ([f"head_projected:{choice.mode}"] if choice.head else []) \
        + (["bf16_state"] if choice.dtype == "bf16" else []) + (["dense_8bit"] if choice.dense_8bit else []) \
        + (["int8_weights"] if choice.weights == "int8" else []) \
        + (["int8_tables"] if choice.vocab.embedding_dtype == "int8" else []) \
        + ([choice.vocab.embedding_update] if choice.vocab.embedding_update != "dense" else []) \
        + (["in_loss"] if choice.vocab.head_update == "in_loss" else [])
    return [priced(n) for n in names]


def action_price(action: str) -> Priced:
    """An activation codec's price (recompute and keep are lossless: not called for them)."""
    return priced(f"act:{action}")


def layer_codec_price(codec: str) -> Priced:
    """The price of storing full layer recomputation's layer inputs with ``codec``."""
    return priced(f"layer_inputs:{codec}")


def total(items: list[Priced]) -> float:
    return sum(p.cost for p in items)


def describe(rows: list[dict]) -> str:
    """The plan table's words for ``priced_choices``' rows: each choice's price (n.s.: its campaign row did not
    differ at p < 0.05) beside the GiB it saves."""
    if not rows:
        return "0 nats: every choice is lossless"
    total_nats = sum(r["cost_nats"] for r in rows)
    parts = [f"{r['name']} " + ("not priced" if r["nats"] is None else f"{r['nats']:+.3f}"
                                + ("" if r["differs"] else " n.s."))
             + ("" if r["saves_gib"] is None else f" for {r['saves_gib']:.2f} GiB") for r in rows]
    return f"{total_nats:.3f} nats expected (tiny's tuned campaign rows): " + "; ".join(parts)


# the lossless setting each priced part of an optimizer setting replaces (Mode B: Mode A at its leanest budget)
_LOSSLESS = {"mode_b": lambda c, lean: dataclasses.replace(c, mode="A", budget=lean),
             "bf16_state": lambda c, _: dataclasses.replace(c, dtype="fp32"),
             "dense_8bit": lambda c, _: dataclasses.replace(c, dense_8bit=False),
             "int8_weights": lambda c, _: dataclasses.replace(c, weights="bf16"),
             "int8_tables": lambda c, _: dataclasses.replace(c, vocab=dataclasses.replace(c.vocab,
                                                                                           embedding_dtype="bf16")),
             "in_loss": lambda c, _: dataclasses.replace(c, vocab=dataclasses.replace(c.vocab, head_update="dense"))}


def _lossless(choice: OptChoice, name: str, lean: float) -> OptChoice:
    if name.startswith("head_projected"):
        return dataclasses.replace(choice, head=False)
    if name in ("lazy_exact", "sparse_adam"):
        return dataclasses.replace(choice, vocab=dataclasses.replace(choice.vocab, embedding_update="dense"))
    return _LOSSLESS[name](choice, lean)


def priced_choices(prob: Problem, sol: Solution, lean_budget: float) -> list[dict]:
    """Each lossy choice of ``sol`` with its price and the GiB it saves: the predicted peak at the same micro-batch
    with that one choice made lossless (None where the lossless setting is not among ``prob``'s options)."""
    def peak(option, actions, codec) -> float:
        out = predict(prob, sol.batch, option, actions, sol.layer_recompute, codec)
        return max(v for v in out.values() if v is not None)

    mine = peak(sol.option, sol.actions, sol.layer_codec)
    by_choice = {o.payload: o for o in prob.options}
    rows = []
    for item in option_prices(sol.option.payload):
        other = by_choice.get(_lossless(sol.option.payload, item.name, lean_budget))
        rows.append((item.name, item, None if other is None else peak(other, sol.actions, sol.layer_codec) - mine))
    for c, a in sol.actions.items():
        if a not in ("keep", "recompute"):
            rows.append((f"{c} {a}", action_price(a), peak(sol.option, {**sol.actions, c: "keep"}, sol.layer_codec)
                         - mine))
    if sol.layer_recompute and sol.layer_codec != "keep":
        rows.append((f"layer inputs {sol.layer_codec}", layer_codec_price(sol.layer_codec),
                     peak(sol.option, sol.actions, "keep") - mine))
    return [{"name": label, "price": p.name, "nats": p.nats, "differs": p.differs, "cost_nats": p.cost,
             "saves_gib": None if saved is None else round(saved, 4)} for label, p, saved in rows]
