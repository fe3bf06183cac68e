"""Tuned sweeps: the learning-rate search, the selection rule, the seeded final runs, and the local multirun that
runs both stages in one command (through ``tests/standin_run.py``, whose validation loss is a known parabola in
log10(lr) with its minimum at 3e-3 and which fails like a diverged run at lr ≥ 0.1)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.sweeps import sweep
from experiments.sweeps import tuning
from experiments.errors import UserError

REPO = Path(__file__).resolve().parent.parent
STANDIN = REPO / "tests" / "standin_run.py"
GRID = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1]


@pytest.mark.parametrize("block, message", [
    ({"lrs": [1e-3, 1e-2]}, "at least 5 distinct"),
    ({"lrs": GRID, "seeds": [0, 1, 2]}, "must not contain the search seed 0"),
    ({"lrs": GRID, "seeds": [1, 2]}, "at least 3 distinct seeds"),
    ({"lrs": GRID, "metric": ""}, "tune.metric"),
    ({"lrs": GRID, "lr": 1}, "unknown `tune` keys ['lr']"),
    ({"seeds": [1, 2, 3]}, "needs `lrs`"),
    ({"lrs": ["fast", 1, 2, 3, 4]}, "list of numbers"),
    ({"lrs": GRID, "scan": {"method.dense_lr_scale": [1, 4]}}, "at least 3 distinct values"),
    ({"lrs": GRID, "scan": {"method.dense_lr_scale": [1, 4, 4, 16]}}, "at least 3 distinct values"),
    ({"lrs": GRID, "scan": {"a": [1, 2, 3], "b": [1, 2, 3]}}, "one config key"),
    ({"lrs": GRID, "scan": {"method.lr": [1, 2, 3]}}, "cannot scan method.lr"),
    ({"lrs": GRID[:2], "scan": {"method.dense_lr_scale": [1, 4, 16]}}, "at least 3 distinct"),
    ({"lrs": GRID[:3]}, "at least 5 distinct"),  # 3 rates only with a second axis
])
def test_bad_tune_blocks_are_rejected(block: dict, message: str) -> None:
    with pytest.raises(UserError) as e:
        tuning.parse_tune(block)
    assert message in str(e.value), str(e.value)


def test_selection_rule_lowest_then_smaller_rate_and_bracketing() -> None:
    assert tuning.select_lr({1e-3: 2.0, 3e-3: 1.5, 1e-2: 1.7}) == (3e-3, True)
    assert tuning.select_lr({1e-3: 1.5, 3e-3: 1.5, 1e-2: 1.7}) == (1e-3, False)  # tie -> smaller; at the edge
    assert tuning.select_lr({1e-3: 2.0, 3e-3: float("nan"), 1e-2: 1.0}) == (1e-2, False)
    assert tuning.select_lr({1e-3: None, 3e-3: math.inf}) == (1e-3, False)  # nothing finished: not bracketed


def test_pair_selection_rule_lowest_then_smaller_and_bracketing_on_both_axes() -> None:
    grid = {(lr, v): 2.0 for lr in (1e-3, 3e-3, 1e-2) for v in (1.0, 4.0, 16.0)}
    assert tuning.select_pair({**grid, (3e-3, 4.0): 1.0}) == ((3e-3, 4.0), True)
    assert tuning.select_pair({**grid, (3e-3, 16.0): 1.0}) == ((3e-3, 16.0), False)  # value at its axis' end
    assert tuning.select_pair({**grid, (1e-3, 4.0): 1.0}) == ((1e-3, 4.0), False)  # rate at its axis' end
    assert tuning.select_pair({**grid, (3e-3, 4.0): 1.0, (1e-2, 1.0): 1.0}) == ((3e-3, 4.0), True)  # tie: smaller rate


def _finished(run_dir: Path, state: str, val_loss: float | None = None) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "status").write_text(state + "\n")
    if val_loss is not None:
        (run_dir / "summary.json").write_text(json.dumps({"val_loss": val_loss}))


def test_final_runs_appear_only_when_every_search_has_finished(tmp_path: Path) -> None:
    spec = tuning.parse_tune({"lrs": GRID[:5], "lrs_by_method": {"qlora": GRID[2:]}, "seeds": [4, 5, 6]})
    rows = [["method=adamw", f"results_dir={tmp_path / 'r'}"], ["method=qlora"]]
    lookup = tuning.RunLookup(run_path=lambda job: tmp_path / "runs" / "_".join(job).replace("/", "|"),
                              default_results_dir=str(tmp_path / "default"))
    jobs = tuning.tuned_jobs(rows, spec, lookup)
    assert len(jobs) == 10 and all("seed=0" in job for job in jobs)
    assert jobs[0] == ["method=adamw", "method.lr=0.0001", "seed=0", f"results_dir={tmp_path / 'r'}-lr-search"]
    assert jobs[5][-3:] == ["method.lr=0.001", "seed=0", f"results_dir={tmp_path / 'default'}-lr-search"]
    losses = {0: [3.0, 2.0, 1.5, 1.6, None], 1: [1.4, 1.2, 1.3, 9.0, None]}  # None: diverged (failed)
    for i, job in enumerate(jobs[:-1]):
        loss = losses[i // 5][i % 5]
        _finished(lookup.run_path(job), "failed" if loss is None else "completed", loss)
    assert tuning.tuned_jobs(rows, spec, lookup) == jobs, "one search run still pending: no final runs yet"
    _finished(lookup.run_path(jobs[-1]), "failed")
    final = tuning.tuned_jobs(rows, spec, lookup)[10:]
    assert final == [["method=adamw", f"results_dir={tmp_path / 'r'}", "method.lr=0.001", f"seed={s}"]
                     for s in (4, 5, 6)] + [["method=qlora", "method.lr=0.003", f"seed={s}"] for s in (4, 5, 6)]


def test_a_scan_searches_every_pair_then_runs_the_best_pair_with_seeds(tmp_path: Path) -> None:
    spec = tuning.parse_tune({"lrs": [3e-4, 1e-3, 3e-3], "scan": {"method.dense_lr_scale": [16, 1, 4]}})
    lookup = tuning.RunLookup(run_path=lambda job: tmp_path / "_".join(job).replace("/", "|"))
    jobs = tuning.tuned_jobs([["method=adamw"]], spec, lookup)
    assert len(jobs) == 9 and jobs[1] == ["method=adamw", "method.lr=0.001", "method.dense_lr_scale=16", "seed=0",
                                          "results_dir=results-lr-search"], jobs  # the file's value order
    for job in jobs:  # lowest at (1e-3, 4): both coordinates interior
        lr, scale = float(job[1].partition("=")[2]), float(job[2].partition("=")[2])
        _finished(lookup.run_path(job), "completed", abs(lr - 1e-3) * 1e3 + abs(scale - 4))
    final = tuning.tuned_jobs([["method=adamw"]], spec, lookup)[9:]
    assert final == [["method=adamw", "method.lr=0.001", "method.dense_lr_scale=4", f"seed={s}"]
                     for s in (1, 2, 3)], final
    with pytest.raises(UserError, match="sets method.dense_lr_scale"):
        tuning.tuned_jobs([["method=adamw", "method.dense_lr_scale=2"]], spec, lookup)


def test_rows_must_leave_lr_and_seed_to_the_search(tmp_path: Path) -> None:
    spec = tuning.parse_tune({"lrs": GRID})
    lookup = tuning.RunLookup(run_path=lambda job: tmp_path, default_results_dir="results")
    for row, key in ((["method=hmt", "method.lr=0.01"], "method.lr"), (["seed=3"], "sets seed")):
        with pytest.raises(UserError, match=key):
            tuning.tuned_jobs([row], spec, lookup)


def test_tuned_local_multirun_searches_then_reruns_the_winner_with_seeds(tmp_path: Path, capsys) -> None:
    sweep_file = tmp_path / "tuned.yaml"
    sweep_file.write_text("runs:\n  - [method=adamw]\n  - [method=hmt]\n"
                          f"tune:\n  lrs: {GRID}\n  seeds: [1, 2, 3]\n")
    results = tmp_path / "results"
    done = subprocess.run([sys.executable, str(STANDIN), "-m", f"hydra.sweeper.file={sweep_file}",
                           f"results_dir={results}", "cluster=local"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log  # the diverged search runs (lr 0.1) are results, not a failed sweep
    assert "14 runs: 14 to launch" in log and "6 more runs now that the learning-rate search has finished" in log
    search = sorted((results.parent / "results-lr-search").glob("*/summary.json"))
    assert len(search) == 12, "12 of the 14 search runs complete; both lr=0.1 runs fail"
    finals = [json.loads(p.read_text()) for p in results.glob("*/summary.json")]
    assert sorted((f["method"], f["seed"]) for f in finals) == [(m, s) for m in ("adamw", "hmt") for s in (1, 2, 3)]
    for f in finals:  # the stand-in's loss is lowest at 3e-3: the winner, run with each final seed
        assert f["val_loss"] == pytest.approx(1.0 + 1e-3 * f["seed"]), f
    code = sweep.main(["status", str(sweep_file), f"results_dir={results}"])
    assert code == 0 and "0 pending, 0 running, 18 completed, 2 failed of 20" in capsys.readouterr().out
    from analysis import report  # the report renders the search with the tuner's own selection rule

    out = tmp_path / "report"
    assert report.main([str(results), "--out", str(out), "--no-figures"]) == 0
    search_table = (out / "tables" / "lr_search.md").read_text()
    for method in ("adamw", "hmt"):
        row = next(line for line in search_table.splitlines() if line.startswith(f"| {method} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-2:] == ["0.003", "yes"] and cells[-3] == "failed" and cells[5] == "1.000", row
    versus = (out / "tables" / "versus_adamw.md").read_text()
    row = next(line for line in versus.splitlines() if line.startswith("| hmt |"))
    assert "| 3 | 1.002 ± 0.001 | +0.000 | 1.000 | no |" in row, versus


def test_table_rows_are_compared_paired_by_seed() -> None:
    """The ablation/batch/embedding rows' verdict is the paired t-test over common seeds: a difference of 0.01 at
    every seed counts although the seeds' spread (0.1) hides it from an unpaired test; one seed cannot tell."""
    import pandas as pd
    from scipy import stats as scipy_stats

    from analysis.rows import loss_cells

    a = pd.DataFrame({"seed": [1, 2, 3], "val_loss": [3.00, 3.10, 3.20]})
    b = pd.DataFrame({"seed": [1, 2, 3], "val_loss": [3.011, 3.109, 3.211]})
    welch = scipy_stats.ttest_ind(a["val_loss"], b["val_loss"], equal_var=False).pvalue
    assert welch > 0.5, welch
    assert loss_cells(a, b) == ["3.100 ± 0.100", "-0.010", "lower"], loss_cells(a, b)
    assert loss_cells(b, a)[2] == "higher"
    assert loss_cells(a.iloc[:1], b)[2] == "—"  # one common seed
    mixed = pd.DataFrame({"seed": [1, 2, 3], "val_loss": [3.02, 3.09, 3.21]})
    assert loss_cells(a, mixed)[2] == "no"
