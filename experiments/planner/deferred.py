"""An upper bound on HMT Mode A's optimizer-phase peak past the traced depths, when clipping defers the updates.

Why a bound is needed. With ``train.max_grad_norm`` set, every projected weight's low-rank update waits for the
global norm (``hmt_core.optim.hooks``: ``deferred_low``). ``finish_step`` then runs Adam over all of them at once
(``hmt_core.optim.grouped.update_low_rank_many``), so for every projected weight of every layer three fp32 tensors
of Ĝ's shape are alive together: the accumulated Ĝ (``pending``), its clipped copy (``torch._foreach_mul``) and
Adam's direction. The dense weights' gradients wait too; their grouped update (``update_dense_many``) holds the
same three fp32 temporaries per element once the low-rank ones are freed. At 1 and 2 layers another event of the
phase can be larger (the dense embedding/head update), and then the line through the traced peaks has only the
resident slope and misses the deferred event at depth (Llama-3.2-3B, 28 layers: 6.84 GiB on the line, 9.13
traced; docs/planner.md, "Depth").

Per layer the deferred event grows by
- the resident bytes (weights and optimizer state, alive in every event of the phase),
- T = 12 bytes per Ĝ element (three fp32 tensors) + 16 bytes per dense element (a gradient of at most 4 bytes
  and three fp32 temporaries; the layer norms, a few KiB a layer),
- and the grouped Adam's own temporaries (fp32 moments, numerators, denominators: 16 bytes per element of a
  group's directions). These grow with a group's slots only until its directions reach a quarter of a row chunk
  (``hmt_core.precision.chunk_budget``), so they add at most min(one chunk, 16 × the layers' Ĝ elements at L
  layers). A 12-layer model of hidden size 128 grows them from 2 to 6 layers by more than T. A weight outside the
  layers (the LM head) adds the same at every depth.

The bound. The deferred event at 2 layers is at most the traced peak there, so at L layers it is at most
peak(2) + (L − 2) × (resident slope + T) + the grouped temporaries' growth. Over the line this adds
(L − 2) × max(0, resident slope + T − the peak's slope) plus that growth. It is exact (zero added) where the
deferred event already was the traced peak (its slope is the line's), and otherwise an upper bound: how far the
deferred event at 2 layers lies below the traced peak, no sample shows.
"""

from __future__ import annotations

from collections.abc import Mapping

from hmt_core.precision import CHUNK_BYTES, CUDA_CHUNK_BYTES

GIB = 2**30
DEFERRED_COPIES = 3  # fp32 tensors of Ĝ's shape per projected weight, alive together (module docstring)
FP32 = 4
ADAM_TEMPS = 4  # fp32 tensors per element of a group's directions in adam_step_many: moments in fp32, num, den


def low_numel(numel: int, smaller_side: int, rank: int, sides: str) -> int:
    """Elements of Ĝ for a weight of ``numel`` elements whose smaller side is ``smaller_side``, at ``rank``:
    (r, r) two-sided, else the smaller side projected (``hmt_core.projection.which_sides``): r × the larger side."""
    if sides == "two_sided":
        return rank * rank
    return rank * (numel // smaller_side)


def low_elements(ranks: Mapping[str, int], weights: Mapping[str, list[int]], sides: str) -> int:
    """Ĝ elements of the projected weights in ``ranks`` (name -> rank held); ``weights``: name -> [elements,
    smaller side] (``experiments.planner.model.weight_stats``)."""
    return sum(low_numel(*weights[n], r, sides) for n, r in ranks.items() if n in weights)


def deferred_bytes(ranks: Mapping[str, int], weights: Mapping[str, list[int]], sides: str) -> int:
    """Bytes the deferred updates may hold beyond the resident ones: the low-rank temporaries of the projected
    weights in ``ranks`` (name -> rank held), and for every other trainable weight its gradient and the same three
    fp32 temporaries of the dense grouped update (``update_dense_many``, after the low-rank ones are freed).
    ``weights``: name -> [elements, smaller side] (``experiments.planner.model.weight_stats``)."""
    low = low_elements(ranks, weights, sides)
    dense = sum(numel for n, (numel, _) in weights.items() if n not in ranks)
    return DEFERRED_COPIES * FP32 * low + (DEFERRED_COPIES + 1) * FP32 * dense


def deferred_settings(run) -> dict | None:
    """What the bound needs of ``run`` (a ``RunConfig``): the projection sides and the row chunk's bytes of the
    traced device; None when clipping is off (every update is applied in backward: nothing deferred)."""
    if not run.train.max_grad_norm:
        return None
    return {"sides": run.method.sides,
            "chunk_bytes": CUDA_CHUNK_BYTES if run.dryrun.device == "cuda" else CHUNK_BYTES}


def deferred_excess_gib(record: dict, stats: dict, name: str, layers: int) -> float:
    """GiB to add to the optimizer phase of the Mode A sample ``name`` at ``layers`` decoder layers (module
    docstring); 0 when updates are not deferred (``record["deferred"]`` None or absent: ``deferred_settings``)
    or the sample was not traced at 1 and 2 layers at the main micro-batch."""
    deferred = record.get("deferred")
    b_a = record["segments"][-1][1]
    sample = record["samples"].get(name, {})
    one, two = sample.get(f"L1b{b_a}"), sample.get(f"L2b{b_a}")
    if deferred is None or one is None or two is None or layers <= 2:
        return 0.0
    sides = deferred["sides"]
    resident = (two["params"] + two["optimizer_state"]) - (one["params"] + one["optimizer_state"])
    temps = (deferred_bytes(two["ranks"], stats["L2"]["weights"], sides)
             - deferred_bytes(one["ranks"], stats["L1"]["weights"], sides))
    slope = two["optimizer"] - one["optimizer"]
    per_layer = (low_elements(two["ranks"], stats["L2"]["weights"], sides)
                 - low_elements(one["ranks"], stats["L1"]["weights"], sides))
    grouped = min(deferred["chunk_bytes"], ADAM_TEMPS * FP32 * layers * per_layer)  # the layers' slots only
    return ((layers - 2) * max(0, resident + temps - slope) + grouped) / GIB
