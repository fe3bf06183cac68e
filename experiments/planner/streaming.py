"""Weight streaming as a planner choice (``method.weight_offload=host``: ``hmt_core.streaming``,
docs/weight_streaming.md): the device bytes it frees, from the weights' shapes, and the PCIe transfer it adds to a
micro-batch, in the efficiency model's units.

Bytes. The streamed weights are the projected weights inside the decoder layers, W per layer (BF16: 2 bytes an
element; the 2-layer model's projected weights beyond the 1-layer model's; INT8, ``method.weight_dtype=int8``: their
codes and scales as ``prepare`` stores them, the 2-layer model's INT8 parameter bytes beyond the 1-layer model's less
the layer's unprojected part and the INT8 layers' one-element phantom weights). Resident at a phase's peak: every
layer's, L·W; streamed: at most ``RESIDENT_LAYERS[phase]`` layers' (forward and backward: the layer computing and
the one prefetched; the optimizer phase: the deferred writes fetch one weight at a time, counted as a layer). A
trace of 1-2 layers holds them all, so the delta is computed, not traced; ``verify=true`` checks it against the
full-depth dry run (Llama-3.1-8B, seq 2,048: 0.30 GiB of streamed weights at the forward peak and 0.70 in backward
against the model's 2·0.41 GiB; docs/weight_streaming.md).

Time. Per micro-batch W·(2L − 1)/L bytes cross to the device (forward; backward re-fetches all but the last layer)
and W back (each updated weight once), plus W more to the device when the update waits for the clipped norm (the
deferred writes fetch each weight again), the two directions at once. At ``pcie`` bytes/s that is τ seconds; a
micro-batch of T tokens computes for 6·N·(T + R)/F (``experiments.planner.efficiency``, R the ridge point), so the
copies hide behind compute only above Q = τ·F/(6·N) tokens: the micro-batch's time is max(T + R, Q) in token units,
with F the calibrated GPU's matmul rate or the datasheet peak (``peak_flops``, default an H100's): the most tokens
it asks for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from experiments.planner.costs import GIB, PHASES

DEFAULT_PCIE = 25e9  # bytes/s: PCIe 4.0 ×16 as measured in practice (32 GB/s theoretical)
DEFAULT_PEAK_FLOPS = 989e12  # FLOP/s: H100 SXM dense BF16 (NVIDIA datasheet), as efficiency.DEFAULT_RIDGE
RESIDENT_LAYERS = {"forward": 2, "backward": 2, "optimizer": 1, "probe": 2}
OFFLOADS = ("none", "host")


def layer_bytes(stats: dict, patterns: tuple[str, ...], weights: str = "bf16") -> int:
    """Bytes of one decoder layer's streamed weights: the projected 2-D weights (module name matching ``patterns``)
    the 2-layer model has beyond the 1-layer model (``experiments.planner.model.weight_stats``), in BF16, or as
    ``weights="int8"`` codes and scales (the layer's parameter bytes with INT8 weights less its unprojected part)."""
    one, two = stats["L1"]["weights"], stats["L2"]["weights"]
    added = [name for name in two if name not in one]
    streamed = [n for n in added if two[n][1] > 1 and any(re.search(p, n.removesuffix(".weight")) for p in patterns)]
    bf16 = 2 * sum(two[n][0] for n in streamed)
    if weights == "bf16":
        return bf16
    layer = {w: stats["L2"]["param_bytes"][w] - stats["L1"]["param_bytes"][w] for w in ("bf16", weights)}
    # each INT8 layer also holds its phantom weight (``hmt_core.int8_weights.linear``: one BF16 element), not streamed
    return bf16 + layer[weights] - layer["bf16"] - 2 * len(streamed)


def device_delta(stats: dict, layers: int, patterns: tuple[str, ...], weights: str = "bf16") -> dict[str, float]:
    """GiB per phase that streaming changes against the resident model (negative: freed)."""
    w = layer_bytes(stats, patterns, weights)
    return {p: (min(layers, RESIDENT_LAYERS[p]) - layers) * w / GIB for p in PHASES}


def trainable_params(stats: dict, layers: int) -> int:
    n1, n2 = (sum(n for n, _ in stats[k]["weights"].values()) for k in ("L1", "L2"))
    return n1 + (layers - 1) * (n2 - n1)


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """The PCIe time model (module docstring): ``pcie`` bytes/s, ``flops`` FLOP/s, ``params`` trainable elements."""

    pcie: float = DEFAULT_PCIE
    flops: float = DEFAULT_PEAK_FLOPS
    params: int

    def __post_init__(self) -> None:
        if not (self.pcie > 0 and self.flops > 0 and self.params > 0):
            raise ValueError(f"streaming time model: pcie_gb_per_s={self.pcie / 1e9:g}, peak_flops={self.flops:g} "
                             "(need > 0)")

    def seconds(self, stats: dict, layers: int, patterns: tuple[str, ...], *, deferred: bool,
                weights: str = "bf16") -> float:
        """τ: seconds of copies per micro-batch (the larger direction)."""
        w = layer_bytes(stats, patterns, weights) * layers
        into = w * (2 * layers - 1) / layers + (w if deferred else 0)
        return max(into, w) / self.pcie  # back: each updated weight once, in its hook or its deferred write

    def tokens(self, seconds: float) -> float:
        """Q: the tokens a micro-batch computes in ``seconds`` at ``flops`` (6 FLOPs per parameter and token)."""
        return seconds * self.flops / (6 * self.params)


@dataclass(frozen=True, kw_only=True)
class Streaming:
    """What a streamed option changes for one model: its bytes per phase and the transfer its micro-batch waits
    for. ``patterns``: the projected modules' (``method.attn_pattern``, ``method.mlp_pattern``); ``deferred``: the
    update waits for the clipped norm (``train.max_grad_norm`` > 0)."""

    patterns: tuple[str, ...]
    deferred: bool
    transfer: Transfer

    def delta(self, stats: dict, layers: int, weights: str = "bf16") -> dict[str, float]:
        return device_delta(stats, layers, self.patterns, weights)

    def seconds(self, stats: dict, layers: int, weights: str = "bf16") -> float:
        return self.transfer.seconds(stats, layers, self.patterns, deferred=self.deferred, weights=weights)

    def tokens(self, stats: dict, layers: int, weights: str = "bf16") -> float:
        return self.transfer.tokens(self.seconds(stats, layers, weights))


def streaming_model(run, planner: dict, cal: dict, stats: dict, layers: int) -> Streaming:
    """The streaming model of ``run``: ``pcie_gb_per_s`` (default 25) and ``peak_flops`` (default: the calibrated
    GPU's matmul rate, else an H100's datasheet peak) from the planner keys."""
    measured = cal.get("device", "cpu") != "cpu"
    flops = float(planner.get("peak_flops", cal["flops_per_s"] if measured else DEFAULT_PEAK_FLOPS))
    transfer = Transfer(pcie=float(planner.get("pcie_gb_per_s", DEFAULT_PCIE / 1e9)) * 1e9, flops=flops,
                        params=trainable_params(stats, layers))
    return Streaming(patterns=(run.method.attn_pattern, run.method.mlp_pattern),
                     deferred=bool(run.train.max_grad_norm), transfer=transfer)


def micro_batch_time(s: Streaming, stats: dict, layers: int, tokens: int, ridge: float, *, streamed: bool,
                     weights: str = "bf16") -> dict:
    """The modeled seconds of one micro-batch of ``tokens``: the roofline's compute at ``s.transfer.flops``,
    6·N·(T + R)/F (``experiments.planner.efficiency``), and for a streamed plan the copies it waits for (its
    ``weights``: bf16 | int8); with the host bytes and the model's constants (every plan's record: resident and
    streamed plans compare by it)."""
    t = s.transfer
    compute = 6 * t.params * (tokens + ridge) / t.flops
    out = {"tokens": tokens, "compute_s": compute, "micro_batch_s": compute, "us_per_token": 1e6 * compute / tokens,
           "peak_flops": t.flops, "params": t.params, "ridge_flop_per_byte": ridge, "streamed": streamed}
    if streamed:
        copies = s.seconds(stats, layers, weights)
        out.update(host_gib=layer_bytes(stats, s.patterns, weights) * layers / GIB, pcie_gb_per_s=t.pcie / 1e9,
                   weights=weights, transfer_s=copies, hidden_from_tokens=s.tokens(stats, layers, weights),
                   deferred=s.deferred,
                   micro_batch_s=max(compute, copies), us_per_token=1e6 * max(compute, copies) / tokens)
    return out


def describe(rec: dict) -> str:
    """The plan table's ``weights`` row of a streamed plan (``micro_batch_time``'s record)."""
    kind = "INT8 (codes + scales)" if rec.get("weights") == "int8" else "BF16"
    return (f"{kind} decoder weights streamed from the host (method.weight_offload=host): {rec['host_gib']:.2f} GiB "
            f"there; {rec['transfer_s']:.2f} s of copies per micro-batch at {rec['pcie_gb_per_s']:g} GB/s "
            f"(pcie_gb_per_s), hidden behind compute from {rec['hidden_from_tokens']:,.0f} tokens a micro-batch "
            f"(this one: {rec['tokens']:,}); modeled micro-batch {rec['micro_batch_s']:.2f} s against "
            f"{rec['compute_s']:.2f} s of compute at {rec['peak_flops'] / 1e12:.0f} TFLOP/s")
