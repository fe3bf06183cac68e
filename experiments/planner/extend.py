"""The cost samples an answer needs beyond the committed ones: the reference and the chosen activation choices traced
at the micro-batches around the answer (``extend``), so the planner (``plan_with``) never answers from a line
extrapolated past its measurements.

A phase's peak is a maximum over events affine in the micro-batch b, so it is convex in b: a secant between two
traced micro-batches bounds it from above between them and from below outside (``experiments.planner.segments``).
The table holds the reference up to ``MAX_TOKENS`` tokens and each activation choice's delta only on the main pair
(b_a, b_b); past them the planner's lines are optimistic, by much where one event overtakes another there (a tied
model with a large vocabulary under full layer recomputation: the fused loss's static logits chunk, then a
recomputed layer's per-sequence bytes; docs/planner.md, "Micro-batches past the traced ones"). ``extend`` traces,
for a solution at b sequences, the reference at the doublings past its top up to b and each of the solution's
activation samples at every doubling from b_a up to there (at the sample's own depths);
``experiments.planner.costs.derive`` then holds a line per pair of neighbouring doublings, with each choice's delta
on it, so the answer's prediction is the secant of its own piece. The optimizer and vocabulary samples stay static
deltas measured at b_a (measured constant in b for Qwen2.5-0.5B's chosen option, not in general). The extra samples
are cached as every cost sample, in the user's cache (``--table`` does not trace them).
"""

from __future__ import annotations

import math
import time

from experiments.planner.cache import entry_key
from experiments.planner.costs import (
    trace_missing,
    act_pieces,
    base_choice,
    derive,
    families,
    layer_variants,
    sample_depths,
    sample_run,
)
from experiments.planner.problem import KEEP, Solution


def used_samples(sol: Solution) -> list[str]:
    """The activation samples whose deltas ``sol``'s prediction adds to the reference."""
    names = [f"act:{c}:{a}" for c, a in sol.actions.items() if a != KEEP]
    if sol.actions.get("attn_qkv") == "recompute":
        names.append("act:attn_core:recompute")
    if sol.layer_recompute:
        names.append("act:layer_recompute")
        if sol.layer_codec != KEEP:
            names.append(f"act:layer_recompute:{sol.layer_codec}")
    return names


def extension(record: dict, sol: Solution, batch: int) -> tuple[list[list[int]], list[tuple[str, int, int]]]:
    """(the reference's new lines, the (sample, layers, micro-batch) points missing) for ``sol`` at ``batch``
    sequences of the record's length."""
    segments, samples = record["segments"], record["samples"]
    start, b_a, _ = segments[-1]
    top = max(b for _, *bs in segments for b in bs)
    new_lines, upper = [], top
    while upper < batch:
        new_lines.append([start, upper, 2 * upper])
        upper *= 2
    ref_batches = sorted({b for _, *bs in [*segments, *new_lines] for b in bs})
    upper = min(b for b in ref_batches if b >= min(batch, upper))  # the doubling closing ``batch``'s piece
    points = [("ref", n, b) for b in ref_batches if b > top for n in (1, 2)]
    for name in used_samples(sol):
        points += [(name, n, b) for b in ref_batches if b_a <= b <= upper for n in sample_depths(name)
                   if f"L{n}b{b}" not in samples.get(name, {})]
    return new_lines, points


def extend(prep, sol: Solution, *, seq_scale: float = 1.0, log=print) -> bool:
    """Trace what ``sol`` needs (``extension``) into ``prep.record`` (and ``prep.table``, as it is measured) and
    re-derive ``prep.costs``; False when nothing was missing. ``seq_scale``: ``sol``'s sequences are this many
    times the record's."""
    new_lines, points = extension(prep.record, sol, math.ceil(sol.batch * seq_scale))
    if not points:
        return False
    run, space, llama = prep.run, prep.space, prep.llama
    base_opt = base_choice(*families(space)[0], space)
    changes = act_pieces(space, llama)
    start = time.perf_counter()
    table, workers = prep.table, prep.workers
    log(f"costs: {sol.batch} sequences lie past the micro-batches {', '.join(sorted({n for n, *_ in points}))} "
        f"were traced at: {len(points)} more samples ...")
    with layer_variants(run) as with_layers:
        keyed = {}
        for name, layers, batch in points:
            r = sample_run(run, with_layers, layers, batch, base_opt, changes.get(name, {}), llama)
            keyed[entry_key(layers, batch, r.method, r.activation)] = (name, layers, batch, r)
        found = {key: table.get(key) for key in keyed}
        missing = {key: point for key, point in keyed.items() if found[key] is None}
        traced = trace_missing(run, table, missing, found, workers=workers, log=log, start=start)
    for key, (name, layers, batch, _) in keyed.items():
        prep.record["samples"].setdefault(name, {})[f"L{layers}b{batch}"] = found[key]
    prep.record["segments"][-1:-1] = new_lines  # the main line stays last
    prep.record["traces"] += traced
    prep.record["cached"] += len(points) - traced
    prep.costs = derive(prep.record, prep.layers)
    log(f"costs: {len(points) - traced} of {len(points)} from the cost table, {traced} traced in "
        f"{time.perf_counter() - start:.0f} s")
    return True
