"""``benchmarks.plan_on_gpu`` on CPU: its verdicts, the run it builds from a plan, and its child's outcome record
(a completed run, and an out-of-memory error raised by the memory meter's cap, told apart by exception type)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import plan_on_gpu as P
from benchmarks.gpu_validate.checks import ERROR, GIB, INFO, MISS, PASS

PLAN = {"name": "m-s64-1gib", "plan_file": "/x/res/plans/m-s64-1gib.yaml", "budget_gib": 24.0, "reserve_gib": 0.83,
        "predicted_gib": {"forward": 11.5, "backward": 19.4}, "choice": {"batch_size": 29}, "verified": None}
MICRO = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=176",
         "model.vocab_size=512", "train.seq_len=64", "train.batch_size=4", "train.eval_batches=1",
         "train.progress=false", "train.log_every=1", "train.steps=2", "train.eval_every=2"]


@pytest.mark.parametrize("outcome, used_gib, verdict", [
    ("completed", 23.9, PASS),
    ("completed", None, PASS),  # no NVML: the cap alone is judged
    ("completed", 24.1, MISS),  # the context did not fit the allowance
    ("oom", 10.0, MISS),
    ("error", 10.0, ERROR),
])
def test_verdicts(outcome, used_gib, verdict):
    used = None if used_gib is None else int(used_gib * GIB)
    summary = {"memory": {"cuda_max_allocated_bytes": 19 * GIB, "cuda_max_reserved_bytes": 22 * GIB},
               "step_time_s": 2.0}
    rec = P.judge(PLAN, {"outcome": outcome, "message": "boom", "cap_gib": 23.17, "nvml_max_used_bytes": used},
                  summary)
    assert rec["verdict"] == verdict, rec
    assert rec["predicted_peak(GiB)"] == 19.4 and rec["batch_size"] == 29 and rec["cuda_max_allocated(GiB)"] == 19


def test_a_completed_run_without_a_summary_is_an_error():
    rec = P.judge(PLAN, {"outcome": "completed", "cap_gib": 23.17, "nvml_max_used_bytes": GIB}, None)
    assert rec["verdict"] == ERROR and "summary" in rec["note"], rec


def test_the_run_trains_the_plan_from_its_hydra_group(tmp_path):
    args = P.run_overrides(PLAN, plans_dir=tmp_path / "res" / "plans", steps=4, runs_dir=tmp_path)
    assert args[:3] == [f"hydra.searchpath=[file://{tmp_path / 'res'}]", "+plans=m-s64-1gib", "device=cuda"]
    assert "train.steps=4" in args and f"results_dir={tmp_path}" in args and "run_id=plan-m-s64-1gib" in args


def test_an_oversized_run_must_replan(tmp_path):
    """``--oversize 2``: twice the plan's micro-batch with ``train.on_oom=replan``, filed under its own run id."""
    args = P.run_overrides(PLAN, plans_dir=tmp_path / "res" / "plans", steps=4, runs_dir=tmp_path, oversize=2)
    assert "train.batch_size=58" in args and "train.on_oom=replan" in args, args
    assert "run_id=plan-m-s64-1gib-x2-replan" in args and args.index("train.batch_size=58") > args.index(
        "+plans=m-s64-1gib"), args  # after the plan's group: the command line wins
    replan = {"reason": "CUDA out of memory", "peak_bytes": 21 * GIB, "limit_bytes": 24 * GIB, "source": "planner",
              "overrides": {"train.batch_size": 29, "train.grad_accum": 2}, "resumed_step": 0}
    summary = {"memory": {}, "replans": [replan]}
    done = {"outcome": "completed", "cap_gib": 23.17, "nvml_max_used_bytes": 23 * GIB}
    rec = P.judge(PLAN, done, summary, oversize=2)
    assert (rec["verdict"], rec["oversize"], rec["replans"]) == (PASS, 2, [replan]), rec
    assert P.judge(PLAN, done, {"memory": {}}, oversize=2)["verdict"] == INFO  # it fit: nothing was survived
    assert P.judge(PLAN, {**done, "nvml_max_used_bytes": 25 * GIB}, summary, oversize=2)["verdict"] == MISS
    assert P.judge(PLAN, {**done, "outcome": "oom"}, None, oversize=2)["verdict"] == MISS


def _child(tmp_path, *extra, monkeypatch):
    """The child on CPU: CUDA's allocator cap is the only CUDA call it makes; here it is recorded, not applied."""
    capped = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * GIB}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: capped.append((f, i)))
    outcome = tmp_path / "outcome.json"
    code = P.main(["--child-cap-gib", "20", "--child-outcome", str(outcome), "--", f"results_dir={tmp_path}",
                   "run_id=r", *MICRO, *extra])  # as the parent's command line passes them
    return code, json.loads(outcome.read_text()), capped


def test_the_child_records_a_completed_run(tmp_path, monkeypatch):
    code, outcome, capped = _child(tmp_path, monkeypatch=monkeypatch)
    assert capped == [(0.25, 0)]
    assert (code, outcome["outcome"], outcome["cap_gib"]) == (0, "completed", 20.0), outcome
    assert (tmp_path / "r" / "status").read_text().strip() == "completed"


def test_the_record_carries_the_losses_so_a_diverged_run_is_seen(tmp_path, monkeypatch):
    code, _, _ = _child(tmp_path, monkeypatch=monkeypatch)
    first = P.first_train_loss(tmp_path / "r")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    rec = P.judge(PLAN, {"outcome": "completed", "cap_gib": 20.0, "first_train_loss": first}, summary)
    assert code == 0 and first is not None and first > 0, first
    assert rec["train_loss_first(nats)"] == first and rec["train_loss_last(nats)"] == summary["train_loss"], rec
    assert P.first_train_loss(tmp_path / "missing") is None


def test_the_child_tells_an_out_of_memory_error_apart(tmp_path, monkeypatch):
    code, outcome, _ = _child(tmp_path, "train.memory_cap_gib=0.0001", monkeypatch=monkeypatch)
    assert (code, outcome["outcome"]) == (1, "oom"), outcome


def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps(PLAN))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device, also on a machine with one
    proc = subprocess.run([sys.executable, "-m", "benchmarks.plan_on_gpu", str(plan)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("plan_on_gpu: no CUDA device"), proc


def test_a_missing_plan_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.plan_on_gpu", str(tmp_path / "nope.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "nope.json" in proc.stderr, proc


def test_the_sampler_keeps_the_most_nvml_used(monkeypatch):
    """Polled in a thread: whatever NVML answered, the sampler keeps the largest (a fake NVML here)."""
    answered = []

    class FakeNvml:
        @staticmethod
        def nvmlDeviceGetMemoryInfo(handle):
            answered.append([5, 9, 7][len(answered) % 3] * GIB)
            return type("M", (), {"used": answered[-1]})

    from benchmarks.gpu_validate import cuda_backend
    monkeypatch.setattr(cuda_backend, "_nvml", lambda: (FakeNvml, "handle"))
    with P.NvmlUsedSampler(interval_s=0.001) as sampler:
        deadline = time.monotonic() + 10
        while len(answered) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(answered) >= 3 and sampler.max_used == max(answered) == 9 * GIB, (answered, sampler.max_used)
