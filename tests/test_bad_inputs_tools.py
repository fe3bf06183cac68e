"""Bad input to the command-line tools ``python -m analysis.report`` and ``python -m experiments.sweep`` (and the
sweeper behind ``python -m experiments.run -m``), driven as a user drives them: in a subprocess.

Every bad input must end in one line ``error: ...`` on stderr that names the culprit (the folder, file, key or
value), a non-zero exit status, no Python traceback, and no change to what was there before (a previous report,
the README, the user's files). Damaged runs in a results tree are skipped with a ``warning:`` naming the file
while the report goes on. Also proven: runs are found at any depth, and the report averages only runs of one
setting (two seeds of one setting are "Seeds 2"; two ranks are two rows told apart by a Setting column).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_analysis import write_run

from analysis.load import load_results
from analysis.main_table import main_table
from analysis.report import README_BEGIN, README_END

REPO = Path(__file__).resolve().parent.parent


# ---- helpers ----------------------------------------------------------------------------------------------------
def run_tool(*args: str | Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180, check=False)


def report(*args: str | Path) -> subprocess.CompletedProcess:
    return run_tool("-m", "analysis.report", *args, "--no-figures")


def sweep_cli(*args: str | Path) -> subprocess.CompletedProcess:
    return run_tool("-m", "experiments.sweeps.sweep", *args)


def assert_one_line_error(done: subprocess.CompletedProcess, *culprits: str | Path) -> str:
    """The tool failed with ``error: ...`` as the last line of stderr, naming every culprit; no traceback."""
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Traceback" not in output, output
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), output
    for culprit in culprits:
        assert str(culprit) in lines[-1], f"{culprit!r} not named in: {lines[-1]}"
    return lines[-1]


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` (or the file itself) with its bytes and mtime."""
    paths = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in paths}


def no_leftovers(folder: Path) -> bool:
    """No staging folder of an interrupted report was left behind."""
    return not [p for p in folder.iterdir() if p.name.startswith(".") and (".new-" in p.name or ".old-" in p.name)]


def set_config(run_dir: Path, **settings) -> None:
    """Give a synthetic run a fuller config.yaml: ``method={"rank": 32}`` merges into the ``method`` mapping."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config.setdefault("train", {"steps": 4, "progress": False})
    for key, value in settings.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def nested_results(tmp_path_factory) -> Path:
    """``results/campaign/pretrain/<run>`` (depth 2): two seeds of adamw, one hmt run; plus folders the search
    must skip (a run's checkpoints, a wandb mirror, hydra's .multirun) holding decoys that would be damaged runs."""
    root = tmp_path_factory.mktemp("nested") / "results"
    runs = root / "campaign" / "pretrain"
    for seed in (0, 1):
        write_run(runs, f"adamw-tiny-s{seed}", method="adamw", model="tiny", seed=seed, peak_gib=0.5)
    hmt = write_run(runs, "hmt-tiny-s0", method="hmt", model="tiny", seed=0, peak_gib=0.25)
    for decoy in (hmt / "checkpoints" / "step-2", root / "campaign" / "wandb" / "offline-run",
                  root / ".multirun" / "0"):
        decoy.mkdir(parents=True)
        (decoy / "summary.json").write_text('{"cut short')
    return root


@pytest.fixture
def results_copy(nested_results: Path, tmp_path: Path) -> Path:
    """A private copy of the nested results, free to damage."""
    return Path(shutil.copytree(nested_results, tmp_path / "results"))


@pytest.fixture
def previous_report(nested_results: Path, tmp_path: Path) -> Path:
    """A report written earlier, which failed later attempts must leave exactly as it is."""
    out = tmp_path / "report"
    assert report(nested_results, "--out", out).returncode == 0
    return out


# ---- analysis.report: finding runs, damaged runs ---------------------------------------------------------------
def test_report_finds_runs_at_depth_two_and_skips_decoy_folders(nested_results: Path, tmp_path: Path) -> None:
    done = report(nested_results, "--out", tmp_path / "report")
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr, "a decoy under checkpoints/, wandb/ or .multirun/ was read"
    runs = pd.read_parquet(tmp_path / "report" / "data" / "runs.parquet")
    assert sorted(runs["run_id"]) == ["adamw-tiny-s0", "adamw-tiny-s1", "hmt-tiny-s0"]
    main = (tmp_path / "report" / "tables" / "main.md").read_text()
    # seeds, lr, val loss, perplexity, optimizer state, peak memory
    assert "| adamw | tiny | 2 | — | 3.000 ± 0.000 | 20.1 | — | 0.50 |" in main, main
    assert "| hmt | tiny | 1 | — | 3.000 | 20.1 | — | 0.25 |" in main, main
    assert no_leftovers(tmp_path)


def test_empty_results_folder_is_an_error_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert_one_line_error(report(tmp_path / "empty", "--out", tmp_path / "report"),
                          f"no runs with summary.json under {tmp_path / 'empty'}")
    assert not (tmp_path / "report").exists() and no_leftovers(tmp_path)


@pytest.mark.parametrize("make", ["missing", "file"])
def test_results_path_that_is_no_folder(tmp_path: Path, make: str) -> None:
    path = tmp_path / "results"
    if make == "file":
        path.write_text("not a folder\n")
    assert_one_line_error(report(path, "--out", tmp_path / "report"), path)
    assert not (tmp_path / "report").exists()


def test_truncated_summary_is_skipped_with_a_warning(results_copy: Path, tmp_path: Path) -> None:
    summary = results_copy / "campaign" / "pretrain" / "hmt-tiny-s0" / "summary.json"
    summary.write_text(summary.read_text()[:200])
    done = report(results_copy, "--out", tmp_path / "report")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert f"warning: {summary}: not valid JSON" in done.stderr
    main = (tmp_path / "report" / "tables" / "main.md").read_text()
    assert "| adamw | tiny | 2 |" in main and "hmt" not in main
    assert str(summary) in (tmp_path / "report" / "index.md").read_text()


def test_only_damaged_runs_is_an_error_naming_them(tmp_path: Path) -> None:
    run = write_run(tmp_path / "results" / "sweep", "adamw-tiny-s0", method="adamw", model="tiny", seed=0)
    (run / "summary.json").write_text('{"run_id": "adamw-tiny-s0", "memory": {"peak_by')
    done = report(tmp_path / "results", "--out", tmp_path / "report")
    assert_one_line_error(done, f"no runs with summary.json under {tmp_path / 'results'}", "damaged")
    assert f"warning: {run / 'summary.json'}: not valid JSON" in done.stderr
    assert not (tmp_path / "report").exists()


def test_missing_and_torn_metrics_are_warned_about(results_copy: Path, tmp_path: Path) -> None:
    runs = results_copy / "campaign" / "pretrain"
    (runs / "hmt-tiny-s0" / "metrics.jsonl").unlink()
    torn = runs / "adamw-tiny-s1" / "metrics.jsonl"
    torn.write_text(torn.read_text() + '{"step": 4, "loss/tr')  # killed while writing step 4
    done = report(results_copy, "--out", tmp_path / "report")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert f"warning: {runs / 'hmt-tiny-s0' / 'metrics.jsonl'}: missing" in done.stderr
    assert f"warning: {torn}: line 5 is cut short" in done.stderr
    metrics = pd.read_parquet(tmp_path / "report" / "data" / "metrics.parquet")
    assert metrics.groupby("run_id").size().to_dict() == {"adamw-tiny-s0": 4, "adamw-tiny-s1": 4}
    assert "| hmt | tiny | 1 | — | 3.000 | 20.1 | — | 0.25 |" in (tmp_path / "report" / "tables" / "main.md").read_text()


# ---- analysis.report: where it writes ---------------------------------------------------------------------------
def test_out_that_is_a_file_is_left_alone(nested_results: Path, tmp_path: Path) -> None:
    target = tmp_path / "notes.md"
    target.write_text("my notes\n")
    before = snapshot(target)
    assert_one_line_error(report(nested_results, "--out", target), f"--out {target}", "is a file")
    assert snapshot(target) == before and no_leftovers(tmp_path)


def test_out_that_is_someone_elses_folder_is_left_alone(nested_results: Path, tmp_path: Path) -> None:
    theirs = tmp_path / "paper"
    (theirs / "sections").mkdir(parents=True)
    (theirs / "main.tex").write_text("\\documentclass{article}\n")
    before = snapshot(theirs)
    assert_one_line_error(report(nested_results, "--out", theirs), f"--out {theirs}", "main.tex")
    assert snapshot(theirs) == before and no_leftovers(tmp_path)


def test_a_previous_reports_own_markdown_pages_are_kept(previous_report: Path, nested_results: Path,
                                                         tmp_path: Path) -> None:
    """docs/campaign holds findings.md beside the report's entries: regenerating keeps it, byte for byte; a folder
    of Markdown pages that was never a report (no index.md) is still someone else's and left alone."""
    (previous_report / "findings.md").write_text("# What it means\n")
    assert report(nested_results, "--out", previous_report).returncode == 0
    assert (previous_report / "findings.md").read_text() == "# What it means\n"
    assert (previous_report / "index.md").is_file() and no_leftovers(tmp_path)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "draft.md").write_text("draft\n")
    before = snapshot(notes)
    assert_one_line_error(report(nested_results, "--out", notes), f"--out {notes}", "draft.md")
    assert snapshot(notes) == before


def test_out_below_a_file_cannot_be_made(nested_results: Path, tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("")
    assert_one_line_error(report(nested_results, "--out", tmp_path / "blocker" / "report"), tmp_path / "blocker")


def test_failures_leave_a_previous_report_and_readme_untouched(previous_report: Path, results_copy: Path,
                                                               tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\nno table markers here\n")
    before = {**snapshot(previous_report), **snapshot(readme)}
    (tmp_path / "empty").mkdir()
    assert_one_line_error(report(tmp_path / "empty", "--out", previous_report), tmp_path / "empty")
    assert_one_line_error(report(results_copy, "--out", previous_report, "--readme", readme), readme,
                          "no results table block")
    assert_one_line_error(report(results_copy, "--out", previous_report, "--readme", tmp_path / "NOPE.md"),
                          tmp_path / "NOPE.md", "no such file")
    assert {**snapshot(previous_report), **snapshot(readme)} == before and no_leftovers(tmp_path)


def test_a_previous_report_is_replaced_whole(previous_report: Path, results_copy: Path, tmp_path: Path) -> None:
    (previous_report / "tables" / "stale.md").write_text("from an older version\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"# Project\n\n{README_BEGIN}\nold\n{README_END}\n")
    done = report(results_copy, "--out", previous_report, "--readme", readme)
    assert done.returncode == 0, done.stderr
    assert not (previous_report / "tables" / "stale.md").exists() and (previous_report / "index.md").exists()
    assert "| adamw | tiny | 2 | — | 3.000 ± 0.000 | 20.1 | — | 0.50 |" in readme.read_text()
    assert no_leftovers(tmp_path)


# ---- analysis: grouping by setting ------------------------------------------------------------------------------
def test_runs_differing_only_in_seed_are_one_row(tmp_path: Path) -> None:
    for seed in (0, 1):
        run = write_run(tmp_path, f"hmt-tiny-s{seed}", method="hmt", model="tiny", seed=seed)
        set_config(run, method={"rank": 32}, train={"steps": 4, "progress": seed == 0}, results_dir=f"r{seed}")
    table = main_table(load_results(tmp_path))
    assert "Setting" not in table.columns and "Variant" not in table.columns
    assert [row[:3] for row in table.rows] == [["hmt", "tiny", "2"]]


def test_runs_differing_in_a_setting_are_separate_rows(tmp_path: Path) -> None:
    for rank, seeds in ((32, (0, 1)), (8, (0,))):
        for seed in seeds:
            run = write_run(tmp_path, f"hmt-tiny-r{rank}-s{seed}", method="hmt", model="tiny", seed=seed,
                            val=3.0 + rank / 100)
            set_config(run, method={"rank": rank, "tau": 0.95})
    write_run(tmp_path, "adamw-tiny-s0", method="adamw", model="tiny", seed=0)
    table = main_table(load_results(tmp_path))
    assert table.columns[:4] == ["Method", "Model", "Setting", "Seeds"]
    assert [row[:4] for row in table.rows] == [["adamw", "tiny", "", "1"], ["hmt", "tiny", "method.rank=8", "1"],
                                               ["hmt", "tiny", "method.rank=32", "2"]]
    assert [row[5] for row in table.rows[1:]] == ["3.080", "3.320 ± 0.000"]  # validation loss


def test_ignored_keys_match_the_runners_run_identity() -> None:
    from analysis.settings import IGNORED_TRAIN_KEYS
    from experiments.config import RUN_ID_IGNORED_TRAIN_KEYS

    assert IGNORED_TRAIN_KEYS == RUN_ID_IGNORED_TRAIN_KEYS


# ---- experiments.sweeps.sweep and the sweeper ---------------------------------------------------------------------------
def test_unknown_sweep_name() -> None:
    line = assert_one_line_error(sweep_cli("status", "paper_mian"), "sweep paper_mian: not found")
    assert "paper_main" in line, "the known sweeps are listed"


@pytest.mark.parametrize("text, culprits", [
    ("grid:\n  method: [adamw\n  seed: [0]\n", ("not valid YAML", "line 3")),
    ("grid: [method=adamw, seed=0]\n", ("`grid` must be a mapping",)),
    ("runs:\n  - [method: adamw]\n", ("`runs` entry 0", "{'method': 'adamw'}")),
    ("common: train.steps=3\ngrid:\n  method: [adamw]\n", ("`common` must be a list", "train.steps=3")),
    ("gird:\n  method: [adamw]\n", ("unknown sweep file keys", "gird")),
], ids=["syntax", "grid-not-mapping", "run-not-override", "common-not-list", "unknown-key"])
def test_broken_sweep_file(tmp_path: Path, text: str, culprits: tuple[str, ...]) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    assert_one_line_error(sweep_cli("list", path), path, *culprits)


@pytest.fixture(scope="module")
def composing_runs(tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """(their folder, {case: result}) of the CLI runs that compose Hydra configs. Each imports torch (seconds of
    start-up), so they are started together and overlap."""
    base = tmp_path_factory.mktemp("composing")
    (base / "blocker").write_text("")
    (base / "bad.yaml").write_text("runs:\n  - [method=adamw]\n  - [method=hmt, method.rnk=3]\n")
    results = f"results_dir={base / 'results'}"
    cases = {
        "unknown-key": ["experiments.sweeps.sweep", "list", "smoke", "method.rnk=3"],
        "wrong-type": ["experiments.sweeps.sweep", "status", "smoke", "train.steps=abc"],
        "unknown-method": ["experiments.sweeps.sweep", "array", "-", "method=adamww"],
        "unwritable-results": ["experiments.sweeps.sweep", "mark-failed", "smoke", "--index", "0", "--reason", "killed",
                               f"results_dir={base / 'blocker' / 'results'}"],
        "multirun-unknown-sweep": ["experiments.run", "-m", "hydra.sweeper.file=no_such_sweep", results],
        "multirun-bad-run": ["experiments.run", "-m", f"hydra.sweeper.file={base / 'bad.yaml'}", results],
    }
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    started = {case: subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for case, args in cases.items()}
    done = {}
    for case, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        done[case] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return base, done


@pytest.mark.parametrize("case, culprits", [
    ("unknown-key", ("method.rnk", "experiments/sweeps/smoke.yaml")),
    ("wrong-type", ("train.steps=abc", "'abc'")),
    ("unknown-method", ("method/adamww", "available: adafactor, adamw", "the command-line grid")),
])
def test_bad_override(composing_runs, case: str, culprits: tuple[str, ...]) -> None:
    assert_one_line_error(composing_runs[1][case], *culprits)


def test_override_syntax_error() -> None:
    assert_one_line_error(sweep_cli("list", "smoke", "train.steps=[1,"), "'train.steps=[1,'")


def test_index_out_of_range_and_unwritable_results(composing_runs) -> None:
    assert_one_line_error(sweep_cli("overrides", "smoke", "--index", "7"), "--index 7", "3 runs")
    base, done = composing_runs
    assert_one_line_error(done["unwritable-results"], "cannot mark", base / "blocker")


def test_multirun_with_bad_sweep_stops_before_launching(composing_runs) -> None:
    base, done = composing_runs
    assert_one_line_error(done["multirun-unknown-sweep"], "sweep no_such_sweep: not found")
    assert_one_line_error(done["multirun-bad-run"], "method.rnk", f"run 1 of {base / 'bad.yaml'}")
    assert not (base / "results").exists(), "nothing may be launched when one run of the sweep is invalid"
