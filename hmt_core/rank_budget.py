"""Dynamic rank under an optimizer-state budget (``method.state_budget``): at every refresh the ranks solve the
multiple-choice knapsack

    maximize Σ_l E_l(r_l)   subject to   Σ_l bytes_l(r_l) ≤ B,   r_l ∈ grid_l,   r_l ≤ τ-rank_l

(``allocate``: its LP relaxation by ``scipy.optimize.linprog``, rounded, leftover spent greedily), with E_l(r) the
spectral energy of ``hmt_core.rank`` and bytes_l(r) the projected state (``layer_state_bytes``: GaLore, Zhao et al.
2024, Table 1). The total is never exceeded. Design notes, the default budget and measurements:
docs/design/rank_budget.md."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
from scipy import sparse
from scipy.optimize import linprog
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from hmt_core.projection import which_sides
from hmt_core.rank import energy_ratios, valid_candidates

GALORE_DEFAULT_RANK = 128  # baselines.galore.Config().rank (tests/test_state_budget.py keeps them equal)
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_WITH_UNIT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)", re.IGNORECASE)
_INTEGER = re.compile(r"\d+")
_DECIMAL = re.compile(r"(\d+\.\d*|\.\d+|\d+(?:\.\d*)?[eE][-+]?\d+)")


class StateBudget(NamedTuple):
    kind: str  # "fraction" (of AdamW's state) | "bytes" | "galore" (GaLore's state at rank ``amount``)
    amount: float


def _bad(value: Any, why: str) -> ValueError:
    return ValueError(f"method.state_budget={value!r} {why}: give a fraction of AdamW's state in (0, 1] (0.25), "
                      f"bytes ('3GiB', '500MB', 123456), 'galore' (GaLore's state at rank {GALORE_DEFAULT_RANK}) "
                      f"or null (no budget)")


def parse_state_budget(value: str | int | float | None) -> StateBudget | None:
    """``method.state_budget`` -> a ``StateBudget`` (None: no budget); a ``ValueError`` naming the key if bad.
    An integer (or a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB) is bytes; a decimal is a
    fraction of AdamW's state and must be in (0, 1]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _bad(value, "is not a budget")
    if isinstance(value, int):
        if value <= 0:
            raise _bad(value, "must be positive")
        return StateBudget("bytes", value)
    if isinstance(value, float):
        if not (math.isfinite(value) and 0 < value <= 1):
            raise _bad(value, "is a fraction outside (0, 1]")
        return StateBudget("fraction", value)
    text = value.strip()
    if text.lower() in ("none", "null"):
        return None
    if text.lower() == "galore":
        return StateBudget("galore", GALORE_DEFAULT_RANK)
    if _INTEGER.fullmatch(text):
        return parse_state_budget(int(text))
    if m := _WITH_UNIT.fullmatch(text):
        amount = int(float(m.group(1)) * UNITS[m.group(2).lower()])
        if amount <= 0:
            raise _bad(value, "is less than one byte")
        return StateBudget("bytes", amount)
    if _DECIMAL.fullmatch(text):
        return parse_state_budget(float(text))
    raise _bad(value, "is not a budget")


def normalize_state_budget(value: str | int | float | None) -> str | None:
    """The Config's spelling: validated, and a string (as a Hydra override or YAML gives it) or None."""
    parsed = parse_state_budget(value)
    if parsed is None:
        return None
    return value.strip() if isinstance(value, str) else str(value)


# --------------------------------------------------------------------------------------------- bytes per rank
def layer_state_bytes(shape: tuple[int, int], rank: int, *, left: bool, right: bool, state_size: int,
                      basis_size: int, extra: int = 0) -> int:
    """Projected state of a weight of ``shape`` (out, in) at ``rank``: two moments of Ĝ ((out, r), (r, in) or
    (r, r)) of ``state_size`` bytes, the basis (P (out, r) and/or Qᵀ (r, in)) of ``basis_size``, plus ``extra``."""
    out_dim, in_dim = shape
    rows, cols = (rank if left else out_dim), (rank if right else in_dim)
    basis = (out_dim * rank if left else 0) + (rank * in_dim if right else 0)
    return 2 * rows * cols * state_size + basis * basis_size + extra


def galore_state_bytes(shape: tuple[int, int], rank: int, size: int) -> int:
    """galore-torch's state for one projected (out, in) weight at ``rank`` ("std" projection: right-sided when
    out ≥ in): ``exp_avg``, ``exp_avg_sq`` of the projected gradient and the projector's ``ortho_matrix``, all in
    the weight's dtype (``size`` bytes); an SVD keeps at most min(out, in) vectors."""
    r = min(rank, *shape)
    return layer_state_bytes(shape, r, left=shape[0] < shape[1], right=shape[0] >= shape[1], state_size=size,
                             basis_size=size)


def budget_bytes(budget: StateBudget, weights: Iterable[tuple[tuple[int, int], int]]) -> int:
    """The budget in bytes for projected ``weights`` ((out, in), element size of the weight)."""
    weights = list(weights)
    if budget.kind == "bytes":
        return int(budget.amount)
    if budget.kind == "fraction":
        return int(budget.amount * sum(2 * out * inn * size for (out, inn), size in weights))
    return sum(galore_state_bytes(shape, int(budget.amount), size) for shape, size in weights)


def rank_grid(candidates: tuple[int, ...], max_rank: int, fallback: str) -> tuple[int, ...]:
    """Ranks a layer may hold: its candidates ≤ max_rank, plus max_rank with the "full" fallback (or alone)."""
    valid = valid_candidates(candidates, max_rank)
    return tuple(sorted(set(valid) | ({max_rank} if fallback == "full" or not valid else set())))


def halvings(grid: tuple[int, ...]) -> tuple[int, ...]:
    """``grid`` extended by c/2, c/4, …, 1 below its smallest rank c."""
    low, r = set(), grid[0] // 2
    while r >= 1:
        low.add(r)
        r //= 2
    return tuple(sorted(low | set(grid)))


def energy_curve(s: Tensor, total_energy: float, grid: tuple[int, ...]) -> tuple[float, ...] | None:
    """s: (k,) leading singular values -> E(r) for each r in ``grid`` (1 beyond k: only full rank lies there);
    None for shape-only tensors (a dry run has no spectrum)."""
    if is_fake(s):
        return None
    energy = energy_ratios(s, total_energy).tolist()
    return tuple(energy[r - 1] if r <= len(energy) else 1.0 for r in grid)


def prior_curve(grid: tuple[int, ...], known: Sequence[tuple[tuple[int, ...], tuple[float, ...], int]],
                max_rank: int) -> tuple[float, ...]:
    """Predicted E(r) at each ``grid`` rank of a layer never refreshed: the mean of the ``known`` curves
    ((grid, E at each grid rank, max_rank) of the layers seen), each read piecewise-linearly through (0, 0), its
    points and (its max_rank, 1); with none known, E(r) = r / max_rank (equal singular values)."""
    if not known:
        return tuple(r / max_rank for r in grid)
    total = np.zeros(len(grid))
    for g, curve, full in known:
        xs, ys = [0, *g], [0.0, *curve]
        if g[-1] < full:
            xs, ys = [*xs, full], [*ys, 1.0]
        total += np.interp(grid, xs, ys)
    return tuple(float(e) for e in total / len(known))


# ----------------------------------------------------------------------------------------------- allocation
def allocate(values: Sequence[Sequence[float]], costs: Sequence[Sequence[int]], budget: int) -> list[int]:
    """One option j per layer l with Σ_l costs[l][j] ≤ budget (exact, integer bytes), maximizing Σ_l values[l][j]
    to within one layer's step. values[l], costs[l]: (n_l,) the options of layer l. Returns j per layer.

    The LP relaxation (``scipy.optimize.linprog``, dual simplex) ends at a vertex, where at most one layer is split
    between two options; that layer is rounded down to the cheaper one and the bytes left are spent greedily
    (``fill``). The LP value bounds the integer optimum, so the result is optimal when the LP solution is integral
    and otherwise short of it by at most the split layer's value step. (The exact MILP, ``scipy.optimize.milp``,
    took 1.8 s on a 224-layer instance; a refresh round of a 7B model solves 224 of them.) Raises ValueError if
    even the cheapest options exceed ``budget``."""
    if sum(min(c) for c in costs) > budget:
        raise ValueError(f"the cheapest options need {sum(min(c) for c in costs)} bytes > budget {budget}")
    best = [max(range(len(v)), key=lambda j, v=v, c=c: (v[j], -c[j])) for v, c in zip(values, costs)]
    if sum(c[j] for c, j in zip(costs, best)) <= budget:  # not binding: every layer its best
        return best
    sizes = [len(v) for v in values]
    offsets = np.cumsum([0, *sizes])
    n = int(offsets[-1])
    one_hot = sparse.csr_matrix((np.ones(n), (np.repeat(np.arange(len(sizes)), sizes), np.arange(n))),
                                shape=(len(sizes), n))  # (layers, options): Σ_j x_{l,j} = 1
    weight = np.concatenate([np.asarray(c, dtype=np.float64) for c in costs]) / budget  # scaled: Σ ≤ 1
    res = linprog(-np.concatenate([np.asarray(v, dtype=np.float64) for v in values]), A_ub=weight[None, :],
                  b_ub=[1.0], A_eq=one_hot, b_eq=np.ones(len(sizes)), bounds=(0, 1), method="highs-ds")
    if res.x is None:  # not expected (the cheapest options are feasible): start from them
        return fill(values, costs, budget, cheapest(values, costs))
    pick = []
    for c, a, b in zip(costs, offsets[:-1], offsets[1:]):
        used = [j for j in range(b - a) if res.x[a + j] > 1e-9] or [int(np.argmax(res.x[a:b]))]
        pick.append(min(used, key=lambda j, c=c: c[j]))  # a split layer: its cheaper option
    return fill(values, costs, budget, pick)


def cheapest(values: Sequence[Sequence[float]], costs: Sequence[Sequence[int]]) -> list[int]:
    """Each layer's cheapest option (the most valuable among equally cheap ones)."""
    return [min(range(len(c)), key=lambda j, c=c, v=v: (c[j], -v[j])) for v, c in zip(values, costs)]


def fill(values: Sequence[Sequence[float]], costs: Sequence[Sequence[int]], budget: int,
         pick: list[int]) -> list[int]:
    """Make ``pick`` feasible and spend what is left: while over ``budget``, the downgrade losing the least value
    per byte saved; then, while one fits, the upgrade gaining the most value per byte. values[l], costs[l]: (n_l,)."""
    pick = list(pick)
    spent = sum(c[j] for c, j in zip(costs, pick))
    while spent > budget:
        options = [((v[pick[i]] - v[j]) / (c[pick[i]] - c[j]), i, j) for i, (v, c) in enumerate(zip(values, costs))
                   for j in range(len(c)) if c[j] < c[pick[i]]]
        _, i, j = min(options)
        spent += costs[i][j] - costs[i][pick[i]]
        pick[i] = j
    while True:
        best, best_gain = None, 0.0
        for i, (v, c) in enumerate(zip(values, costs)):
            for j in range(len(c)):
                dv, dc = v[j] - v[pick[i]], c[j] - c[pick[i]]
                if dv > 0 and spent + dc <= budget:
                    gain = math.inf if dc <= 0 else dv / dc
                    if gain > best_gain:
                        best, best_gain = (i, j), gain
        if best is None:
            return pick
        i, j = best
        spent += costs[i][j] - costs[i][pick[i]]
        pick[i] = j


def greedy_allocate(values: Sequence[Sequence[float]], costs: Sequence[Sequence[int]], budget: int) -> list[int]:
    """The plain greedy (not always optimal, always feasible): from every layer's cheapest option, the upgrade
    with the largest value gained per byte that still fits, repeatedly. values[l], costs[l]: (n_l,)."""
    return fill(values, costs, budget, cheapest(values, costs))


# ---------------------------------------------------------------------------------------------- bookkeeping
@dataclass
class LayerBudget:
    grid: tuple[int, ...]  # ranks this layer may hold, ascending
    costs: tuple[int, ...]  # bytes of its projected state at each grid rank
    max_rank: int
    curve: tuple[float, ...] | None = None  # E(r) at each grid rank from its last refresh (None: never seen)
    tau_rank: int | None = None  # what τ asked for at that refresh
    step: int = -1  # the refresh's step
    held: int | None = None  # the rank whose state is allocated now

    def cost(self, rank: int) -> int:
        return self.costs[self.grid.index(rank)]

    def allowed(self) -> list[int]:  # grid indices ≤ τ-rank (all before the first spectrum)
        cap = self.tau_rank if self.tau_rank is not None else self.grid[-1]
        return [j for j, r in enumerate(self.grid) if r <= cap] or [0]


class RankBudget:
    """Per-layer grids, costs, last curves and held ranks; ``choose`` is called at each refresh (module doc)."""

    def __init__(self, budget: int, layers: dict[str, LayerBudget], tau: float = 1.0) -> None:
        self.budget = int(budget)
        self.layers = layers
        self.tau = tau  # for the τ-rank predicted from a prior curve

    def grid(self, name: str) -> tuple[int, ...]:
        return self.layers[name].grid

    def held_bytes(self) -> int:
        return sum(layer.cost(layer.held) for layer in self.layers.values() if layer.held is not None)

    def choose(self, name: str, step: int, tau_rank: int, curve: tuple[float, ...] | None) -> int:
        """Rank for layer ``name`` refreshing at ``step`` whose energy rule asked for ``tau_rank`` (curve: E at
        each grid rank, None when unknown). The caller ``commit``s the rank it finally holds."""
        me = self.layers[name]
        me.curve, me.tau_rank, me.step = curve, tau_rank, step
        seen = [(x.grid, x.curve, x.max_rank) for x in self.layers.values() if x.curve is not None]
        names, options, values, costs, fixed, priors = [], [], [], [], 0, {}
        for n, layer in self.layers.items():
            if n != name and layer.step == step and layer.held is not None:  # refreshed at this step: fixed
                fixed += layer.cost(layer.held)
                continue
            curve = layer.curve
            if curve is None:  # no spectrum (never refreshed, or a dry run): predicted from the curves seen
                key = (layer.grid, layer.max_rank)  # a few distinct shapes: one prediction each
                if key not in priors:
                    priors[key] = prior_curve(layer.grid, seen, layer.max_rank)
                curve = priors[key]
            if layer.tau_rank is not None:
                idx = layer.allowed()
            else:  # never refreshed: capped at the τ-rank its predicted curve gives
                idx = list(range(next((j for j, e in enumerate(curve) if e >= self.tau), len(curve) - 1) + 1))
            names.append(n)
            options.append(idx)
            values.append([curve[j] for j in idx])
            costs.append([layer.costs[j] for j in idx])
        pick = allocate(values, costs, self.budget - fixed)
        i = names.index(name)
        want = me.grid[options[i][pick[i]]]
        others = sum(layer.cost(layer.held) if layer.held is not None else layer.costs[0]
                     for n, layer in self.layers.items() if n != name)
        limit = self.budget - others  # the guarantee: never above the budget, whatever the predictions
        fits = [r for j, r in enumerate(me.grid) if r <= want and me.costs[j] <= limit]
        return fits[-1] if fits else me.grid[0]

    def commit(self, name: str, rank: int) -> None:
        self.layers[name].held = int(rank)

    def state_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget,
                "layers": {n: {"curve": None if x.curve is None else list(x.curve), "tau_rank": x.tau_rank,
                               "step": x.step, "held": x.held, "grid": list(x.grid)}
                           for n, x in self.layers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for n, st in state["layers"].items():
            layer = self.layers[n]
            if tuple(st["grid"]) != layer.grid:
                raise ValueError(f"hmt state_dict: rank grid of {n} {st['grid']} differs from {list(layer.grid)}")
            layer.curve = None if st["curve"] is None else tuple(float(e) for e in st["curve"])
            layer.tau_rank = None if st["tau_rank"] is None else int(st["tau_rank"])
            layer.step, layer.held = int(st["step"]), None if st["held"] is None else int(st["held"])


class BudgetSettings(Protocol):
    """The projection keys the budget reads (``hmt_core.optim.settings.Projection``)."""

    state_budget: str | None
    rank: int | None
    sides: str
    rank_fallback: str
    tau: float


def make_rank_budget(weights: dict[str, tuple[tuple[int, int], int, tuple[int, ...]]], cfg: BudgetSettings, *,
                     state_dtype: str, limiter: bool) -> RankBudget | None:
    """The ``RankBudget`` for projected ``weights`` (name -> ((out, in), weight element size, candidates)) under
    HMT's projection settings, ``state_dtype`` moments and Mode B's ``limiter`` (its 0-d norm of G ⊙ s, accumulated
    in fp32 or wider); None without a budget or when the rank is not dynamic (fixed ``rank``, identity)."""
    budget = parse_state_budget(cfg.state_budget)
    if budget is None or cfg.rank is not None or cfg.sides == "identity" or not weights:
        return None
    limit = budget_bytes(budget, ((shape, size) for shape, size, _ in weights.values()))
    state_size = 2 if state_dtype == "bf16" else 4

    def layer(shape, size, grid) -> LayerBudget:
        left, right = which_sides(shape, cfg.sides)
        costs = tuple(layer_state_bytes(shape, r, left=left, right=right, state_size=state_size, basis_size=size,
                                        extra=max(4, size) if limiter else 0) for r in grid)
        return LayerBudget(grid=grid, costs=costs, max_rank=min(shape))

    grids = {n: rank_grid(c, min(shape), cfg.rank_fallback) for n, (shape, _, c) in weights.items()}
    layers = {n: layer(shape, size, grids[n]) for n, (shape, size, _) in weights.items()}
    if sum(x.costs[0] for x in layers.values()) > limit:  # too tight for the candidates: allow halvings
        layers = {n: layer(shape, size, halvings(grids[n])) for n, (shape, size, _) in weights.items()}
    need = sum(x.costs[0] for x in layers.values())
    if need > limit:
        raise ValueError(f"method.state_budget={cfg.state_budget!r} allows {limit:,} bytes of projected optimizer "
                         f"state but rank 1 for every projected weight already needs {need:,}; raise it or set "
                         f"method.state_budget=null")
    return RankBudget(limit, layers, cfg.tau)
