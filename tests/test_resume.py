"""SIGKILL at random moments (one of them in the middle of a checkpoint write), restart with the same command,
and the loss trajectory equals an uninterrupted run's exactly (CPU, one thread per process)."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from experiments.results import read_metrics
from experiments.checkpoint import store as ck

REPO = Path(__file__).resolve().parent.parent
MICRO = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.intermediate_size=176",
         "model.vocab_size=512", "train.seq_len=32", "train.batch_size=2", "train.progress=false",
         "train.log_every=1", "train.eval_every=5", "train.eval_batches=2", "train.steps=10", "train.warmup_steps=2",
         # real low-rank projection (rank 8/16 of 64) with basis refreshes at steps 0, 3, 6, 9
         "method.rank_candidates=[8,16]", "method.update_interval=3"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # same thread count => same numerics


def launch(results: Path, run_id: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "experiments.run", f"results_dir={results}", f"run_id={run_id}", *MICRO, *extra]
    return subprocess.Popen(args, cwd=REPO, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120, poll: float = 0.01) -> bool:
    """Poll until ``predicate()``; False if the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return predicate()
        time.sleep(poll)
    raise TimeoutError("condition not reached")


def last_step(run_dir: Path) -> int:
    try:
        rows = read_metrics(run_dir)
    except (json.JSONDecodeError, OSError):
        return -1
    return rows[-1]["step"] if rows else -1


def losses(run_dir: Path) -> list[float]:
    return [r["loss/train"] for r in read_metrics(run_dir)]


def test_sigkill_at_random_points_then_resume_matches_uninterrupted_run(tmp_path, micro_reference):
    rng = random.Random(8)
    expected = losses(micro_reference)  # no checkpoints at all: writing them must not perturb the trajectory

    victim = tmp_path / "victim"
    ckdir = victim / "checkpoints"
    common = ("train.checkpoint_every=2", "train.keep_checkpoints=2")
    kills = []
    for trial in ("random", "mid-checkpoint", "random"):
        if trial == "mid-checkpoint":  # the writer pauses after its first file; kill it inside that window
            proc = launch(tmp_path, "victim", *common, env={**ENV, "HMT_CHECKPOINT_PAUSE_S": "30"})
            done_before = {p.name for _, p in ck.list_checkpoints(ckdir)}
            wait_for(lambda: any(ckdir.glob(".tmp-step-*")), proc)  # a checkpoint's temp dir, not the probe file
        else:
            target = rng.randint(0, 7)
            wait_for(lambda target=target: last_step(victim) >= target, proc := launch(tmp_path, "victim", *common))
            time.sleep(rng.uniform(0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        assert (victim / "status").read_text().strip() == "running"
        kills.append((trial, last_step(victim), [p.name for _, p in ck.list_checkpoints(ckdir)]))
        if trial == "mid-checkpoint":
            assert list(ckdir.glob(".tmp-step-*")), "the half-written checkpoint should be left behind"
            assert {p.name for _, p in ck.list_checkpoints(ckdir)} == done_before  # never renamed into place
            path, _, problems = ck.find_latest_good(ckdir)
            assert problems == [] and (path is None or path.name in done_before)

    proc = launch(tmp_path, "victim", *common)
    rc, out = finish(proc)
    assert rc == 0, out
    assert (victim / "status").read_text().strip() == "completed"
    assert not list(ckdir.glob(".tmp-*"))  # the next save cleaned up the killed writer's temp directory
    rows = read_metrics(victim)
    assert [r["step"] for r in rows] == list(range(10)), kills
    assert losses(victim) == expected, kills  # bit-for-bit: floats compared with ==
    print("kills (trial, last logged step, checkpoints on disk):", kills)
    summary = json.loads((victim / "summary.json").read_text())
    ref_summary = json.loads((micro_reference / "summary.json").read_text())
    assert summary["val_loss"] == ref_summary["val_loss"] and summary["train_loss"] == ref_summary["train_loss"]
    assert summary["skipped_steps"] == 0
    assert summary["checkpoints"]["saved"] >= 1 and len(ck.list_checkpoints(ckdir)) <= 2  # keep-last-2
    if summary["resume"] is not None:
        assert summary["resume"]["from_step"] in range(0, 11)
