"""A full-depth model's live bytes from two shallow traces: each phase's peak is affine in the number of decoder layers.

A decoder-only model is an embedding, L identical decoder layers and a final norm + LM head. For a method whose
per-layer state does not depend on the depth (AdamW) every decoder layer holds the same parameters, gradients and
optimizer state, saves the same activations and allocates the same workspaces in the same order; each phase's peak (forward, backward, optimizer, and the activation probe's) is a
maximum over events whose bytes are affine in L. Measured on Llama, Qwen2 and Gemma 2 shapes: the line through the
1- and 2-layer traces is not always exact (a checkpointed Llama's backward peak adds 4.84 MB from 1 to 2 layers,
6.16 MB from 2 to 3 and 6.33 MB per layer from 3 on: with fewer than three layers the first, the last and a middle
layer are not all distinct), while from three layers on every phase grows by the same bytes per layer. So
``scaled_live`` takes the line through the 3- and 4-layer traces: P(L) = P(3) + (L − 3)·(P(4) − P(3)), equal to the
full trace's bytes (``tests/test_plan_scaling.py``, to the byte, against full-depth traces of all three shapes).
A maximum of affine functions is convex in L: events with a larger per-layer slope but a smaller constant term
could overtake at a depth beyond the traced ones, which small-model tests do not exclude; one card was checked at
its own depth (Qwen2.5-0.5B, 24 layers, AdamW with checkpointing, 4 × 2048 tokens: exact to the byte).

Where it is not exact (measured with the same small models at 7 layers): HMT in Mode A, whose state budget is
spread over the layers by its rank allocator, so a layer's state depends on the depth (the optimizer phase's
increment per layer varies by up to 1 MB); GaLore at rank 16 on the Llama shape, whose optimizer phase the line
puts 92,160 bytes below the full trace (its Qwen2 and Gemma 2 shapes were exact). The test covers AdamW only.

What does not scale: the caching allocator's predicted reserved bytes (``experiments.memory.allocator_model``; the
``dryrun.reserve=modeled`` verdict). Fragmentation makes its slack beyond the live peak erratic in depth (measured
in docs/planner.md), so a reserved-bytes verdict needs the full-depth trace; ``scaled_live`` answers only for the
live peak.
"""

from __future__ import annotations

import dataclasses

from experiments.config import RunConfig
from experiments.planner.costs import PHASES, STEP_PHASES, layer_variants, lin, target_layers, trace_sample


SHALLOW = (3, 4)  # the depths traced (module docstring)


def scaled_live(run: RunConfig, *, layers: int | None = None) -> dict:
    """``run``'s live peaks per phase (bytes) at ``layers`` decoder layers (default: its own depth), from traces of
    the same model with ``SHALLOW`` layers (a model no deeper is traced as it is): ``{"forward", "backward", "optimizer", "probe", "peak",
    "verdict_peak_bytes"}`` (the probe None when the run has no activation policy); ``peak`` is the largest
    phase's, as the meter's own peak is."""
    depth = layers or target_layers(run)
    lo, hi = SHALLOW
    with layer_variants(run) as with_layers:
        if depth <= hi:
            one = two = trace_sample(with_layers(depth))
            lo, hi = depth, depth + 1
        else:
            one, two = trace_sample(with_layers(lo)), trace_sample(with_layers(hi))
    out: dict = {p: None if one[p] is None or two[p] is None else int(lin(one[p], two[p], depth - lo + 1))
                 for p in PHASES}
    out["peak"] = max(out[p] for p in STEP_PHASES)  # each phase is affine in L, their maximum is not
    out["verdict_peak_bytes"] = max(out["peak"], out["probe"] or 0)
    return out


def at_batch(run: RunConfig, batch: int, seq_len: int) -> RunConfig:
    return dataclasses.replace(run, train=dataclasses.replace(run.train, batch_size=batch, seq_len=seq_len))
