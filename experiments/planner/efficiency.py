"""How many tokens a micro-batch needs to keep the GPU efficient: a roofline model of one micro-batch's step.

A micro-batch of T tokens through a model of N weight elements costs ≈ 6·N·T FLOPs (forward + backward) and reads
the weights about three times (forward, input gradient, weight gradient: 3·2·N bytes in BF16), so its time is

    t(T) = 6·N·T / F + 6·N / BW   ⇒   time per token ∝ 1 + R / T,   R = F / BW   (the ridge point, FLOP/byte)

(Williams et al. 2009, "Roofline"; F the matmul rate, BW the memory bandwidth). Throughput at T relative to the
largest micro-batch that fits, T_fit, is (1 + R/T_fit) / (1 + R/T); the planner takes any micro-batch whose modeled
throughput is within ``slack`` of it (``efficient_batch``), and spends the memory the smaller micro-batch frees on
choices that cost less loss (gradient accumulation keeps the tokens per optimizer step).

R: measured by ``experiments.planner.model.calibrate`` when the calibration ran on a GPU; otherwise the planner key
``ridge_flop_per_byte`` (default ``DEFAULT_RIDGE``: an H100 SXM's 989 TFLOP/s dense BF16 over 3.35 TB/s, the
highest of the common training cards, so the model asks for the most tokens; an A100 is ≈ 153, an H200 ≈ 206).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_RIDGE = 989e12 / 3.35e12  # FLOP per byte: H100 SXM, dense BF16 over HBM3 bandwidth (NVIDIA datasheet)
DEFAULT_SLACK = 0.05  # the throughput a plan may give up against the largest micro-batch that fits


@dataclass(frozen=True, kw_only=True)
class Throughput:
    seq_len: int  # tokens per sequence
    ridge: float = DEFAULT_RIDGE  # FLOP per byte (R above)
    slack: float = DEFAULT_SLACK

    def __post_init__(self) -> None:
        if not (self.seq_len >= 1 and self.ridge > 0 and 0 <= self.slack < 1):
            raise ValueError(f"throughput model: seq_len={self.seq_len}, ridge_flop_per_byte={self.ridge}, "
                             f"efficiency_slack={self.slack} (need ≥ 1, > 0, in [0, 1))")

    def rate(self, batch: int, transfer: float = 0.0) -> float:
        """Modeled tokens/s at ``batch`` sequences, in units of F/(6N): T / (T + R), or T / max(T + R, Q) when the
        micro-batch also waits for Q tokens' worth of host transfers (weight streaming,
        ``experiments.planner.streaming``)."""
        tokens = batch * self.seq_len
        return tokens / max(tokens + self.ridge, transfer)

    def relative(self, batch: int, best: int, transfer: float = 0.0, best_transfer: float = 0.0) -> float:
        """Modeled tokens/s at ``batch`` sequences over that at ``best`` sequences."""
        return self.rate(batch, transfer) / self.rate(best, best_transfer)


def efficient_batch(model: Throughput, best: int, *, transfer: float = 0.0, target: float | None = None) -> int | None:
    """The fewest sequences (≤ ``best``) whose modeled throughput is within ``model.slack`` of ``target`` (default:
    ``best`` sequences' own), with ``transfer`` tokens of host copies a micro-batch; None when none is."""
    goal = model.rate(best, transfer) if target is None else target
    return next((b for b in range(1, best + 1) if model.rate(b, transfer) / goal >= 1 - model.slack - 1e-12), None)


def batch_floors(model: Throughput | None, fits: dict[float, int | None]) -> dict[float, int | None]:
    """Per group of options with the same host transfer Q (tokens; 0: resident weights) mapped to the largest
    micro-batch its options fit (None: none fits): the fewest sequences a plan of that group may use, so that its
    modeled throughput is within the slack of the best any group reaches; None where the group never is. Without
    a model: the largest micro-batch any group fits, for the groups that fit it."""
    fitting = {q: fit for q, fit in fits.items() if fit is not None}
    if model is None:
        top = max(fitting.values())
        return {q: (top if fits[q] == top else None) for q in fits}
    best = max(model.rate(fit, q) for q, fit in fitting.items())
    return {q: None if fits[q] is None else efficient_batch(model, fits[q], transfer=q, target=best) for q in fits}
