"""``python -m experiments.plan``'s command line: a plan at ``budget_gib``, ``--capacity``, ``--calibrate`` or
``--table`` (``experiments.planner.plan`` documents the keys; design: ``docs/planner.md``)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from experiments import methods
from experiments.errors import UserError, one_line_errors
from experiments.models import TORCH_DTYPES
from experiments.planner.capacity import capacity
from experiments.planner.model import calibrate
from experiments.planner.plan import make_plan, parse_args, plan_with, prepare, run_config
from experiments.planner.report import plans_dir, render_plan
from experiments.results import atomic_write_text
from experiments.runs import preflight, resolve_device


def main(argv: Sequence[str] | None = None) -> dict | None:
    t0 = time.perf_counter() - (process_age_s() if argv is None else 0.0)  # a command: its imports included
    argv = list(sys.argv[1:] if argv is None else argv)

    def body():
        planner, overrides = parse_args(argv)
        planner.update(_argv=argv, _overrides=overrides, _t0=t0)
        run = run_config([o for o in overrides if not o.startswith("mode=")])
        if planner.get("calibrate"):
            return write_calibration(run)
        if not methods.planned(run.method):
            raise UserError(f"method={run.method.name}: the planner plans method=hmt (--capacity compares the "
                            "baselines)")
        preflight(run)
        if planner.get("capacity"):
            return capacity(run, planner, overrides)
        if planner.get("table"):
            return write_table(run, planner)
        if "budget_gib" not in planner:
            raise UserError("budget_gib= is required (the GPU's memory in GiB, e.g. budget_gib=16), or --capacity")
        check_budget(planner["budget_gib"])
        plans_dir(run.results_dir, planner.get("plan_dir"))  # a refused folder before any trace
        rec = make_plan(run, planner)
        print(render_plan(rec))
        if rec.get("learning_check", {}).get("passes") is False:
            print(f"warning: this plan did not pass the learning check ({rec['learning_check']['file']}): "
                  "it fits, but do not expect it to train as well as HMT defaults", file=sys.stderr)
        return rec

    return one_line_errors(body, FileNotFoundError)


LARGEST_CARD_GIB = 288  # the most memory one accelerator has today (NVIDIA B300: 288 GB HBM3e)


def check_budget(budget) -> None:
    """A budget beyond any single card is refused before anything is traced (the planner plans one device)."""
    if isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > LARGEST_CARD_GIB:
        raise UserError(f"budget_gib={budget:g} is beyond any single GPU (the largest has {LARGEST_CARD_GIB} GiB); "
                        "give one card's memory in GiB, e.g. budget_gib=80")


def write_table(run, planner: dict) -> dict:
    """``--table``: the committed cost table of this group, completed; with ``table_budgets=[16,24]`` also the
    samples the unverified answers at those budgets trace past the table (``experiments.planner.extend``), so a
    fresh clone answers them from the table alone. The plans themselves go to a temporary folder."""
    planner.pop("budget_gib", None)
    budgets = planner.pop("table_budgets", None) or []
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0 for b in budgets):
        raise UserError(f"table_budgets={budgets}: expected a list of GiB, e.g. table_budgets=[16,24]")
    prep = prepare(run, planner)
    rec = prep.record
    print(f"cost table: {rec['traces']} samples traced in {rec['trace_s']:.0f} s into results/plan/costs/")
    with tempfile.TemporaryDirectory() as tmp:
        for budget in budgets:
            # each budget from the table alone, as a fresh clone answers it (not from a record that another budget's
            # answer already extended)
            prep = prepare(run, planner, log=lambda *a: None)
            before = len(prep.table.user)
            try:
                plan_with(prep, {**planner, "verify": False, "plan_dir": tmp}, float(budget), log=lambda *a: None)
            except UserError as e:  # no plan at this budget: nothing past the table to trace for it
                print(f"cost table: budget_gib={budget:g}: {e}")
                continue
            print(f"cost table: budget_gib={budget:g}: {len(prep.table.user) - before} samples past the table added")
    return rec


def process_age_s() -> float:
    """Seconds since this process started (Linux ``/proc``; 0 where unknown)."""
    try:
        start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - start)
    except (OSError, ValueError, IndexError):
        return 0.0


def write_calibration(run) -> dict:
    device = resolve_device(run.device)
    cal = calibrate(device.type, TORCH_DTYPES[run.model.dtype])
    slug = "".join(ch if ch.isalnum() else "-" for ch in cal["device"].lower()).strip("-")
    path = Path(run.results_dir).expanduser() / "plans" / f"calibration-{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(cal, indent=1, sort_keys=True))
    print(f"calibration on {cal['device']}: {cal['flops_per_s'] / 1e12:.3f} TFLOP/s, "
          f"{cal['bytes_per_s'] / 1e9:.1f} GB/s copy; written to {path} (use calibration={path})")
    return cal
