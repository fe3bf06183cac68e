"""HMT's cells of the capacity table (``experiments.planner.capacity``): the planner's verified plans.

Per GPU size: ``experiments.planner.plan.plan_with`` with ``verify=true`` at ``train.seq_len`` (a verification miss
corrects the cost model by what was measured and solves again), then the leanest choice one sequence further traced
at full size (``next_batch``): exact when it is over. When not one sequence fits, the longest multiple of
``SEQ_STEP`` tokens instead: a bracket (``experiments.planner.bracket``) over sequence lengths, each length one
verified planner answer, started from the excess measured at ``train.seq_len`` and the leanest choice's predicted
bytes per ``SEQ_STEP`` tokens.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from experiments.memory.gpu_allowance import reserve_bytes, step_bytes
from experiments.planner.bracket import MAX_VERIFY, SEQ_STEP, bracket
from experiments.planner.costs import GIB
from experiments.planner.milp import leanest, min_peak
from experiments.planner.model import build_problem
from experiments.planner.plan import NoPlan, model_label, plan_nodes, plan_with, prepare, verify_plan, write_plan_yaml
from experiments.planner.report import run_command


def hmt_capacity(run, planner: dict, sizes, *, log=print) -> dict:
    """Cells (GPU size → entry) of HMT's row: each the planner's verified plan, searched as the module says."""
    results = Path(run.results_dir).expanduser() / "capacity"
    # the table's question is the most tokens a card holds: the largest micro-batch, not an efficient one
    planner = {**planner, "plan_dir": planner.get("plan_dir") or str(results / "plans"), "verify": True,
               "efficiency_slack": 0.0}
    planner.pop("budget_gib", None)
    prep = prepare(run, planner, log=log)
    out = {}
    for size in sizes:
        if size < prep.floor_gib:
            out[str(size)] = {"fits": False, "tokens": 0, "batch_size": 0, "seq_len": 0,
                              "note": f"below the weights' floor {prep.floor_gib:.2f} GiB"}
            continue
        out[str(size)] = entry = hmt_cell(prep, planner, run, size, results, log)
        log(f"  hmt @ {size} GiB: {entry['tokens']:,} tokens ({entry.get('traces', 0)} full traces)")
    return out


def hmt_cell(prep, planner: dict, run, size: int, results: Path, log) -> dict:
    name = f"capacity-{model_label(run)}-s{run.train.seq_len}-{size}gib"
    try:
        rec = plan_with(prep, planner, size, name=name, record_dir=results / "plans", log=log)
    except NoPlan as miss:  # not one sequence
        return shortened_cell(prep, planner, run, size, name, results, miss, log)
    entry = cell_entry(rec)
    if entry["fits"] and rec.get("leanest_over_batch") == entry["batch_size"] + 1:
        entry.update(exact=True, next_traces=0)  # the plan's own search traced one sequence more over
    elif entry["fits"]:
        entry.update(next_batch(prep, planner, run, size, entry["batch_size"] + 1, name, results, log))
    return entry


def cell_entry(rec: dict) -> dict:
    v = rec["verified"]
    return {"fits": bool(v and v["fits"]), "batch_size": rec["choice"]["batch_size"], "seq_len": rec["seq_len"],
            "tokens": rec["choice"]["tokens_per_micro_batch"],
            "verified_peak_gib": v.get("step_bytes", v["verdict_peak_bytes"]) / GIB if v else None,
            "traces": len(rec["iterations"]), "plan": rec["choice"]["optimizer_label"],
            "activation": rec["choice"]["activation"], "layer_recompute": rec["choice"]["layer_recompute"],
            "run_command": rec["run_command"]}


def shortened_cell(prep, planner: dict, run, size: int, name: str, results: Path, miss: NoPlan, log) -> dict:
    """The longest multiple of ``SEQ_STEP`` tokens (below ``train.seq_len``, which ``miss`` put over by
    ``miss.excess_gib``) whose verified plan fits at one sequence. A length at which the planner, its model corrected
    by its traces, has no choice left counts as over; the cell is exact when the length one ``SEQ_STEP`` longer
    was traced over (its leanest choice, like ``next_batch``'s)."""
    seq, step_budget = run.train.seq_len, size - reserve_bytes(run) / GIB
    top = -(-seq // SEQ_STEP)  # train.seq_len, rounded up to steps: over
    per_step = max(lean_gib(prep, size, seq) - lean_gib(prep, size, seq - SEQ_STEP), 1e-9)  # GiB per SEQ_STEP
    recs, traced_over = {}, {top} if miss.traced else set()

    def over(x: int) -> float:
        try:
            recs[x] = rec = plan_with(prep, planner, size, seq_len=x * SEQ_STEP, name=f"{name}-seq{x * SEQ_STEP}",
                                      record_dir=results / "plans", log=log)
        except NoPlan as e:
            if e.traced:
                traced_over.add(x)
            return e.excess_gib
        return rec["verified"]["step_bytes"] / GIB - step_budget

    def step_down(x: int, excess: float) -> int:
        return x - math.ceil(excess / per_step) if math.isfinite(excess) else 1

    lo, hi, lengths = bracket(over, max(1, step_down(top, miss.excess_gib)), step_down, hi=top)
    if lo < 1:
        return {"fits": False, "tokens": 0, "batch_size": 0, "seq_len": 0, "note": "no plan fits",
                "lengths_tried": lengths, "exact": False}
    return {**cell_entry(recs[lo]), "lengths_tried": lengths,
            "exact": hi is not None and hi == lo + 1 and hi in traced_over}


def lean_gib(prep, size: int, tokens: int) -> float:
    """The leanest choice's predicted peak (GiB) at one sequence of ``tokens`` (costs scaled per token)."""
    return min_peak(build_problem(prep.costs, space=prep.space, record=prep.record, stats=prep.stats,
                                  flops=prep.flops, cal=prep.cal, budget_gib=float(size), llama=prep.llama,
                                  seq_scale=tokens / prep.record["seq_len"], streaming=prep.streaming))


def next_batch(prep, planner: dict, run, size: int, batch: int, name: str, results: Path, log,
               max_traces: int = MAX_VERIFY - 1) -> dict:
    """Sequences beyond the plan's ``batch − 1``: the choice with the least predicted peak at ``batch`` sequences,
    traced at full size, then at ``batch + 1``, … while it fits (at most ``max_traces``). The first that is over
    makes the answer exact (the leanest choice by the measured costs does not fit one more sequence); the last that
    fits is the answer (``exact`` false when the traces ran out first)."""
    prob = build_problem(prep.costs, space=prep.space, record=prep.record, stats=prep.stats, flops=prep.flops,
                         cal=prep.cal, budget_gib=float(size), llama=prep.llama, streaming=prep.streaming)
    plan_dir, budget, out = Path(planner["plan_dir"]).resolve(), size - reserve_bytes(run) / GIB, {"exact": False}
    for _ in range(max_traces):
        sol = leanest(dataclasses.replace(prob, fixed_batch=batch))
        lean = f"{name}-lean-b{batch}"
        write_plan_yaml(plan_dir / f"{lean}.yaml", plan_nodes(run, sol, prep.space, planner.get("_overrides", ())),
                        [f"The leanest choice at {batch} sequences (capacity check of {name})"])
        log(f"capacity: the leanest choice at {batch} sequences, traced at full size ...")
        summary = verify_plan(lean, plan_dir, results / "plans" / lean)
        peak = step_bytes(summary["dryrun"], run) / GIB
        log(f"capacity: {batch} sequences need {peak:.3f} GiB ({'fits' if peak <= budget else 'over'} "
            f"{budget:.2f})")
        out["next_traces"] = out.get("next_traces", 0) + 1
        if peak > budget:
            return {**out, "exact": True, "next_peak_gib": peak}
        out.update(batch_size=batch, tokens=batch * run.train.seq_len, verified_peak_gib=peak,
                   plan=sol.option.payload.label(), activation=sol.actions, layer_recompute=sol.layer_recompute,
                   run_command=run_command(lean, plan_dir))
        batch += 1
    return out
