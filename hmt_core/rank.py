"""Energy-based dynamic rank selection and the per-layer rank history.

HMT design, "Dynamic rank": with singular values σ of a layer's gradient G,
``E(r) = Σ_{i≤r} σᵢ² / Σ_i σᵢ²``; choose the smallest candidate r (default {32, 64, 128, 256}) with
``E(r) ≥ τ``, else a fallback (largest candidate, or full rank min(out, in)). The denominator is the exact
‖G‖_F², so a truncated (randomized) spectrum gives a conservative E(r). A zero gradient has E ≡ 1 (nothing to
capture) and gets the smallest candidate.

Random (Gaussian, APOLLO-style) bases do not follow the spectrum: a random r-dimensional subspace captures
E[‖Π G‖²]/‖G‖² = r/n of *any* G (n = the projected side; rotation invariance), so a rank read off G's spectrum
(τ of the energy in 32 singular directions) says nothing about what a random basis of that rank captures. For them
(``random_rank="captured"``) the rank is chosen from the bases themselves: ``captured_energy`` of each candidate's
actual basis, and ``choose_rank_by_capture`` takes the smallest candidate capturing ≥ τ × what the largest one
considered captures (the largest candidate; with ``rank_fallback="full"`` full rank, which captures everything,
so the rule becomes E(r) ≥ τ as for SVD bases). Since the expectation is r/R, with τ = 0.95 this is nearly always
the largest candidate: a smaller rank is chosen only when its basis happens to capture almost as much (G nearly
inside that basis's span) or τ ≤ r/R. That is the honest answer: a Gaussian basis gives no spectral saving.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch import Tensor

FALLBACKS = ("largest", "full")


def energy_ratios(s: Tensor, total_energy: float) -> Tensor:
    """s: (k,) singular values -> (k,) E(1..k) = cumsum σ² / total (1 where total is 0)."""
    s2 = s.double() ** 2
    if total_energy <= 0:
        return torch.ones_like(s2)
    return (torch.cumsum(s2, 0) / total_energy).clamp(max=1.0)


def valid_candidates(candidates: tuple[int, ...], max_rank: int) -> tuple[int, ...]:
    return tuple(sorted(r for r in candidates if r <= max_rank))


def sketch_size(candidates: tuple[int, ...], fallback: str, max_rank: int) -> int:
    """How many leading singular triplets a refresh needs to choose among ``candidates``."""
    valid = valid_candidates(candidates, max_rank)
    if fallback == "full" or not valid:
        return max_rank
    return valid[-1]


def choose_rank(s: Tensor, total_energy: float, *, candidates: tuple[int, ...], tau: float, fallback: str,
                max_rank: int) -> int:
    """Smallest candidate r ≤ max_rank with E(r) ≥ tau, else the fallback. s: (k,) leading singular values."""
    valid = valid_candidates(candidates, max_rank)
    if not valid:
        return max_rank
    if is_fake(s):  # dry run: no spectrum to read; the fallback rank is the upper bound whose memory counts
        return max_rank if fallback == "full" else valid[-1]
    energy = energy_ratios(s, total_energy)
    for r in valid:
        if r <= energy.numel() and float(energy[r - 1]) >= tau:
            return r
    return max_rank if fallback == "full" else valid[-1]


def captured_energy(grad: Tensor, left: Tensor | None, right: Tensor | None) -> float:
    """‖Π_L G Π_R‖²_F / ‖G‖²_F for grad (out, in), Π_L the orthogonal projector onto the span of ``left``'s
    columns (out, r) and Π_R onto the span of ``right``'s rows (r, in) (QR first: random bases are not orthonormal;
    a missing side is the identity). 1.0 for a zero gradient (nothing to capture)."""
    g = grad.float()  # fp32 matrices (as the factorizations); the sums of squares in fp64
    total = float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2
    if total == 0:
        return 1.0
    low = g
    if left is not None:
        low = torch.linalg.qr(left.float()).Q.t() @ low
    if right is not None:
        low = low @ torch.linalg.qr(right.float().t()).Q
    return float(torch.linalg.vector_norm(low, dtype=torch.float64)) ** 2 / total


def choose_rank_by_capture(captured: list[float], ranks: tuple[int, ...], tau: float) -> int:
    """Smallest of ``ranks`` (ascending) whose basis captured ≥ tau × the last (largest) one's energy."""
    top = captured[-1]
    for r, e in zip(ranks, captured):
        if e >= tau * top:
            return r
    return ranks[-1]


class RankHistory:
    """Per-layer (step, rank, relative compression error, τ-rank) at every refresh. The τ-rank is the rank the
    energy rule asked for; under a state budget (``hmt_core.rank_budget``) the rank held may be lower, and the
    ``rank/budget_capped`` summary entry lists those refreshes."""

    def __init__(self) -> None:
        self.history: dict[str, list[tuple[int, int, float, int]]] = {}

    def record(self, layer: str, step: int, rank: int, rel_error: float, tau_rank: int | None = None) -> None:
        tau = rank if tau_rank is None else tau_rank
        self.history.setdefault(layer, []).append((int(step), int(rank), float(rel_error), int(tau)))

    def current(self) -> dict[str, int]:
        return {layer: h[-1][1] for layer, h in self.history.items() if h}

    def metrics(self) -> dict[str, float]:
        ranks = list(self.current().values())
        if not ranks:
            return {}
        errors = [h[-1][2] for h in self.history.values() if h]
        capped = sum(1 for h in self.history.values() if h and h[-1][1] < h[-1][3])
        return {"rank/mean": sum(ranks) / len(ranks), "rank/min": float(min(ranks)), "rank/max": float(max(ranks)),
                "rank/capped_layers": float(capped), "proj/rel_error_mean": sum(errors) / len(errors)}

    def summary(self) -> dict[str, Any]:
        all_refreshes = Counter(x[1] for h in self.history.values() for x in h)
        errors = [x[2] for h in self.history.values() for x in h]
        capped = {layer: [[s, r, t] for s, r, _, t in h if r < t] for layer, h in self.history.items()}
        return {
            "rank/histogram_current": {str(k): v for k, v in sorted(Counter(self.current().values()).items())},
            "rank/histogram_all_refreshes": {str(k): v for k, v in sorted(all_refreshes.items())},
            "rank/history": {layer: [[s, r] for s, r, _, _ in h] for layer, h in self.history.items()},
            "rank/budget_capped": {layer: c for layer, c in capped.items() if c},  # [step, rank, τ-rank]
            "proj/rel_error_history": {layer: [[s, e] for s, _, e, _ in h] for layer, h in self.history.items()},
            "proj/rel_error_mean": sum(errors) / len(errors) if errors else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {layer: [list(x) for x in h] for layer, h in self.history.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # entries written before τ-ranks: τ-rank = rank
        self.history = {layer: [(int(x[0]), int(x[1]), float(x[2]), int(x[3] if len(x) > 3 else x[1])) for x in h]
                        for layer, h in state.items()}
