"""The planner's integer program, solved with ``scipy.optimize.milp`` (HiGHS).

Formulation (after Adacc, Chen et al. 2025, arXiv:2508.00806, which chooses activation actions with a MILP under a
memory budget; here the optimizer setting and the micro-batch size are decision variables too):

  variables   b ∈ {1..B_max}                      micro-batch size (sequences of ``train.seq_len`` tokens)
              y_o ∈ {0,1}, Σ_o y_o = 1            one optimizer option o (mode, state dtype, ranks, 8-bit, ...)
              x_{c,a} ∈ {0,1}, Σ_a x_{c,a} = 1    one action a per activation component c (keep included)
              ℓ ∈ {0,1}                           full layer recomputation (forces keep inside the layers)
              z_k ∈ {0,1}, Σ_k z_k ≤ ℓ            its layer inputs stored by codec k (``activation.residual``;
                                                  = ℓ when keeping them is not offered)
              u_j ∈ {0,1}, Σ_j u_j = 1            the segment of the reference's piecewise-linear cost b lies in
              w_{c,a} = b·x_{c,a}, w_ℓ = b·ℓ,     exact McCormick linearization of binary × bounded integer:
              w_k = b·z_k
                                                  w ≤ B_max·x, w ≤ b, w ≥ b − B_max(1 − x), w ≥ 0
              n ∈ {0,1}                           the policy is not all-keep (the activation probe then runs)
  memory      for every phase p (forward, backward, optimizer; the probe when n = 1) and segment j:
                S_{p,j} + P_{p,j}·b + Σ_o M_{p,o} y_o + Σ_{c,a} (s_{p,c,a} x_{c,a} + q_{p,c,a} w_{c,a})
                  + s_{p,ℓ} ℓ + q_{p,ℓ} w_ℓ + Σ_k (s_{p,k} z_k + q_{p,k} w_k)
                  ≤  t  (+ Big-M·(1 − u_j), + Big-M·(1 − n) for the probe),   t ≤ B
              with S, P the reference's static and per-sequence bytes, M the option's, s and q the choice's
              static and per-sequence deltas (a codec's: over full layer recomputation's) — all measured
              (``experiments.planner.costs``); t is the predicted peak
  rules       x_{attn_qkv,recompute} ≤ x_{attn_core,recompute}; x_{c,keep} ≥ ℓ for c inside the layers;
              b + (B_max − cap_o)·y_o ≤ B_max for an option verified over the budget at cap_o + 1 sequences
  objective   lexicographic, one MILP per tier, each tier's optimum kept as a constraint for the next:
              0. max b: b_fit, the largest micro-batch that fits; then b ≥ b_eff, the fewest sequences whose
                 modeled throughput is within a slack of b_fit's (``experiments.planner.efficiency``; b = b_fit
                 without a throughput model)
              1. min Σ_o λ_o y_o + Σ λ_{c,a} x_{c,a} + Σ λ_k z_k (expected loss cost: each lossy choice's price
                 from the tuned campaign, ``experiments.planner.prices``)
              2. max Σ_o E_o y_o (retained gradient energy)
              3. min Σ τ_{c,a} x_{c,a} + τ_ℓ ℓ + Σ τ_k z_k (extra step time per sequence)
              4. max b (the remaining throughput)   5. min the number of lossy choices
              6. min t (headroom; breaks the remaining ties)
Pure functions over plain data: ``Problem`` can be written by hand (tests/test_plan.py checks a forced optimum).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from experiments.planner.efficiency import batch_floors
from experiments.planner.problem import KEEP, Option, Problem, Solution, phases, predict

class _Vars:
    def __init__(self, prob: Problem) -> None:
        self.names: list[tuple] = [("b",), ("t",)]
        self.starts = sorted({seg.start for seg in prob.base})
        self.names += [("u", st) for st in self.starts]
        self.names += [("y", i) for i in range(len(prob.options))]
        self.x = [(c, a) for c, acts in prob.actions.items() for a in acts]
        self.names += [("x", c, a) for c, a in self.x] + [("w", c, a) for c, a in self.x]
        if prob.layer_recompute is not None:
            self.names += [("l",), ("wl",)]
            self.names += [(kind, k) for k in prob.layer_codecs for kind in ("z", "wz")]
        self.names += [("n",)]
        self.index = {n: i for i, n in enumerate(self.names)}

    def __getitem__(self, key: tuple) -> int:
        return self.index[key]

    def __contains__(self, key: tuple) -> bool:
        return key in self.index


class _Rows:
    """Constraint rows (A, lb, ub) of a problem's variables, added one at a time."""

    def __init__(self, n: int) -> None:
        self.n, self.rows, self.lb, self.ub = n, [], [], []

    def add(self, coef: dict[int, float], lo: float, hi: float) -> None:
        row = np.zeros(self.n)
        for i, c in coef.items():
            row[i] += c
        self.rows.append(row)
        self.lb.append(lo)
        self.ub.append(hi)


def _rows(prob: Problem, v: _Vars, with_budget: bool) -> tuple[list, list, list]:
    """Constraint rows (A, lb, ub). Every phase's bytes are ≤ t (the predicted peak); ``with_budget``: t ≤ budget."""
    out = _Rows(len(v.names))
    if with_budget:
        out.add({v["t",]: 1}, -np.inf, prob.budget)
    _choice_rows(prob, v, out)
    _phase_rows(prob, v, out)
    return out.rows, out.lb, out.ub


def _choice_rows(prob: Problem, v: _Vars, out: _Rows) -> None:
    """One option, one piece of the reference holding b, one action per component, the batch caps, the exact
    McCormick products w = b·x, the required pairs and the indicator n of a policy that is not all-keep."""
    add, b, bmax = out.add, v["b",], prob.max_batch
    add({v["y", i]: 1 for i in range(len(prob.options))}, 1, 1)
    starts = v.starts
    add({v["u", st]: 1 for st in starts}, 1, 1)  # b lies in one piece of the reference
    add({b: 1, **{v["u", st]: -st for st in starts}}, 0, np.inf)
    ends = dict(zip(starts, [st - 1 for st in starts[1:]] + [bmax]))
    add({b: 1, **{v["u", st]: -ends[st] for st in starts}}, -np.inf, 0)
    for i, cap in prob.batch_caps:  # y_i = 1 ⇒ b ≤ cap
        add({b: 1, v["y", i]: bmax - cap}, -np.inf, bmax)
    for c in prob.actions:
        add({v["x", c, a]: 1 for a in prob.actions[c]}, 1, 1)
    pairs = [(v["x", c, a], v["w", c, a]) for c, a in v.x]
    if ("l",) in v:
        pairs.append((v["l",], v["wl",]))
        pairs += _codec_rows(prob, v, out)
        for c in prob.layer_components:
            if c in prob.actions and KEEP in prob.actions[c]:
                add({v["x", c, KEEP]: 1, v["l",]: -1}, 0, np.inf)
    for x, w in pairs:  # McCormick: w = b·x exactly for binary x and integer 0 ≤ b ≤ bmax
        add({w: 1, x: -bmax}, -np.inf, 0)
        add({w: 1, b: -1}, -np.inf, 0)
        add({w: 1, b: -1, x: -bmax}, -bmax, np.inf)
    for (c, a), (c2, a2) in prob.requires:
        if ("x", c, a) in v:
            if ("x", c2, a2) not in v:
                add({v["x", c, a]: 1}, 0, 0)
            else:
                add({v["x", c, a]: 1, v["x", c2, a2]: -1}, -np.inf, 0)
    for c, a in v.x:  # n = 1 when anything is not kept
        if a != KEEP:
            add({v["n",]: 1, v["x", c, a]: -1}, 0, np.inf)
    if ("l",) in v:
        add({v["n",]: 1, v["l",]: -1}, 0, np.inf)


def _codec_rows(prob: Problem, v: _Vars, out: _Rows) -> list[tuple[int, int]]:
    """At most one layer-input codec, and only with full layer recomputation: Σ_k z_k ≤ ℓ (= ℓ when the inputs
    may not be kept as they are); the (z, w) pairs."""
    if prob.layer_codecs:
        out.add({**{v["z", k]: 1 for k in prob.layer_codecs}, v["l",]: -1}, 0 if not prob.layer_keep else -np.inf, 0)
    return [(v["z", k], v["wz", k]) for k in prob.layer_codecs]


def _phase_rows(prob: Problem, v: _Vars, out: _Rows) -> None:
    """Per phase and per line of the reference: its bytes at the chosen option, actions and b are ≤ t (a line
    binds only in b's piece; a conditional phase only when n = 1: big-M)."""
    big = _big_m(prob)
    for p in phases(prob):
        for j, seg in enumerate(prob.base):  # active in b's piece only; each choice's delta on this line
            row = {v["t",]: -1.0, **{v["y", i]: o.static.get(p, 0.0) for i, o in enumerate(prob.options)}}
            pairs = [(v["x", c, a], v["w", c, a], prob.actions[c][a]) for c, a in v.x]
            if ("l",) in v:
                pairs.append((v["l",], v["wl",], prob.layer_recompute))
                pairs += [(v["z", k], v["wz", k], act) for k, act in prob.layer_codecs.items()]
            for x, w, act in pairs:
                static, per_seq = act.on(j)
                row[x], row[w] = static.get(p, 0.0), per_seq.get(p, 0.0)
            if p in prob.conditional:
                row[v["n",]] = big
            row.update({v["b",]: seg.per_seq.get(p, 0.0), v["u", seg.start]: big})
            hi = -seg.static.get(p, 0.0) + big + (big if p in prob.conditional else 0.0)
            out.add(row, -np.inf, hi)


def _big_m(prob: Problem) -> float:
    def mag(d: dict, scale: float = 1.0) -> float:
        return scale * sum(abs(x) for x in d.values())

    bmax = prob.max_batch
    total = abs(prob.budget) + sum(mag(s.static) + mag(s.per_seq, bmax) for s in prob.base)
    total += sum(mag(o.static) for o in prob.options)
    acts = [a for group in prob.actions.values() for a in group.values()]
    acts += [prob.layer_recompute, *prob.layer_codecs.values()] if prob.layer_recompute is not None else []
    total += sum(max(mag(st) + mag(ps, bmax) for st, ps in [(a.static, a.per_seq), *filter(None, a.lines)])
                 for a in acts)
    return 2 * total + 1


def _objectives(prob: Problem, v: _Vars, n: int) -> dict[str, np.ndarray]:
    tokens, loss, energy, time, lossy, peak = (np.zeros(n) for _ in range(6))
    tokens[v["b",]] = -1.0
    peak[v["t",]] = 1.0
    for i, o in enumerate(prob.options):
        energy[v["y", i]], lossy[v["y", i]], loss[v["y", i]] = -o.energy, o.lossy, o.loss
    for c, a in v.x:
        act = prob.actions[c][a]
        time[v["x", c, a]], lossy[v["x", c, a]], loss[v["x", c, a]] = act.time, act.lossy, act.loss
    if ("l",) in v:
        act = prob.layer_recompute
        time[v["l",]], lossy[v["l",]], loss[v["l",]] = act.time, act.lossy, act.loss
        for k, act in prob.layer_codecs.items():
            time[v["z", k]], lossy[v["z", k]], loss[v["z", k]] = act.time, act.lossy, act.loss
    return {"tokens": tokens, "loss": loss, "energy": energy, "time": time, "lossy": lossy, "peak": peak}


TIERS = ("loss", "energy", "time", "tokens", "lossy", "peak")  # after tier 0 (the micro-batch's floor)


def _solve(c: np.ndarray, rows: list, lb: list, ub: list, integrality: np.ndarray, bounds: Bounds):
    res = milp(c, constraints=LinearConstraint(np.array(rows), lb, ub), integrality=integrality, bounds=bounds,
               options={"mip_rel_gap": 0.0})
    return res if res.status == 0 else None


def _setup(prob: Problem, with_budget: bool = True):
    v = _Vars(prob)
    n = len(v.names)
    rows, lb, ub = _rows(prob, v, with_budget)
    integrality = np.ones(n)
    lo, hi = np.zeros(n), np.ones(n)
    lo[v["b",]] = prob.fixed_batch or 1
    hi[v["b",]] = prob.fixed_batch or prob.max_batch
    integrality[v["t",]], lo[v["t",]], hi[v["t",]] = 0, -np.inf, np.inf
    for key in v.names:
        if key[0] in ("w", "wl", "wz"):
            integrality[v[key]] = 0
            hi[v[key]] = prob.max_batch
    return v, n, rows, lb, ub, integrality, Bounds(lo, hi)


PIN_TOLERANCES = (1e-6, 1e-4)  # relative slack of an earlier tier's optimum pinned for the next (HiGHS: 1e-7)


def solve(prob: Problem) -> Solution | None:
    """The lexicographic optimum (module docstring: tier 0 sets the micro-batch's floor, then ``TIERS``; the last,
    least predicted peak, only breaks ties), or None when no choice fits ``prob.budget`` at one sequence. Each
    tier's optimum is pinned, with a relative slack, as a constraint of the next; where HiGHS finds the next tier
    infeasible at every slack of ``PIN_TOLERANCES`` (seen once, with a cost model corrected by a verification),
    the earlier tiers' optimum is the answer: the later tiers only break its ties."""
    v, n, rows, lb, ub, integrality, bounds = _setup(prob)
    objectives = _objectives(prob, v, n)
    res = _solve(objectives["tokens"], rows, lb, ub, integrality, bounds)
    if res is None:
        return None
    fit, fit_transfer = round(res.x[v["b",]]), 0.0
    if not prob.fixed_batch:
        fit, fit_transfer = _floor_rows(prob, v, fit, objectives["tokens"], rows, lb, ub, integrality, bounds)
    best = None  # the last pinned tier's optimum
    for tier in TIERS:
        c = objectives[tier]
        found = _solve(c, rows, lb, ub, integrality, bounds)
        for slack in PIN_TOLERANCES[1:] if found is None and best is not None else ():
            ub[-1] = best + slack * max(1.0, abs(best))
            if (found := _solve(c, rows, lb, ub, integrality, bounds)) is not None:
                break
        if found is None:
            break
        res, best = found, float(c @ found.x)
        rows.append(c.copy())
        lb.append(-np.inf)
        ub.append(best + PIN_TOLERANCES[0] * max(1.0, abs(best)))
    return dataclasses.replace(_solution(prob, v, res.x), fit_batch=fit, fit_transfer=fit_transfer)


def _floor_rows(prob: Problem, v: _Vars, fit: int, tokens: np.ndarray, rows: list, lb: list, ub: list,
                integrality: np.ndarray, bounds: Bounds) -> tuple[int, float]:
    """Tier 0's rows: per group of options with the same host transfer, b ≥ its floor when one of them is chosen,
    or none of them is (``experiments.planner.efficiency.batch_floors``; one group: b ≥ its floor). Returns the
    largest micro-batch of the group with the best modeled throughput, and that group's transfer."""
    groups: dict[float, list[int]] = {}
    for i, o in enumerate(prob.options):
        groups.setdefault(o.transfer, []).append(i)

    def chosen(members: list[int], coef: float) -> np.ndarray:  # coef · Σ y_o over the group
        row = np.zeros(len(v.names))
        row[[v["y", i] for i in members]] = coef
        return row

    fits = {q: fit for q in groups}
    for q, members in groups.items() if len(groups) > 1 else ():  # the largest micro-batch of each group alone
        res = _solve(tokens, [*rows, chosen(members, 1.0)], [*lb, 1], [*ub, 1], integrality, bounds)
        fits[q] = None if res is None else round(res.x[v["b",]])
    rate = (lambda q: fits[q]) if prob.throughput is None else (lambda q: prob.throughput.rate(fits[q], q))
    best = max((q for q in fits if fits[q] is not None), key=rate)
    for q, floor in batch_floors(prob.throughput, fits).items():
        row = chosen(groups[q], 1.0 if floor is None else -floor)
        row[v["b",]] = 0.0 if floor is None else 1.0
        rows.append(row)
        lb.append(-np.inf if floor is None else 0.0)
        ub.append(0.0 if floor is None else np.inf)
    return fits[best], best


def leanest(prob: Problem) -> Solution | None:
    """The choice with the least predicted peak (at ``prob.fixed_batch`` when set), whatever the budget."""
    v, n, rows, lb, ub, integrality, bounds = _setup(prob, with_budget=False)
    res = _solve(_objectives(prob, v, n)["peak"], rows, lb, ub, integrality, bounds)
    return None if res is None else _solution(prob, v, res.x)


def min_peak(prob: Problem) -> float:
    """The smallest GiB any choice needs at one sequence (the largest phase, minimized)."""
    v, n, rows, lb, ub, integrality, bounds = _setup(dataclasses.replace(prob, fixed_batch=1), with_budget=False)
    res = _solve(_objectives(prob, v, n)["peak"], rows, lb, ub, integrality, bounds)
    return float("inf") if res is None else float(res.x[v["t",]])


def _solution(prob: Problem, v: _Vars, x: np.ndarray) -> Solution:
    batch = round(x[v["b",]])
    option = prob.options[int(np.argmax([x[v["y", i]] for i in range(len(prob.options))]))]
    actions = {c: max(acts, key=lambda a: x[v["x", c, a]]) for c, acts in prob.actions.items()}
    lr = bool(("l",) in v and x[v["l",]] > 0.5)
    codec = next((k for k in prob.layer_codecs if lr and x[v["z", k]] > 0.5), KEEP)
    layer = [prob.layer_recompute] if lr else []
    layer += [prob.layer_codecs[codec]] if codec != KEEP else []
    chosen = [prob.actions[c][a] for c, a in actions.items()] + layer
    time = sum(batch * a.time for a in chosen)
    lossy = option.lossy + sum(a.lossy for a in chosen)
    return Solution(batch, option, actions, lr, predict(prob, batch, option, actions, lr, codec), option.energy,
                    time, lossy, codec, loss=option.loss + sum(a.loss for a in chosen))
