"""A basis refresh's choice of basis and rank for one weight (HMT design, "Dynamic Low-Rank Gradient Projection"):
exact SVD, randomized SVD (optionally warm-started, or from an FSDP2 row sketch) or a seeded Gaussian basis (APOLLO,
Zhu et al. 2024); rank fixed, by spectral energy E(r) ≥ τ (``hmt_core.rank.choose_rank``), by what Gaussian bases
capture (``choose_rank_by_capture``), capped by the state budget (``hmt_core.rank_budget``) and agreed across
processes. ``LowRankOptimizer.refresh`` moves the moments to the result and records it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from hmt_core import projection as proj
from hmt_core.optim import update as upd
from hmt_core.optim.settings import Projection
from hmt_core.optim.slot import Slot
from hmt_core.rank import captured_energy, choose_rank, choose_rank_by_capture, sketch_size, valid_candidates
from hmt_core.rank_budget import RankBudget, energy_curve

AgreeRank = Callable[[int, int, torch.device], tuple[int, int]]


@dataclass(frozen=True, kw_only=True)
class Choice:
    basis: proj.Basis
    rank: int
    tau_rank: int | None  # the τ-rank before the budget's cap (None: identity)
    orthonormal: bool
    fell_back: bool  # the factorization failed: the previous basis, or a seeded orthonormal one


def check_sketch(c: Projection) -> None:
    """A sketched refresh (``sketch``, no gradient values) is possible for rsvd or a random basis of fixed rank."""
    shape_only = c.basis == "random" and c.rank is not None and c.sides != "identity"  # reads no values
    if not shape_only and (c.basis != "rsvd" or c.sides == "identity"):
        raise ValueError(f"a sketched refresh needs method.basis=rsvd or a random basis of fixed rank (got "
                         f"basis={c.basis}, rank={c.rank}, sides={c.sides})")


def choose(c: Projection, s: Slot, grad: Tensor | None, sketch: Any, *, seed: int, budget: RankBudget | None,
           agree_rank: AgreeRank | None) -> Choice:  # grad: (out, in), or None with a sketch
    """The new basis and rank of slot ``s`` (``s.seed`` advances when a random basis is drawn)."""
    src = grad if sketch is None else sketch
    shape = tuple(src.shape)
    use_left, use_right = proj.which_sides(shape, c.sides)
    max_rank, device, dtype = min(shape), src.device, src.dtype
    if c.sides == "identity":
        return Choice(basis=proj.identity_basis(shape, use_left, device, dtype), rank=max_rank, tau_rank=None,
                      orthonormal=True, fell_back=False)
    k = c.rank if c.rank is not None else sketch_size(s.candidates, c.rank_fallback, max_rank)
    factors, kw = None, {}
    if c.basis == "svd":
        factors = proj.exact_svd(grad, k)
    elif c.basis == "rsvd" or (c.rank is None and c.random_rank == "spectrum"):  # legacy: a sketch
        gen = torch.Generator().manual_seed(seed * 1_000_003 + s.index * 7919 + s.clock.step)
        kw = dict(power_iters=c.power_iters, oversample=c.oversample, warm=s.basis if c.basis == "rsvd" else None,
                  generator=gen)
        factors = proj.randomized_svd(grad, k, **kw) if sketch is None else sketch.randomized_svd(k, **kw)
    rank, tau_rank = _rank(c, s, grad, factors, budget, use_left, use_right, max_rank)
    if agree_rank is not None and c.rank is None:  # a dynamic rank: rank 0's, on every process
        rank, tau_rank = agree_rank(rank, tau_rank, device)
    if factors is not None and c.basis == "rsvd" and rank > factors.s.numel():  # full rank: every vector
        exact = proj.exact_svd(grad, rank) if sketch is None else sketch.randomized_svd(rank, **kw)
        factors = exact or factors
    fell_back = False
    if c.basis == "random":
        basis, s.seed = proj.random_basis(shape, rank, use_left, use_right, s.seed, device, dtype)
    elif factors is not None and factors.s.numel() >= rank:
        basis = proj.basis_from_factors(factors, rank, use_left, use_right, dtype)
    else:  # factorization failed: keep the previous basis, else a seeded orthonormal one
        fell_back = True
        if s.basis is not None:
            basis, rank = s.basis, s.basis.rank
        else:
            basis = proj.orthonormal_fallback(shape, rank, use_left, use_right, s.seed, device, dtype)
    return Choice(basis=basis, rank=rank, tau_rank=tau_rank, orthonormal=c.basis != "random", fell_back=fell_back)


def _rank(c: Projection, s: Slot, grad: Tensor | None, factors: Any, budget: RankBudget | None, use_left: bool,
          use_right: bool, max_rank: int) -> tuple[int, int]:
    """(rank under the budget, τ-rank): fixed, by capture (random bases), by spectral energy, or the held one."""
    curve = None  # E(r) on the budget's rank grid
    if c.rank is not None:
        rank = c.rank
    elif c.basis == "random" and c.random_rank == "captured":
        rank, curve = random_capture(c, s, grad, use_left, use_right, budget)
    elif factors is not None:
        rank = choose_rank(factors.s, factors.total_energy, candidates=s.candidates, tau=c.tau,
                           fallback=c.rank_fallback, max_rank=max_rank)
        if budget is not None:
            curve = energy_curve(factors.s, factors.total_energy, budget.grid(s.name))
    else:
        rank = s.rank or (valid_candidates(s.candidates, max_rank) or (max_rank,))[0]
    if budget is None:  # dynamic rank only (a fixed rank has no budget)
        return rank, rank
    return budget.choose(s.name, s.clock.step, rank, curve), rank


def random_capture(c: Projection, s: Slot, grad: Tensor, use_left: bool, use_right: bool,
                   budget: RankBudget | None) -> tuple[int, tuple[float, ...] | None]:  # grad: (out, in)
    """(Smallest rank whose seeded Gaussian basis (the one ``random_basis`` would draw now) captures ≥ τ × what the
    largest considered rank's basis captures (the largest candidate, or full rank with ``rank_fallback="full"``),
    the energy each budget grid rank's basis captures; None without a budget). Dry run: the largest rank."""
    shape = tuple(grad.shape)
    max_rank = min(shape)
    ranks = valid_candidates(s.candidates, max_rank)
    if c.rank_fallback == "full" or not ranks:
        ranks = tuple(sorted(set(ranks) | {max_rank}))
    if is_fake(grad):
        return ranks[-1], None
    grid = budget.grid(s.name) if budget is not None else ()
    captured = {}
    for r in sorted(set(ranks) | set(grid)):
        b, _ = proj.random_basis(shape, r, use_left, use_right, s.seed, grad.device, grad.dtype)
        captured[r] = captured_energy(grad, b.left, b.right)
    rank = choose_rank_by_capture([captured[r] for r in ranks], ranks, c.tau)
    return rank, (tuple(captured[r] for r in grid) if grid else None)


def move_moments(s: Slot, basis: proj.Basis, shape: tuple[int, int], device: torch.device, *, policy: str,
                 dtype: torch.dtype) -> None:
    """Zero moments (``dtype``) at the first refresh; later ones move them (and the rank clocks) to ``basis`` per
    ``moment_policy`` (``hmt_core.optim.update.transfer_moments``)."""
    low_shape = s.state_shape(basis, shape)
    clock = s.clock
    if s.m is None:
        s.m = torch.zeros(low_shape, dtype=dtype, device=device)
        s.v = torch.zeros(low_shape, dtype=dtype, device=device)
    elif s.basis is not None and basis is not s.basis:
        clock.born = upd.transfer_born(clock.born, s.basis, basis, policy, clock.adam_t)
        s.m, s.v = upd.transfer_moments(s.m, s.v, s.basis, basis, policy, low_shape)
        if policy == "reset":
            clock.adam_t = 0
