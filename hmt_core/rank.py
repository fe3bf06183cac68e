"""Energy-based dynamic rank selection and the per-layer rank history.

HMT design, "Dynamic rank": with singular values σ of a layer's gradient G,
``E(r) = Σ_{i≤r} σᵢ² / Σ_i σᵢ²``; choose the smallest candidate r (default {32, 64, 128, 256}) with
``E(r) ≥ τ``, else a fallback (largest candidate, or full rank min(out, in)). The denominator is the exact
‖G‖_F², so a truncated (randomized) spectrum gives a conservative E(r). A zero gradient has E ≡ 1 (nothing to
capture) and gets the smallest candidate.
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


class RankHistory:
    """Per-layer (step, rank, relative compression error) at every refresh."""

    def __init__(self) -> None:
        self.history: dict[str, list[tuple[int, int, float]]] = {}

    def record(self, layer: str, step: int, rank: int, rel_error: float) -> None:
        self.history.setdefault(layer, []).append((int(step), int(rank), float(rel_error)))

    def current(self) -> dict[str, int]:
        return {layer: h[-1][1] for layer, h in self.history.items() if h}

    def metrics(self) -> dict[str, float]:
        ranks = list(self.current().values())
        if not ranks:
            return {}
        errors = [h[-1][2] for h in self.history.values() if h]
        return {"rank/mean": sum(ranks) / len(ranks), "rank/min": float(min(ranks)), "rank/max": float(max(ranks)),
                "proj/rel_error_mean": sum(errors) / len(errors)}

    def summary(self) -> dict[str, Any]:
        all_refreshes = Counter(r for h in self.history.values() for _, r, _ in h)
        errors = [e for h in self.history.values() for _, _, e in h]
        return {
            "rank/histogram_current": {str(k): v for k, v in sorted(Counter(self.current().values()).items())},
            "rank/histogram_all_refreshes": {str(k): v for k, v in sorted(all_refreshes.items())},
            "rank/history": {layer: [[s, r] for s, r, _ in h] for layer, h in self.history.items()},
            "proj/rel_error_history": {layer: [[s, e] for s, _, e in h] for layer, h in self.history.items()},
            "proj/rel_error_mean": sum(errors) / len(errors) if errors else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {layer: [list(x) for x in h] for layer, h in self.history.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {layer: [(int(s), int(r), float(e)) for s, r, e in h] for layer, h in state.items()}
