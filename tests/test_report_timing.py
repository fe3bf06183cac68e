"""``analysis.report --timing``: speed ratios from runs that measured each setting alone (``analysis.timing``),
on the synthetic campaign of ``tests/test_report_paper.py`` plus timing runs written here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from analysis import report
from analysis.load import load_results
from analysis.timing import with_timing
from tests.test_report_paper import make_campaign

TIMED = {"adamw-s1": (2000.0, 0.50), "hmt-s1": (1000.0, 1.00)}  # timing run copied from -> (tokens/s, step s)


def make_timing(campaign: Path, out: Path) -> Path:
    """A timing run per setting copied from a campaign run: lr, steps, warm-up and seed changed, speeds set."""
    for source, (tps, step) in TIMED.items():
        run = Path(shutil.copytree(campaign / source, out / f"timing-{source}"))
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["method"]["lr"] = 1e-3
        config["train"].update(steps=60, warmup_steps=5, eval_every=60)
        config.update(seed=0, run_id=run.name, results_dir=str(out))
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        summary = json.loads((run / "summary.json").read_text())
        summary.update(run_id=run.name, tokens_per_s=tps, step_time_s=step, step_time_median_s=step)
        (run / "summary.json").write_text(json.dumps(summary))
    return out


def test_speed_comes_from_the_timing_run_of_the_same_setting(tmp_path: Path) -> None:
    campaign = make_campaign(tmp_path)
    timing = make_timing(campaign, tmp_path / "timing")
    runs, matched = with_timing(load_results(campaign).runs, load_results(timing).runs)
    done = runs[runs["status"] == "completed"]
    by_method = {m: g for m, g in done.groupby("variant")}
    adamw = done[(done["method"] == "adamw") & (done["model"] == "tiny") & done["run_id"].str.startswith("adamw-s")]
    hmt = done[done["run_id"].str.startswith("hmt-s")]
    assert len(adamw) == 3 and len(hmt) == 3 and matched == 6, (len(adamw), len(hmt), matched, sorted(by_method))
    assert set(adamw["tokens_per_s"]) == {2000.0} and set(hmt["step_time_s"]) == {1.0}, (adamw, hmt)
    others = done[~done["run_id"].isin(list(adamw["run_id"]) + list(hmt["run_id"]))]
    assert others["tokens_per_s"].isna().all(), "a setting without a timing run must show no speed"

    out = tmp_path / "rep"
    assert report.main([str(campaign), "--timing", str(timing), "--out", str(out), "--no-figures"]) == 0
    main = (out / "tables" / "main.md").read_text()
    hmt_rows = [line for line in main.splitlines() if line.startswith("| hmt | tiny |") and "| default |" in line]
    assert "timed alone" in main and hmt_rows, main
    assert "0.50×" in hmt_rows[0] and "2.00×" in hmt_rows[0], hmt_rows  # 1000/2000 tokens/s, 1.00/0.50 s


def test_timing_folder_with_no_matching_setting_is_one_error(tmp_path: Path, capsys) -> None:
    campaign = make_campaign(tmp_path)
    timing = make_timing(campaign, tmp_path / "timing")
    for run in timing.iterdir():  # another batch size: other work per step, so no setting matches
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["train"]["batch_size"] = 2
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as e:
        report.main([str(campaign), "--timing", str(timing), "--out", str(tmp_path / "rep"), "--no-figures"])
    err = capsys.readouterr().err
    assert e.value.code != 0 and err.startswith("error: --timing") and len(err.strip().splitlines()) == 1, err
