"""What the report warns about and what it only notes (``analysis.rundirs``, ``analysis.load``): a summary.json
holding ``{}`` is damaged like a truncated one (warned, skipped); the folders a committed tree holds by design —
dry runs with summary.json alone, a run copied beside a second campaign, different runs under one run_id — are
read without a warning and counted in one ``note:`` line per kind."""

from __future__ import annotations

import json
from pathlib import Path

from test_analysis import write_run

from analysis import report
from analysis.load import load_results


def test_an_empty_summary_is_skipped_with_a_warning_like_a_truncated_one(tmp_path: Path) -> None:
    write_run(tmp_path, "good", method="adamw", model="tiny", seed=0)
    for name, text in (("empty", "{}"), ("truncated", '{"run_id": "trunc')):
        run = write_run(tmp_path, name, method="adamw", model="tiny", seed=1)
        (run / "summary.json").write_text(text)
    warnings: list[str] = []
    results = load_results(tmp_path, warn=warnings.append)
    assert list(results.runs["run_id"]) == ["good"], results.runs[["run_id", "status"]]
    assert len(warnings) == 2 and all("run skipped" in w for w in warnings), warnings
    assert f"{tmp_path / 'empty' / 'summary.json'}: holds an empty JSON object" in warnings[0], warnings


def _dry_run(root: Path, name: str) -> None:
    """A dry-run table's folder: summary.json alone (benchmarks.dryrun_table writes no config or metrics)."""
    run = write_run(root, name, method="hmt", model="7b", seed=0, mode="dryrun", val=None)
    for extra in ("config.yaml", "metrics.jsonl", "status"):
        (run / extra).unlink()


def test_expected_folders_get_one_note_per_kind_and_no_warning(tmp_path: Path, capsys) -> None:
    write_run(tmp_path / "a", "adamw-tiny-s0", method="adamw", model="tiny", seed=0, val=3.0)
    write_run(tmp_path / "b", "adamw-tiny-s0", method="adamw", model="tiny", seed=0, val=3.0)  # an identical copy
    for plan in ("p1", "p2", "p3"):  # the planner's verification runs: one run_id, different runs
        write_run(tmp_path / "plans" / plan, "verify", method="hmt", model="tiny", seed=0, val=3.0 + int(plan[1]))
    for name in ("7b-adamw", "7b-hmt"):
        _dry_run(tmp_path / "dry", name)
    warnings: list[str] = []
    results = load_results(tmp_path, warn=warnings.append)
    assert warnings == [], warnings
    ids = sorted(results.runs["run_id"])
    assert ids == ["7b-adamw", "7b-hmt", "adamw-tiny-s0", "plans/p2/verify", "plans/p3/verify", "verify"], ids
    losses = results.runs.set_index("run_id")["val_loss"]
    assert (losses["verify"], losses["plans/p2/verify"], losses["plans/p3/verify"]) == (4.0, 5.0, 6.0), losses
    notes = results.notes
    assert [n.split(" ", 2)[:2] for n in notes] == [["2", "dry"], ["1", "folder(s)"], ["2", "run(s)"]], notes
    assert report.main([str(tmp_path), "--out", str(tmp_path.parent / "out"), "--no-figures"]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and err.count("note: ") == 3, err
    index = (tmp_path.parent / "out" / "index.md").read_text()
    assert "Folders read as expected (not damage):" in index and "Damaged runs" not in index, index


def test_a_finished_training_run_without_config_or_metrics_is_still_warned_about(tmp_path: Path) -> None:
    run = write_run(tmp_path, "train-run", method="adamw", model="tiny", seed=0)
    (run / "config.yaml").unlink()
    (run / "metrics.jsonl").unlink()
    warnings: list[str] = []
    results = load_results(tmp_path, warn=warnings.append)
    assert len(warnings) == 2 and results.notes == [], (warnings, results.notes)
    assert json.loads((run / "summary.json").read_text())["mode"] == "train"
