"""The planner's record and its printed table: what ``experiments.plan`` writes to ``<results_dir>/plan/<name>.json``
(schema ``hmt-plan/1``: the choice, predicted and verified peaks, every verification iteration, the costs' key and
the calibration) and renders as the Markdown table it prints (and the README shows)."""

from __future__ import annotations

from pathlib import Path

from experiments.gpu_allowance import reserve_bytes, reserve_label, step_bytes
from experiments.plan_costs import GIB, PHASES, STEP_PHASES

SCHEMA = "hmt-plan/1"


def model_label(run) -> str:
    return Path(run.model.path).name if run.model.path else run.model.name


def run_command(name: str, plan_dir) -> str:
    search = f" hydra.searchpath=[file://{plan_dir}]" if plan_dir is not None else ""
    return f"python -m experiments.run{search} +plan={name}"


def plan_record(run, sol, summary, *, command, name, plan_path, plan_dir, budget, floor, iterations, cal, record,
                costs) -> dict:
    choice = sol.option.payload
    ctx = reserve_bytes(run) / GIB
    verified = None
    if summary is not None:
        mem, d = summary["memory"], summary["dryrun"]
        verified = {"verdict_peak_bytes": d["verdict_peak_bytes"], "verdict_peak_from": d["verdict_peak_from"],
                    "peak_bytes": mem["peak_bytes"], "peak_by_phase_bytes": mem["peak_by_phase_bytes"],
                    "peak_by_category_bytes": mem["peak_by_category_bytes"],
                    "probe_peak_bytes": (summary.get("activation_summary") or {}).get("probe_peak_bytes"),
                    "step_bytes": step_bytes(d, run), "fits": step_bytes(d, run) <= (budget - ctx) * GIB,
                    "run_id": summary["run_id"],
                    "wall_s": d["wall_s"]}
    return {"schema": SCHEMA, "name": name, "plan_file": str(plan_path), "command": list(command),
            "model": model_label(run), "layers": costs.layers, "seq_len": run.train.seq_len, "budget_gib": budget,
            "reserve_gib": ctx, "reserve": reserve_label(run), "floor_gib": floor,
            "choice": {"batch_size": sol.batch, "tokens_per_micro_batch": sol.batch * run.train.seq_len,
                       "grad_accum": run.train.grad_accum, "optimizer": choice.__dict__, "optimizer_label": choice.label(),
                       "activation": sol.actions, "layer_recompute": sol.layer_recompute},
            "energy": sol.energy, "extra_time_s_per_micro_batch": sol.time,
            "predicted_gib": sol.predicted, "iterations": iterations, "verified": verified,
            "keep_saved_gib": costs.keep_saved, "costs_key": record["key"],
            "traces": sum(len(v) for v in record["samples"].values()), "calibration": cal,
            "run_command": run_command(name, plan_dir)}


def render_plan(rec: dict) -> str:
    """The plan as a Markdown table (printed, and pasted into the README)."""
    c, v = rec["choice"], rec["verified"]
    reserve = rec.get("reserve_gib", rec.get("cuda_context_gib"))  # records before the GPU allowance: the flat one
    o = c["optimizer"]
    gib = lambda x: "—" if x is None else f"{x:.2f}"
    acts = c["activation"]
    if c["layer_recompute"]:
        policy = "full layer recomputation" + "".join(f", {k} {a}" for k, a in acts.items()
                                                      if a != "keep" and k in ("norm", "lm_head"))
    else:
        policy = ", ".join(f"{k} {a}" for k, a in acts.items() if a != "keep") or "keep everything"
    ranks = "1 (APOLLO-Mini: tensor scaling, scale 128, random basis)" if o["mode"] == "B" else \
        f"method.state_budget={o['budget']:g} (of AdamW's state); HMT's allocator picks per-layer ranks in it"
    rows = [
        ("budget", (f"{rec['budget_gib']:g} GiB = {rec['budget_gib'] - reserve:.2f} for the step + {reserve:.2f} "
                    f"{rec.get('reserve', 'CUDA context')} (floor: weights + it = {rec['floor_gib']:.2f})")),
        ("micro-batch", (f"{c['batch_size']} × {rec['seq_len']} = {c['tokens_per_micro_batch']:,} tokens "
                         f"(train.grad_accum={c['grad_accum']} sets the tokens per optimizer step)")),
        ("optimizer", f"Mode {o['mode']}, {o['dtype']} state, lm_head {'projected' if o['head'] else 'dense'}"
                      + (", dense weights bitsandbytes 8-bit AdamW" if o["dense_8bit"] else "")
                      + (", INT8 projected weights" if o["weights"] == "int8" else "")),
        ("ranks", ranks),
        ("retained gradient energy (bound)", f"{rec['energy']:.4f}"),
        ("activations", policy),
        ("extra step time (model)", (f"{rec['extra_time_s_per_micro_batch']:.3g} s per micro-batch "
                                     f"({rec['calibration'].get('device', '?')} calibration)")),
        ("predicted peak (GiB)", ", ".join(f"{p} {gib(rec['predicted_gib'].get(p))}" for p in PHASES)),
    ]
    if v is not None:
        rows.append(("verified dry run (GiB)", f"peak {v['verdict_peak_bytes'] / GIB:.2f} (from the "
                     f"{v['verdict_peak_from']}; " + ", ".join(f"{p} {v['peak_by_phase_bytes'][p] / GIB:.2f}"
                                                               for p in STEP_PHASES)
                     + (f", probe {v['probe_peak_bytes'] / GIB:.2f}" if v["probe_peak_bytes"] else "")
                     + f") — {'fits' if v['fits'] else 'DOES NOT FIT'}"))
    rows.append(("run it", f"`{rec['run_command']}`"))
    return "\n".join(["| plan | " + rec["name"] + " |", "|---|---|", *(f"| {k} | {x} |" for k, x in rows)])
