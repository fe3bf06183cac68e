"""Sweeps on a real Slurm: ``slurm/local_slurm.sh up`` brings up a one-node Slurm on localhost (installing
munge/slurmctld/slurmd/slurm-client with apt-get when missing), then real ``experiments.run`` jobs (tiny model,
3 steps, CPU) run as Slurm array tasks.

Proven here: a sweep submitted with ``cluster=slurm`` is one Slurm job array and the launching command returns
without waiting; every run writes its own summary; a run made to fail is reported failed in results/ (Slurm's own
state for it is irrelevant); re-submitting the sweep skips the completed runs; the hand-submitted
``slurm/array.sbatch`` maps array task ids to the sweep's runs and only resubmits what is not completed; a run
submitted with ``hydra.launcher.tasks_per_node=2`` and ``dist=ddp`` is one torch.distributed job of two Slurm
tasks (gloo), written once by rank 0, whose losses equal the single-process run's bit for bit (fp32, no autocast:
DDP's 2-term gradient mean rounds as the single process's, ``tests/test_distributed.py``); a task count the run
cannot use is refused with one line before anything is submitted (no Slurm needed for that one).

Needs root and apt-get (Debian/Ubuntu) unless Slurm is already up. With ``CI=true`` a Slurm that cannot be brought
up FAILS the tests; elsewhere they are skipped on machines that cannot run it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.sweeps import sweep

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "slurm" / "local_slurm.sh"
IN_CI = os.environ.get("CI", "").lower() == "true"
COMMON = "[model=tiny, train.steps=3, train.eval_every=3, train.eval_batches=1, train.progress=false, device=cpu]"
SLURM_OPTIONS = ["cluster=slurm", "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1",
                 "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]


def _unavailable(reason: str):
    if IN_CI:
        pytest.fail(f"CI=true but local Slurm is unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_env():
    """Environment (SLURM_CONF, ...) of a running local Slurm; stops it afterwards if this fixture started it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    conf = subprocess.run([str(SCRIPT), "env"], capture_output=True, text=True, check=True).stdout
    env["SLURM_CONF"] = conf.strip().split("=", 1)[1]
    running = subprocess.run([str(SCRIPT), "status"], env=env, capture_output=True).returncode == 0
    if not running and (os.geteuid() != 0 or not shutil.which("apt-get")):
        _unavailable("needs root and apt-get to install and start Slurm")
    started = time.monotonic()
    up = subprocess.run([str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=600)
    if up.returncode != 0:
        pytest.fail(f"slurm/local_slurm.sh up failed:\n{up.stdout}\n{up.stderr}")
    # only the session that started the cluster stops it (another pytest session may have jobs on it); `up` says
    # "already up" for a cluster that was running, even one slow to answer `status` on a loaded machine
    ours = "already up" not in up.stderr
    if ours:
        print(f"local Slurm up in {time.monotonic() - started:.1f} s")
    yield env
    if ours:
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)


def _broken_model(tmp_path: Path) -> Path:
    """A model directory that passes config validation (it has a config.json) but fails to load in the job."""
    path = tmp_path / "broken-model"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    return path


def _write_sweep(path: Path, fail_model_path: Path) -> Path:
    path.write_text(f"common: {COMMON}\ngrid:\n  method: [adamw]\n  seed: [0, 1]\n"
                    f"runs:\n  - [method=adamw, seed=0, model.path={fail_model_path}]\n")
    return path


def _wait_until_settled(jobs: list[list[str]], timeout_s: float = 420) -> list[str]:
    """States of the sweep's runs once none is pending or running."""
    refs = [sweep.run_ref_for(job) for job in jobs]
    deadline = time.monotonic() + timeout_s
    while True:
        states = [sweep.run_state(ref.path) for ref in refs]
        if not {"pending", "running"} & set(states) or time.monotonic() > deadline:
            return states
        time.sleep(1)


def _slurm_tasks(env: dict, array_id: str) -> list[str]:
    """``JobId=... ArrayTaskId=... JobState=...`` lines Slurm keeps for the array (MinJobAge=300 s)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", array_id], env=env, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"ArrayJobId={array_id} " in line]


def _task_count(task_lines: list[str]) -> int:
    """Array tasks named by ``ArrayTaskId=`` fields (a pending remainder shows as one line, e.g. ``0-2%3``)."""
    count = 0
    for line in task_lines:
        spec = line.split("ArrayTaskId=")[1].split()[0].split("%")[0]
        for part in spec.split(","):
            first, _, last = part.partition("-")
            count += int(last or first) - int(first) + 1
    return count


def test_sweep_is_one_slurm_array_failures_visible_and_resumable(slurm_env: dict, tmp_path: Path) -> None:
    sweep_file = _write_sweep(tmp_path / "mini.yaml", _broken_model(tmp_path))
    results = tmp_path / "results"
    command = [sys.executable, "-m", "experiments.run", "-m", f"hydra.sweeper.file={sweep_file}",
               f"results_dir={results}", *SLURM_OPTIONS]
    started = time.monotonic()
    first = subprocess.run(command, cwd=REPO, env=slurm_env, capture_output=True, text=True, timeout=300)
    log = first.stdout + first.stderr
    assert first.returncode == 0, log
    assert "submitted 3 runs as Slurm array" in log, log
    array_id = log.split("as Slurm array ")[1].split(";")[0]
    assert time.monotonic() - started < 60, "the launching command must not wait for the jobs"
    assert _task_count(_slurm_tasks(slurm_env, array_id)) == 3, "one sweep must be one 3-task job array"

    jobs = [sweep.merge_overrides(job, [f"results_dir={results}"]) for job in sweep.load_sweep(sweep_file)]
    assert _wait_until_settled(jobs) == ["completed", "completed", "failed"]
    completed = [sweep.run_ref_for(job).path for job in jobs[:2]]
    for path, seed in zip(completed, (0, 1)):
        summary = json.loads((path / "summary.json").read_text())
        assert (summary["method"], summary["model"], summary["seed"], summary["steps"]) == ("adamw", "tiny", seed, 3)
    failed = sweep.run_ref_for(jobs[2]).path
    assert "no-such-architecture" in (failed / "error.txt").read_text()
    for _ in range(30):  # let Slurm finish the array before quoting it
        if not subprocess.run(["squeue", "-h", "-j", array_id], env=slurm_env, capture_output=True, text=True).stdout:
            break
        time.sleep(0.5)
    slurm_says = [" ".join(w for w in line.split() if w.startswith(("ArrayTaskId=", "JobState=", "ExitCode=")))
                  for line in _slurm_tasks(slurm_env, array_id)]
    print("results/ says completed, completed, failed; Slurm says:", *slurm_says, sep="\n  ")

    mtimes = [(p / "summary.json").stat().st_mtime_ns for p in completed]
    second = subprocess.run(command, cwd=REPO, env=slurm_env, capture_output=True, text=True, timeout=300)
    log = second.stdout + second.stderr
    assert second.returncode == 0, log
    assert "3 runs: 1 to launch, 2 completed and skipped" in log and "submitted 1 runs as Slurm array" in log, log
    assert _wait_until_settled(jobs) == ["completed", "completed", "failed"]
    assert [(p / "summary.json").stat().st_mtime_ns for p in completed] == mtimes, "completed runs were re-run"


def test_launcher_marks_runs_that_die_before_starting_failed(slurm_env: dict, tmp_path: Path) -> None:
    """A job that exits before the runner wrote anything (SystemExit: the runner's config/device errors) is
    recorded failed by the launcher on the node, with its config and the error."""
    results = tmp_path / "results"
    command = [sys.executable, str(REPO / "tests" / "standin_run.py"), "-m", "method=adamw", "seed=0,667",
               f"results_dir={results}", *SLURM_OPTIONS]
    launch = subprocess.run(command, cwd=REPO, env=slurm_env, capture_output=True, text=True, timeout=300)
    assert launch.returncode == 0 and "submitted 2 runs as Slurm array" in launch.stdout + launch.stderr
    jobs = sweep.sweep_jobs(None, ["method=adamw", "seed=0,667", f"results_dir={results}"])
    assert _wait_until_settled(jobs, timeout_s=180) == ["completed", "failed"]
    died = sweep.run_ref_for(jobs[1]).path
    assert "stand-in run died before starting" in (died / "error.txt").read_text()
    assert "seed: 667" in (died / "config.yaml").read_text()


def test_hand_submitted_array_sbatch_runs_the_sweep_by_task_id(slurm_env: dict, tmp_path: Path) -> None:
    sweep_file = tmp_path / "pair.yaml"
    sweep_file.write_text(f"common: {COMMON}\nruns:\n  - [method=adamw, seed=3]\n"
                          f"  - [method=adamw, seed=4, model.path={_broken_model(tmp_path)}]\n")
    results = f"results_dir={tmp_path / 'results'}"
    jobs = [sweep.merge_overrides(job, [results]) for job in sweep.load_sweep(sweep_file)]
    spec = subprocess.run([sys.executable, "-m", "experiments.sweeps.sweep", "array", str(sweep_file), results], cwd=REPO,
                          env=slurm_env, capture_output=True, text=True, check=True).stdout.strip()
    assert spec == "0-1"

    def submit(array: str) -> None:
        subprocess.run(["sbatch", "--parsable", f"--array={array}", "--cpus-per-task=1", "--mem=1G",
                        f"--output={tmp_path}/slurm-%A_%a.out", str(REPO / "slurm" / "array.sbatch"),
                        str(sweep_file), results], cwd=REPO, env=slurm_env, capture_output=True, text=True,
                       check=True)

    submit(spec)
    assert _wait_until_settled(jobs) == ["completed", "failed"]
    logs = sorted(tmp_path.glob("slurm-*_*.out"))
    assert len(logs) == 2 and "seed=3" in logs[0].read_text() and "seed=4" in logs[1].read_text()
    again = subprocess.run([sys.executable, "-m", "experiments.sweeps.sweep", "array", str(sweep_file), results], cwd=REPO,
                           env=slurm_env, capture_output=True, text=True, check=True).stdout.strip()
    assert again == "1", "only the failed run is left to resubmit"


# ------------------------------------------------------------------------------ multi-task (torch.distributed)
EXACT = ["model=tiny", "model.dtype=fp32", "train.autocast=false", "method=adamw", "train.steps=3",
         "train.eval_every=3", "train.eval_batches=1", "train.progress=false", "device=cpu"]


def test_two_task_ddp_run_is_one_torch_distributed_job_equal_to_one_process(slurm_env: dict, tmp_path: Path) -> None:
    results = tmp_path / "results"
    command = [sys.executable, "-m", "experiments.run", "-m", "dist=ddp", *EXACT, f"results_dir={results}",
               *SLURM_OPTIONS, "hydra.launcher.tasks_per_node=2", "hydra.launcher.setup=['export OMP_NUM_THREADS=1']"]
    launch = subprocess.run(command, cwd=REPO, env=slurm_env, capture_output=True, text=True, timeout=300)
    log = launch.stdout + launch.stderr
    assert launch.returncode == 0 and "submitted 1 runs as Slurm array" in log, log
    array_id = log.split("as Slurm array ")[1].split(";")[0]
    jobs = sweep.sweep_jobs(None, ["dist=ddp", *EXACT, f"results_dir={results}"])
    states = _wait_until_settled(jobs, timeout_s=300)
    run_dir = sweep.run_ref_for(jobs[0]).path
    task_logs = sorted((results / ".multirun" / ".submitit").glob(f"{array_id}*/*_log.*"))  # one run: no "_0"
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in task_logs)
    error = run_dir / "error.txt"
    assert states == ["completed"], f"{states}: {error.read_text() if error.exists() else ''}{logs}"
    assert sum(p.name.endswith("_log.out") for p in task_logs) == 2, f"two Slurm tasks expected:\n{logs}"
    assert "task 0 of 2" in logs and "task 1 of 2" in logs, logs

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dist"]["world_size"] == 2 and len(summary["dist"]["peak_bytes_by_rank"]) == 2, summary["dist"]
    assert [p.name for p in results.iterdir() if not p.name.startswith(".")] == [run_dir.name]

    single = subprocess.run([sys.executable, "-m", "experiments.run", *EXACT, f"results_dir={tmp_path / 'single'}",
                             "run_id=single"], cwd=REPO, env={**slurm_env, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    alone = json.loads((tmp_path / "single" / "single" / "summary.json").read_text())
    steps = [[json.loads(line)["step"] for line in (path / "metrics.jsonl").read_text().splitlines()]
             for path in (run_dir, tmp_path / "single" / "single")]
    assert steps[0] == steps[1], f"metrics must be written once (rank 0): {steps}"
    print(f"2 Slurm tasks: train {summary['train_loss']!r} val {summary['val_loss']!r}; "
          f"1 process: train {alone['train_loss']!r} val {alone['val_loss']!r}")
    assert (summary["train_loss"], summary["val_loss"]) == (alone["train_loss"], alone["val_loss"])


@pytest.mark.parametrize("overrides, fragments", [
    (["hydra.launcher.tasks_per_node=2"], ["tasks_per_node=2 = 2 tasks per run but dist=none"]),
    (["hydra.launcher.nodes=2"], ["nodes=2 × tasks_per_node=1 = 2 tasks per run but dist=none"]),
    (["dist=ddp", "hydra.launcher.tasks_per_node=2", "train.batch_size=3"], ["train.batch_size=3", "=2"]),
    (["dist=ddp", "hydra.launcher.tasks_per_node=4", "hydra.launcher.gpus_per_node=2"],
     ["tasks_per_node=4 > gpus_per_node=2"]),
    (["dist=fsdp2", "method=qlora", "hydra.launcher.tasks_per_node=2"], ["dist=fsdp2 supports method=adamw"]),
])
def test_a_task_count_the_run_cannot_use_is_refused_before_submitting(tmp_path: Path, overrides, fragments) -> None:
    """No Slurm needed: the sweep validates every run against the launcher's task count before submitting."""
    results = tmp_path / "results"
    launcher = [o for o in SLURM_OPTIONS if o != "hydra.launcher.gpus_per_node=null"]
    launcher += [] if any("gpus_per_node" in o for o in overrides) else ["hydra.launcher.gpus_per_node=null"]
    command = [sys.executable, "-m", "experiments.run", "-m", *EXACT, f"results_dir={results}", *launcher,
               *overrides]
    proc = subprocess.run(command, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stdout + proc.stderr
    assert all(f in errors[0] for f in fragments), errors[0]
    assert "Traceback" not in proc.stderr and not results.exists(), proc.stderr
