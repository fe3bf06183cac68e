"""Sweep files, run identity, skip-completed and the ``experiments.sweeps.sweep`` CLI, without Slurm.

The multirun test drives the real Hydra config, sweeper (``hydra/sweeper=hmt``) and results store through
``tests/standin_run.py`` (no training), with ``cluster=local``; the Slurm path is in ``test_slurm.py``.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.sweeps import sweep

REPO = Path(__file__).resolve().parent.parent
STANDIN = REPO / "tests" / "standin_run.py"


def test_grid_order_common_and_precedence() -> None:
    runs = sweep.expand_sweep({"common": ["train.steps=3", "seed=9"],
                               "grid": {"method": ["adamw", "hmt"], "seed": [0, 1]},
                               "runs": [["method=qlora", "train.steps=5"]]})
    assert runs == [
        ["train.steps=3", "method=adamw", "seed=0"], ["train.steps=3", "method=adamw", "seed=1"],
        ["train.steps=3", "method=hmt", "seed=0"], ["train.steps=3", "method=hmt", "seed=1"],
        ["seed=9", "method=qlora", "train.steps=5"],
    ]
    assert sweep.expand_sweep({"grid": {"train.autocast": [True, False]}}) == [["train.autocast=true"],
                                                                              ["train.autocast=false"]]


@pytest.mark.parametrize("spec, message", [
    ({"grid": {"method": ["adamw"]}, "extra": 1}, "unknown sweep file keys"),
    ({"grid": {"train": [{"steps": 3}]}}, "must be a scalar"),
    ({"runs": ["method=adamw"]}, "must be a list of overrides"),
    ({"description": "nothing"}, "neither"),
])
def test_bad_sweep_files_are_rejected(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sweep.expand_sweep(spec)


def test_sweep_file_times_command_line_grid(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("common: [train.steps=3]\ngrid:\n  method: [adamw, qlora]\n")
    assert sweep.sweep_jobs(None, ["method=adamw,hmt", "seed=0"]) == [["method=adamw", "seed=0"],
                                                                      ["method=hmt", "seed=0"]]
    assert sweep.sweep_jobs(path, ["seed=0,1", "train.steps=5"]) == [
        ["method=adamw", "seed=0", "train.steps=5"], ["method=adamw", "seed=1", "train.steps=5"],
        ["method=qlora", "seed=0", "train.steps=5"], ["method=qlora", "seed=1", "train.steps=5"]]


def test_merge_overrides_later_key_wins() -> None:
    assert sweep.merge_overrides(["a=1", "+b=2", "c=3"], ["b=5", "a=4"]) == ["c=3", "b=5", "a=4"]
    assert sweep.override_key("++train.steps=3") == "train.steps" and sweep.override_key("~x") == "x"


def test_array_spec_compresses_ranges() -> None:
    assert sweep.array_spec([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert sweep.array_spec([3]) == "3"


@pytest.mark.parametrize("path", sorted((REPO / "experiments" / "sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_committed_sweep_files_expand(path: Path) -> None:
    runs = sweep.load_sweep(path)
    assert runs and len({tuple(sorted(r)) for r in runs}) == len(runs), "duplicate runs"
    for run in runs:
        keys = {sweep.override_key(o) for o in run}
        assert {"method"} <= keys and ("model" in keys or path.stem == "smoke"), run
    if path.stem == "paper_main":
        assert len(runs) == 5 * 2 * 3 + 2 * 3  # every method x 2 models x 3 seeds, + 8-bit AdamW's runs


def test_run_identity_is_the_runners_and_ignores_cluster_options(tmp_path: Path) -> None:
    a = sweep.run_ref_for(["method=adamw", "seed=1", "train.steps=3"])
    b = sweep.run_ref_for(["train.steps=3", "seed=1", "method=adamw", "cluster=slurm",
                           "hydra.launcher.partition=gpu", f"results_dir={tmp_path}"])
    assert a.run_id == b.run_id and a.run_id.startswith("adamw-tiny-train-s1-")
    assert b.path == tmp_path / a.run_id
    assert sweep.run_ref_for(["method=adamw", "seed=2", "train.steps=3"]).run_id != a.run_id
    assert sweep.run_ref_for(["method=adamw", "seed=1", "train.steps=3", "force=true"]).force


def test_run_state_and_mark_failed(tmp_path: Path) -> None:
    ref = sweep.RunRef(tmp_path, "r1", force=False)
    assert sweep.run_state(ref.path) == "pending" and not sweep.is_completed(tmp_path, "r1")
    sweep.mark_failed(ref, "killed by Slurm")
    assert sweep.run_state(ref.path) == "failed" and "killed" in (ref.path / "error.txt").read_text()
    (ref.path / "status").write_text("completed\n")
    sweep.mark_failed(ref, "late")  # never overwrites a final state
    assert sweep.is_completed(tmp_path, "r1")
    preempted = sweep.RunRef(tmp_path, "r2", force=False)
    preempted.path.mkdir()
    (preempted.path / "status").write_text("preempted\n")  # exit 75 after its checkpoint: array.sbatch calls
    sweep.mark_failed(preempted, "experiments.run exited with status 75")  # mark-failed, which leaves it
    assert sweep.run_state(preempted.path) == "preempted" and not (preempted.path / "error.txt").exists()
    assert not sweep.is_completed(tmp_path, "r2")  # `sweep array` lists it again: a resubmission resumes it
    out = io.StringIO()
    sweep.print_status([{"index": i, "state": sweep.run_state(r.path), "run_id": r.run_id, "updated": "",
                         "overrides": "", "error": None} for i, r in enumerate((ref, preempted))], out)
    assert out.getvalue().splitlines()[-1] == "0 pending, 0 running, 1 completed, 0 failed, 1 preempted of 2", out


def _multirun(sweep_file: Path, results: Path, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(STANDIN), "-m", f"hydra.sweeper.file={sweep_file}",
                           f"results_dir={results}", *extra], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "Could not override 'hydra.sweeper.file'" not in done.stderr and "'cluster'" not in done.stderr, (
        "experiments/conf/run.yaml must select the hmt sweeper and the cluster group:\n" + done.stderr)
    return done


def _cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = sweep.main(list(args))
    return code, capsys.readouterr().out


def test_local_multirun_resumes_skipping_completed_runs(tmp_path: Path, capsys) -> None:
    sweep_file = tmp_path / "mini.yaml"
    sweep_file.write_text("common: [train.steps=3]\ngrid:\n  method: [adamw]\n  seed: [0, 1]\nruns:\n"
                          "  - [method=adamw, seed=666]\n")
    results = tmp_path / "results"
    launched = results / "launched.txt"

    first = _multirun(sweep_file, results, "cluster=local")
    assert first.returncode != 0, "a failed run must make the multirun fail"
    assert len(launched.read_text().split()) == 3
    code, status = _cli(capsys, "status", str(sweep_file), f"results_dir={results}")
    assert code == 0 and "0 pending, 0 running, 2 completed, 1 failed of 3" in status
    assert "stand-in run made to fail" in status
    assert _cli(capsys, "array", str(sweep_file), f"results_dir={results}") == (0, "2\n")

    second = _multirun(sweep_file, results, "cluster=local")  # resumes: only the failed run is launched again
    assert "3 runs: 1 to launch, 2 completed and skipped" in second.stdout + second.stderr
    assert len(launched.read_text().split()) == 4

    forced = _multirun(sweep_file, results, "cluster=local", "force=true")
    assert "3 runs: 3 to launch, 0 completed and skipped" in forced.stdout + forced.stderr
    assert len(launched.read_text().split()) == 7


def test_the_registry_names_the_method_a_run_gets_by_default():
    # a tuned sweep's row without method= searches the default method's learning rates: the registry's DEFAULT
    # must be what experiments/conf/run.yaml composes when no method is named
    import yaml

    from experiments import methods

    defaults = yaml.safe_load((Path(__file__).resolve().parents[1] / "experiments/conf/run.yaml").read_text())
    chosen = [d["method"] for d in defaults["defaults"] if isinstance(d, dict) and "method" in d]
    assert chosen == [methods.DEFAULT], chosen
