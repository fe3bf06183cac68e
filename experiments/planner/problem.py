"""The planner's integer program as plain data (``Problem``: measured costs of every choice; ``Solution``: one
choice and its predicted GiB per phase), and the prediction of one choice's bytes. Solved by
``experiments.planner.milp``; built from traced costs by ``experiments.planner.model``."""

from __future__ import annotations

from dataclasses import dataclass, field

from experiments.planner.efficiency import Throughput

KEEP = "keep"


@dataclass(frozen=True)
class Option:
    """An optimizer option: static GiB per phase (relative to the reference), energy, lossy count, payload."""

    name: str
    static: dict[str, float]
    energy: float = 0.0
    lossy: int = 0
    payload: object = None
    loss: float = 0.0  # expected loss cost, nats (experiments.planner.prices)
    transfer: float = 0.0  # tokens' worth of host copies a micro-batch waits for (weight streaming; efficiency)


@dataclass(frozen=True)
class Action:
    """An activation choice: GiB per phase, static (× 1) and per sequence (× b); seconds per sequence; lossy."""

    static: dict[str, float] = field(default_factory=dict)
    per_seq: dict[str, float] = field(default_factory=dict)
    time: float = 0.0
    lossy: int = 0
    loss: float = 0.0  # expected loss cost, nats
    # per line of ``Problem.base``: (static, per_seq) measured on that line's micro-batches, or None where the
    # choice was measured only on the main line (``static``/``per_seq`` then hold there)
    lines: tuple[tuple[dict[str, float], dict[str, float]] | None, ...] = ()

    def on(self, line: int) -> tuple[dict[str, float], dict[str, float]]:
        """(static, per_seq) on the reference's line ``line`` (an index into ``Problem.base``)."""
        own = self.lines[line] if line < len(self.lines) else None
        return own if own is not None else (self.static, self.per_seq)


@dataclass(frozen=True)
class Segment:
    """A line of the reference's GiB per phase, static + per_seq·b, for micro-batches b ≥ ``start`` up to the next
    larger start. Lines with the same start hold together (the peak is their maximum); the planner's costs give each
    secant its own start (``experiments.planner.segments``: the reference at a card's depth need not be convex)."""

    start: int
    static: dict[str, float]
    per_seq: dict[str, float]


@dataclass(frozen=True)
class Problem:
    budget: float  # GiB available to the step (budget − CUDA context)
    base: tuple[Segment, ...]
    options: list[Option]
    actions: dict[str, dict[str, Action]]  # component -> action -> cost (keep: zeros)
    layer_recompute: Action | None = None
    layer_components: tuple[str, ...] = ()  # forced to keep when layer_recompute is chosen
    requires: tuple[tuple[tuple[str, str], tuple[str, str]], ...] = ()  # (c, a) chosen ⇒ (c2, a2) chosen
    conditional: tuple[str, ...] = ("probe",)  # phases that apply only when the policy is not all-keep
    max_batch: int = 1024
    fixed_batch: int | None = None  # solve with b fixed (min_peak)
    batch_caps: tuple[tuple[int, int], ...] = ()  # (option index, largest b): b ≤ cap when that option is chosen
    layer_codecs: dict[str, Action] = field(default_factory=dict)  # codec -> its cost over layer_recompute's
    layer_keep: bool = True  # layer recomputation may keep its inputs as they are (else one codec is required)
    throughput: Throughput | None = None  # the micro-batch efficiency model (None: the largest micro-batch)


@dataclass(frozen=True)
class Solution:
    batch: int
    option: Option
    actions: dict[str, str]
    layer_recompute: bool
    predicted: dict[str, float | None]  # GiB per phase at the solution (the probe: None when it does not run)
    energy: float
    time: float
    lossy: int
    layer_codec: str = KEEP  # how full layer recomputation stores the layer inputs (activation.residual)
    loss: float = 0.0  # expected loss cost of the choices, nats
    fit_batch: int | None = None  # the largest micro-batch of the most efficient choices (tier 0; ``solve``)
    fit_transfer: float = 0.0  # their host transfer (tokens; weight streaming), against which efficiency is judged

    def policy_actions(self) -> dict[str, str]:
        """The action of each component as the activation policy writes it (the layer inputs' codec under full
        layer recomputation is ``residual``'s action)."""
        return {**self.actions, **({"residual": self.layer_codec} if self.layer_recompute else {})}


def phases(prob: Problem) -> list[str]:
    return list(dict.fromkeys(p for seg in prob.base for p in (*seg.static, *seg.per_seq)))


def _lines_at(prob: Problem, batch: int) -> list[int]:
    start = max(s.start for s in prob.base if s.start <= batch)
    return [j for j, s in enumerate(prob.base) if s.start == start]


def predict(prob: Problem, batch: int, option: Option, actions: dict[str, str], layer_recompute: bool,
            layer_codec: str = KEEP) -> dict[str, float | None]:
    """GiB per phase of one choice (the probe: None when the policy is all keep and it does not run)."""
    extra = [prob.layer_recompute] if layer_recompute else []
    extra += [prob.layer_codecs[layer_codec]] if layer_recompute and layer_codec != KEEP else []
    nonid = layer_recompute or any(a != KEEP for a in actions.values())
    chosen = [prob.actions[c][a] for c, a in actions.items()] + extra
    out: dict[str, float | None] = {}
    for p in phases(prob):
        if p in prob.conditional and not nonid:
            out[p] = None
            continue
        out[p] = max(_on_line(prob.base[j], j, chosen, p, batch) for j in _lines_at(prob, batch)) \
            + option.static.get(p, 0.0)
    return out


def _on_line(seg: Segment, j: int, chosen: list[Action], p: str, batch: int) -> float:
    """GiB of phase ``p`` at ``batch`` on the reference's line ``j`` with the ``chosen`` actions' deltas on it."""
    total = seg.static.get(p, 0.0) + batch * seg.per_seq.get(p, 0.0)
    for act in chosen:
        static, per_seq = act.on(j)
        total += static.get(p, 0.0) + batch * per_seq.get(p, 0.0)
    return total
