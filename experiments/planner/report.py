"""The planner's record, where its plans go, and its printed table: ``experiments.planner.plan`` writes
``<results_dir>/plans/<name>.yaml`` (the run configuration, a Hydra ``_global_`` config of the group ``plans``) and
``<name>.json`` (schema ``hmt-plan/1``: the choice, predicted and verified peaks, every verification iteration, the
costs' key and the calibration) and renders the record as the Markdown table it prints."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from experiments.errors import UserError

from experiments.memory.gpu_allowance import reserve_bytes, reserve_label, step_bytes
from experiments.planner.costs import GIB, PHASES, STEP_PHASES
from experiments.planner.learning import describe
from experiments.planner.prices import describe as describe_prices
from experiments.planner.streaming import describe as describe_streaming

SCHEMA = "hmt-plan/1"


def model_label(run) -> str:
    return Path(run.model.path).name if run.model.path else run.model.name


REPO = Path(__file__).resolve().parents[2]
TRACKED = (REPO / "experiments", REPO / "results" / "plan")


def plans_dir(results_dir: str, plan_dir: str | None) -> Path:
    """The folder plans are written to: ``plan_dir`` or ``<results_dir>/plans`` (created when written); never the
    repository's tracked configs or committed plans. Its name is the Hydra group the run command selects."""
    folder = Path(plan_dir or Path(results_dir) / "plans").expanduser().resolve()
    for tracked in TRACKED:
        if folder == tracked or tracked in folder.parents:
            raise UserError(f"plan_dir={folder}: plans are not written into the tracked {tracked.relative_to(REPO)}/ "
                            "(choose a folder of your own, e.g. the default <results_dir>/plans)")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", folder.name):
        raise UserError(f"plan_dir={folder}: its last folder name {folder.name!r} is the config group the run selects "
                        "(+<group>=<plan>): letters, digits and _ only")
    return folder


def run_command(name: str, folder, *, dryrun: bool = False) -> str:
    """``python -m experiments.run`` with the plan ``folder/<name>.yaml`` (``folder=None``: a committed
    ``experiments/conf/plan/`` plan); ``dryrun``: the same configuration only traced (``mode=dryrun``)."""
    folder = None if folder is None else Path(folder)
    select = f"+plan={name}" if folder is None else f"hydra.searchpath=[file://{folder.parent}] +{folder.name}={name}"
    return f"python -m experiments.run {select}" + (" mode=dryrun" if dryrun else "")


def plan_record(run, sol, summary, *, command, name, plan_path, plan_dir, budget, floor, iterations, cal, record,
                costs, train_note: str, elapsed_s: float) -> dict:
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
                       "grad_accum": run.train.grad_accum, "optimizer": {  # offload only where streamed
                           k: x for k, x in dataclasses.asdict(choice).items() if (k, x) != ("offload", "none")},
                       "optimizer_label": choice.label(), "activation": sol.actions,
                       "layer_recompute": sol.layer_recompute, "layer_codec": sol.layer_codec},
            "energy": sol.energy, "extra_time_s_per_micro_batch": sol.time,
            "predicted_gib": sol.predicted, "iterations": iterations, "verified": verified,
            "keep_saved_gib": costs.keep_saved, "costs_key": record["key"],
            "traces": record["traces"], "cached_samples": record["cached"], "calibration": cal,
            "run_command": run_command(name, plan_dir), "dryrun_command": run_command(name, plan_dir, dryrun=True),
            "train_note": train_note, "elapsed_s": elapsed_s}


def vocab_row(v: dict | None) -> str:
    """The input embedding's and LM head's settings as the plan sets them (``method.*`` overrides)."""
    v = v or {"embedding_dtype": "bf16", "embedding_update": "dense", "head_update": "dense"}  # older records
    parts = [("INT8" if v["embedding_dtype"] == "int8" else "BF16") + " embedding and lm_head",
             {"dense": "embedding updated densely", "lazy_exact": "embedding updated by its touched rows (exact)",
              "sparse_adam": "embedding updated by its touched rows (SparseAdam's rule)"}[v["embedding_update"]],
             "lm_head updated inside the fused loss" if v["head_update"] == "in_loss" else "lm_head updated densely"]
    keys = " ".join(f"method.{k}={x}" for k, x in v.items())
    return f"{', '.join(parts)} ({keys})"


def micro_batch_note(m: dict | None, batch: int) -> str:
    """Why this micro-batch: the largest that fits and the modeled throughput kept (``experiments.planner.efficiency``)."""
    if not m or not m.get("fits_up_to"):
        return ""
    model = m["model"]
    return (f"; up to {m['fits_up_to']} fit, this one keeps {m['relative_throughput']:.1%} of the largest's modeled "
            f"throughput (ridge {model['ridge']:.0f} FLOP/byte, efficiency_slack={model['slack']:g})"
            + (": the memory left goes to choices that cost less loss" if m["fits_up_to"] > batch else ""))


def learning_rows(rec: dict) -> list[tuple[str, str]]:
    """The plan table's rows on learning: the check's verdict, the settings not offered, the rate written."""
    rows = [("learning check", describe(rec["learning_check"]))] if "learning_check" in rec else []
    if rec.get("not_offered"):
        rows.append(("not offered", "failed the learning check (results/plan_learns): " + "; ".join(rec["not_offered"])))
    if r := rec.get("recipe"):
        rows.append(("learning rate", f"method.lr={r['lr']:g}, train.warmup_steps={r['warmup_steps']} of "
                                      f"{r['steps']} steps ({r['source']})"))
    return rows


def render_plan(rec: dict) -> str:
    """The plan as a Markdown table (printed, and pasted into docs/planner.md)."""
    c, v = rec["choice"], rec["verified"]
    reserve = rec.get("reserve_gib", rec.get("cuda_context_gib"))  # records before the GPU allowance: the flat one
    o = c["optimizer"]
    gib = lambda x: "—" if x is None else f"{x:.2f}"
    acts = c["activation"]
    if c["layer_recompute"]:
        codec = c.get("layer_codec", "keep")
        coded = f" (layer inputs {codec}: activation.residual={codec})" if codec != "keep" else ""
        policy = "full layer recomputation" + coded + "".join(f", {k} {a}" for k, a in acts.items()
                                                      if a != "keep" and k in ("norm", "lm_head"))
    else:
        policy = ", ".join(f"{k} {a}" for k, a in acts.items() if a != "keep") or "keep everything"
    ranks = "1 (APOLLO-Mini: tensor scaling, scale 128, random basis)" if o["mode"] == "B" else \
        f"method.state_budget={o['budget']:g} (of AdamW's state); HMT's allocator picks per-layer ranks in it"
    rows = [
        ("budget", (f"{rec['budget_gib']:g} GiB = {rec['budget_gib'] - reserve:.2f} for the step + {reserve:.2f} "
                    f"{rec.get('reserve', 'CUDA context')}, which is part of the budget (floor: weights + it = "
                    f"{rec['floor_gib']:.2f})")),
        ("micro-batch", (f"{c['batch_size']} × {rec['seq_len']} = {c['tokens_per_micro_batch']:,} tokens "
                         f"(train.grad_accum={c['grad_accum']} sets the tokens per optimizer step)"
                         + micro_batch_note(rec.get("micro_batch"), c["batch_size"]))),
        ("optimizer", f"Mode {o['mode']}, {o['dtype']} state, lm_head {'projected' if o['head'] else 'dense'}"
                      + (", dense weights bitsandbytes 8-bit AdamW" if o["dense_8bit"] else "")
                      + (", INT8 projected weights" if o["weights"] == "int8" else "")),
        ("vocabulary", vocab_row(o.get("vocab"))),
        *[("weights", describe_streaming(t)) for t in [rec.get("micro_batch_time")] if t and t["streamed"]],
        ("ranks", ranks),
        *([("expected loss cost", describe_prices(lc["choices"]))] if (lc := rec.get("loss_cost")) else []),
        ("retained gradient energy (bound)", f"{rec['energy']:.4f}"),
        *learning_rows(rec),
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
    else:
        last = (rec.get("iterations") or [{}])[-1]
        room = ("" if last.get("live_budget_gib") is None else
                f", the live peak planned ≤ {last['live_budget_gib']:.2f} GiB so that the caching allocator's slack "
                f"({last['slack_allowance']:.0%} of it, the most measured on verified plans) fits the step's "
                f"{rec['budget_gib'] - reserve:.2f}")
        rows.append(("verified", f"no: the peaks above are the cost model's prediction{room} (verify=true traces the "
                                 "full model instead, as the dry-run command below does)"))
    rows.append(("TRAINS (a real run)", f"`{rec['run_command']}`" + (f" — {rec['train_note']}"
                                                                     if rec.get("train_note") else "")))
    if rec.get("dryrun_command"):
        rows.append(("only TRACES (a dry run, no training)", f"`{rec['dryrun_command']}`"))
    table = "\n".join(["| plan | " + rec["name"] + " |", "|---|---|", *(f"| {k} | {x} |" for k, x in rows)])
    if rec.get("elapsed_s") is not None:
        table += (f"\nplanned in {rec['elapsed_s']:.1f} s ({rec.get('cached_samples', 0)} cost samples from the "
                  f"table, {rec.get('traces', 0)} traced); plan: {rec['plan_file']}")
    return table
