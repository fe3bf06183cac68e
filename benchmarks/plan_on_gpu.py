"""``python -m benchmarks.plan_on_gpu PLAN.json [PLAN.json ...] [--steps 4]``: does a memory plan fit a real GPU?

``python -m experiments.plan`` answers "what fits in ``budget_gib``" from a cost model (docs/planner.md). This check
trains each plan on the CUDA device for a few steps with the caching allocator capped at the plan's share of the
budget — ``budget_gib`` less the GPU allowance the plan set aside (``reserve_gib``: context, workspaces) —
through ``torch.cuda.set_per_process_memory_fraction``, so a larger GPU behaves like the planned one. The verdict:

- ``PASS``: every step ran under the cap, and the device's memory in use (NVML's "used", polled every 50 ms while
  the run ran: CUDA context and workspaces included) stayed within ``budget_gib``;
- ``MISS``: a CUDA out-of-memory error under the cap, or NVML's "used" over ``budget_gib``;
- ``ERROR``: the run failed for another reason.

Beside it: the plan's predicted peak and the allocator's ``max_memory_allocated`` / ``max_memory_reserved``, read
from the run's ``summary.json`` (never from console output). Output (rewritten atomically after each plan):
``<results-dir>/gpu/<device slug>-<date>/plan_on_gpu.json`` (schema ``hmt-plan-on-gpu/1``) and the runs under
``runs/``. Without a CUDA device it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.gpu_validate.checks import ERROR, GIB, INFO, MISS, PASS
from benchmarks.gpu_validate.cuda_backend import CudaBackend, NvmlPoller, child_env
from benchmarks.gpu_validate.orchestrate import Session
from benchmarks.gpu_validate.plan import short_cuda_run
from experiments.results import atomic_write_text, read_metrics

SCHEMA = "hmt-plan-on-gpu/1"
OUTCOME_FILE = "outcome.json"  # the child's own record: completed | oom | error


def run_overrides(plan: dict, *, plans_dir: Path, steps: int, runs_dir: Path, oversize: int = 1) -> list[str]:
    """``experiments.run`` arguments that train the plan for ``steps`` steps (the first 3 metered, the rest
    timed) from its Hydra group: ``plans_dir`` (named ``plans``) holds the record and its ``.yaml``. ``oversize``
    > 1: its micro-batch times ``oversize`` with ``train.on_oom=replan``, a run that must survive its own OOM."""
    bigger = [] if oversize == 1 else [f"train.batch_size={plan_batch(plan) * oversize}", "train.on_oom=replan"]
    return [f"hydra.searchpath=[file://{plans_dir.resolve().parent}]", f"+{plans_dir.name}={plan['name']}",
            *short_cuda_run(steps), *bigger, "train.confirm=false", f"results_dir={runs_dir}",
            f"run_id={run_name(plan, oversize)}", "force=true"]


def plan_batch(plan: dict) -> int:
    return int(plan["choice"]["batch_size"])


def run_name(plan: dict, oversize: int) -> str:
    return f"plan-{plan['name']}" + ("" if oversize == 1 else f"-x{oversize}-replan")


class NvmlUsedSampler(NvmlPoller):
    """The most device memory in use (NVML "used", device-wide) while a child runs."""

    def __init__(self, interval_s: float = 0.05) -> None:
        super().__init__(interval_s)
        self.max_used: int | None = None

    def sample(self, nvml, handle) -> None:
        used = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
        self.max_used = used if self.max_used is None else max(self.max_used, used)


def judge(plan: dict, outcome: dict, summary: dict | None, *, oversize: int = 1) -> dict:
    """One plan's record: what the plan promised, what CUDA measured, and the verdict. ``oversize`` > 1: the run
    had to run out of memory and step down (``summary.json`` ``replans``) to pass."""
    memory = (summary or {}).get("memory") or {}
    budget = float(plan["budget_gib"]) * GIB
    nvml_used = outcome.get("nvml_max_used_bytes")
    replans = (summary or {}).get("replans") or []
    if outcome.get("outcome") == "completed" and summary is None:
        verdict, note = ERROR, "the run ended without a summary.json (did it train?)"
    elif outcome.get("outcome") == "completed" and oversize > 1 and not replans:
        verdict, note = INFO, f"{oversize}x the micro-batch ran without an out-of-memory error: nothing to replan"
    elif outcome.get("outcome") == "completed":
        over = nvml_used is not None and nvml_used > budget
        verdict = MISS if over else PASS
        note = f"NVML used up to {nvml_used / GIB:.2f} GiB > budget {budget / GIB:g} GiB" if over else None
    elif outcome.get("outcome") == "oom":
        verdict, note = MISS, f"CUDA out of memory under the cap: {outcome.get('message', '')[:300]}"
    else:
        verdict, note = ERROR, str(outcome.get("message", "no outcome recorded"))[:300]
    predicted = plan.get("predicted_gib") or {}
    return {"plan": plan["name"], "verdict": verdict, "note": note, "budget(GiB)": plan["budget_gib"],
            "cap(GiB)": outcome.get("cap_gib"), "batch_size": (plan.get("choice") or {}).get("batch_size"),
            "oversize": oversize, "replans": [{k: r.get(k) for k in ("reason", "peak_bytes", "limit_bytes",
                                                                     "overrides", "source", "resumed_step")}
                                              for r in replans],
            "predicted_peak(GiB)": max(predicted.values()) if predicted else None,
            "predicted(GiB)": predicted, "verified_plan": plan.get("verified"),
            "cuda_max_allocated(GiB)": _gib(memory.get("cuda_max_allocated_bytes")),
            "cuda_max_reserved(GiB)": _gib(memory.get("cuda_max_reserved_bytes")),
            "nvml_max_used(GiB)": _gib(nvml_used), "nvml_used_at_end(GiB)": _gib(memory.get("nvml_used_bytes")),
            "tracker_peak(GiB)": _gib(memory.get("tracker_peak_bytes")),
            "step_time(s)": (summary or {}).get("step_time_s"), "tokens_per_s(tok/s)": (summary or {}).get("tokens_per_s"),
            # memory is judged, not learning: the losses are recorded so that a run that diverged is seen
            "train_loss_first(nats)": outcome.get("first_train_loss"),
            "train_loss_last(nats)": (summary or {}).get("train_loss"), "val_loss(nats)": (summary or {}).get("val_loss"),
            "wall(s)": outcome.get("wall_s")}


def first_train_loss(run_dir: Path) -> float | None:
    """The first logged step's training loss (``metrics.jsonl``), or None."""
    return next((float(m["loss/train"]) for m in read_metrics(run_dir) if m.get("loss/train") is not None), None)


def _gib(nbytes) -> float | None:
    return None if nbytes is None else nbytes / GIB


def run_capped(cap_gib: float, args: list[str], outcome_path: Path) -> int:
    """The child: cap the caching allocator at ``cap_gib`` and run ``experiments.run`` with ``args``; write what
    happened to ``outcome_path`` (an OOM is told apart from other failures by its exception type)."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), 0)
    saved = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # the runner re-raises, so the exception's type reaches us
    sys.argv = ["experiments.run", *args]
    start, record = time.perf_counter(), {"cap_gib": cap_gib}
    try:  # as ``python -m experiments.run``: Hydra finds its config folder beside the __main__ file
        runpy.run_module("experiments.run", run_name="__main__", alter_sys=True)
        record["outcome"] = "completed"
    except torch.OutOfMemoryError as e:
        record.update(outcome="oom", message=str(e).strip().splitlines()[0] if str(e).strip() else "")
    except BaseException as e:  # noqa: BLE001 - recorded, the parent judges it ERROR
        record.update(outcome="error", message=f"{type(e).__name__}: {e}")
    finally:
        sys.argv = saved[0]
        if saved[1] is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved[1]
    record["wall_s"] = time.perf_counter() - start
    atomic_write_text(outcome_path, json.dumps(record) + "\n")
    return 0 if record["outcome"] == "completed" else 1


def check_plan(plan_path: Path, session: Session, *, steps: int, timeout_s: float, oversize: int = 1) -> dict:
    plan = json.loads(plan_path.read_text(encoding="utf-8"))
    cap_gib = float(plan["budget_gib"]) - float(plan.get("reserve_gib") or 0.0)
    runs_dir, name = session.runs_dir, run_name(plan, oversize)
    run_dir, log = runs_dir / name, session.logs_dir / f"{name}.log"
    outcome_path = session.logs_dir / f"{name}.{OUTCOME_FILE}"
    log.parent.mkdir(parents=True, exist_ok=True)
    outcome_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.plan_on_gpu", "--child-cap-gib", str(cap_gib), "--child-outcome",
           str(outcome_path), "--", *run_overrides(plan, plans_dir=plan_path.parent, steps=steps, runs_dir=runs_dir,
                                                   oversize=oversize)]
    with NvmlUsedSampler() as sampler:
        try:
            with open(log, "w", encoding="utf-8") as f:
                subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), timeout=timeout_s,
                               check=False)
            outcome = json.loads(outcome_path.read_text()) if outcome_path.exists() else {
                "outcome": "error", "message": f"the child wrote no outcome (log: {log})"}
        except subprocess.TimeoutExpired:
            outcome = {"outcome": "error", "message": f"timed out after {timeout_s:.0f} s (log: {log})"}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return judge(plan, {**outcome, "cap_gib": cap_gib, "nvml_max_used_bytes": sampler.max_used,
                        "first_train_loss": first_train_loss(run_dir)}, summary, oversize=oversize)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_on_gpu", description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="*", type=Path, help="plan records (.json) written by python -m experiments.plan")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per plan")
    ap.add_argument("--results-dir", type=Path, default=Path("results"))
    ap.add_argument("--oversize", type=int, default=1,
                    help="train each plan at this multiple of its micro-batch with train.on_oom=replan")
    ap.add_argument("--child-cap-gib", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--child-outcome", type=Path, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    child_args = argv[argv.index("--") + 1:] if "--" in argv else []  # the child's experiments.run arguments
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.child_cap_gib is not None:
        return run_capped(a.child_cap_gib, child_args, a.child_outcome)
    missing = [str(p) for p in a.plans if not p.is_file()]
    if not a.plans or missing:
        ap.error(f"plan records not found: {', '.join(missing) or '(none given)'}")
    if a.oversize < 1:
        ap.error(f"--oversize must be >= 1, got {a.oversize}")
    if a.steps <= 3:
        ap.error("--steps must be > 3: the first 3 steps are metered and never timed")
    if not torch.cuda.is_available():
        print("plan_on_gpu: no CUDA device (torch.cuda.is_available() is False); nothing to check here")
        return 0
    name = CudaBackend().device_name()  # through NVML: no CUDA context in this process
    session = Session.create(a.results_dir, name, datetime.now(timezone.utc).date())  # gpu_validate's folder
    out = session.dir / ("plan_on_gpu.json" if a.oversize == 1 else f"plan_on_gpu-x{a.oversize}-replan.json")
    records: list[dict] = []
    for path in a.plans:
        records.append(check_plan(path, session, steps=a.steps, timeout_s=a.timeout_s, oversize=a.oversize))
        print(json.dumps(records[-1]))
        atomic_write_text(out, json.dumps({"schema": SCHEMA, "device": name, "torch": torch.__version__,
                                           "steps": a.steps, "checks": records}, indent=2) + "\n")
    return 1 if any(r["verdict"] == ERROR for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
