"""Cool-down branches of a wsd trunk (``experiments.sweeps.branches``; Hägele et al. 2024) on CPU, ``model=tiny``
at a few dozen steps: a 24-step trunk (cool-down 25 %, a checkpoint every 6 steps) and branches at 8 and 16 steps
leaving it at steps 6 and 12, a 40-step extension leaving it at its own cool-down start, step 18, and a 48-step one
leaving the 40-step branch at that one's cool-down start, step 30. A branch's rate at its first step is the trunk's
there; the 16-step branch and both extensions end on the same losses as 16-, 40- and 48-step wsd runs trained from
step 0 (same seed, same data: resuming is exact on CPU with one thread); launching again skips completed branches; a missing branch-point checkpoint is one ``error:`` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.loop import lr_scale
from experiments.config import TrainConfig
from experiments.results import read_metrics
from experiments.sweeps import branches

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
COMMON = ["mode=train", "model=tiny", "train.seq_len=32", "train.batch_size=2", "train.warmup_steps=2",
          "train.schedule=wsd", "train.cooldown_frac=0.25", "train.min_lr_ratio=0.0", "train.eval_every=4",
          "train.eval_batches=2", "train.log_every=1", "train.progress=false", "seed=1", "method=adamw"]


def run(*overrides: str) -> None:
    done = subprocess.run([sys.executable, "-m", "experiments.run", *overrides], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.fixture(scope="module")
def trunk(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("wsd")
    sweep = root / "wsd.yaml"
    listed = ", ".join([*COMMON, f"results_dir={root / 'trunks'}", "train.steps=24", "train.checkpoint_every=6",
                        "train.keep_checkpoints=0"])
    sweep.write_text(f"common: [{listed}]\nruns:\n  - []\nbranches:\n  horizons: [8, 16, 24, 40, 48]\n")
    run(*COMMON, f"results_dir={root / 'trunks'}", "train.steps=24", "train.checkpoint_every=6",
        "train.keep_checkpoints=0")
    return root, sweep


def test_branches_start_at_the_trunks_rate_and_match_a_run_from_scratch(trunk) -> None:
    root, sweep = trunk
    found = branches.all_branches(str(sweep), [])
    # 24 is the trunk; 48 leaves the 40-step branch at its cool-down start (40 - 10) once that branch holds it
    assert [(b.horizon, b.start, b.via) for b in found] == [
        (8, 6, ()), (16, 12, ()), (40, 18, ()), (48, 18, ((40, 30),))], found
    counts = branches.launch(found, run=lambda job: subprocess.call(
        [sys.executable, "-m", "experiments.run", *job], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL))
    assert counts == {"launched": 4, "skipped": 0, "failed": 0}, counts
    starts = {b.horizon: b.via[0][1] if b.via else b.start for b in found}  # where each one did start
    seeded = json.loads((_branch_dir(root, found[3]) / "checkpoints" / "step-00000030" / "manifest.json").read_text())
    assert seeded["meta"]["branched_from"] == {"trunk": str(found[3].trunk), "run": str(_branch_dir(root, found[2])),
                                               "step": 30}, seeded["meta"]["branched_from"]
    trunk_rows = {r["step"]: r for r in read_metrics(found[0].trunk)}
    for branch in found:
        rows = [r for r in read_metrics(_branch_dir(root, branch)) if "lr_scale" in r]
        first = rows[0]
        assert first["step"] == starts[branch.horizon], first
        # the rate at the branch point equals the trunk's rate (1 × lr: the constant phase)
        assert first["lr_scale"] == trunk_rows[branch.start]["lr_scale"] == 1.0, (first, trunk_rows[branch.start])
        cfg = TrainConfig(steps=branch.horizon, warmup_steps=2, schedule="wsd", cooldown_frac=0.25, min_lr_ratio=0.0)
        bad = [(r["step"], r["lr_scale"]) for r in rows if abs(r["lr_scale"] - lr_scale(r["step"], cfg)) > 1e-15]
        assert not bad, bad
    for branch in found[1:]:
        steps = branch.horizon
        run(*COMMON, f"results_dir={root / 'scratch'}", f"train.steps={steps}", f"run_id=scratch-{steps}")
        scratch = {r["step"]: r for r in read_metrics(root / "scratch" / f"scratch-{steps}")}
        branched = {r["step"]: r for r in read_metrics(_branch_dir(root, branch))}
        pairs = [(s, branched[s].get(k), scratch[s].get(k)) for s in branched for k in ("loss/train", "loss/val")
                 if k in branched[s]]
        # exact: the branch resumes the trunk's state at its start, which is the run's (same seed, data, rate)
        assert pairs and all(a == b for _, a, b in pairs), (steps, pairs)


def _branch_dir(root: Path, branch: branches.Branch) -> Path:
    from experiments.sweeps.sweep import run_ref_for

    return run_ref_for(list(branch.job)).path


def test_completed_branches_are_skipped_and_a_missing_checkpoint_is_one_line(trunk, capsys) -> None:
    root, sweep = trunk
    found = branches.all_branches(str(sweep), [])
    assert branches.launch(found, run=lambda job: 1) == {"launched": 0, "skipped": 4, "failed": 0}
    odd = root / "odd.yaml"  # a 10-step branch leaves at step 8 (10 - round(2.5)): the trunk kept 6, 12, 18, 24
    odd.write_text(sweep.read_text().replace("horizons: [8, 16, 24, 40, 48]", "horizons: [10]"))
    with pytest.raises(SystemExit) as exit_:
        branches.main([str(odd)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("error: ") and "no checkpoint at step 8" in err[-1], err
