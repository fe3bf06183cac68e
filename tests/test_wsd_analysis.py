"""``analysis.wsd`` on a small hand-made results folder: two rows (AdamW split, HMT) × seeds 1-3, trunks of 8 steps
and branches at 4 steps. Per horizon, each row's Δ against AdamW split is the mean of the seed-paired differences,
and its p is scipy's paired t-test (``scipy.stats.ttest_rel``) on those seeds, computed here independently of
``analysis.stats``; a seed only one row ran is not paired; the files ``main`` writes carry the same numbers, under the names
``--row-name`` gives; a name for a row that is not there is one ``error:`` line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml
from scipy import stats

from analysis import wsd
from experiments.errors import UserError

# {horizon: {method: {seed: validation loss}}}; HMT's seed 4 has no AdamW partner and must not enter the test
LOSSES = {
    4: {"adamw": {1: 5.10, 2: 5.04, 3: 5.13}, "hmt": {1: 5.02, 2: 5.00, 3: 4.98, 4: 4.00}},
    8: {"adamw": {1: 4.60, 2: 4.71, 3: 4.55}, "hmt": {1: 4.58, 2: 4.66, 3: 4.57}},
}
LRS = {"adamw": 1e-3, "hmt": 1e-2}
TRUNK_STEPS = 8


def write_run(root: Path, method: str, seed: int, steps: int, val: float, lr: float | None = None) -> None:
    """A completed run folder: ``method`` at ``lr`` (default ``LRS[method]``), ``steps`` steps, final losses ``val``."""
    lr = LRS[method] if lr is None else lr
    run_id = f"{method}-tiny-train-s{seed}-h{steps}" + ("" if lr == LRS[method] else f"-lr{lr:g}")
    run = root / run_id
    run.mkdir(parents=True)
    config = {"method": {"name": method, "lr": lr}, "model": {"name": "tiny"}, "seed": seed,
              "mode": "train", "run_id": run_id,
              "train": {"steps": steps, "schedule": "wsd", "cooldown_frac": 0.25, "warmup_steps": 1,
                        "seq_len": 128, "batch_size": 8, "grad_accum": 1}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "status").write_text("completed\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": steps - 1, "loss/train": val, "loss/val": val}) + "\n")
    summary = {"run_id": run_id, "method": method, "model": "tiny", "mode": "train", "device": "cpu", "seed": seed,
               "steps": steps, "tokens": steps * 1024, "train_loss": val, "val_loss": val}
    (run / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    trunks, branches = tmp_path / "wsd", tmp_path / "wsd-branches"
    for horizon, rows in LOSSES.items():
        for method, seeds in rows.items():
            for seed, val in seeds.items():
                write_run(trunks if horizon == TRUNK_STEPS else branches, method, seed, horizon, val)
    return trunks, branches


def _expected(horizon: int) -> tuple[float, float]:
    """Δ (HMT − AdamW split, mean over the common seeds) and the paired t-test's two-sided p, by scipy."""
    a, h = LOSSES[horizon]["adamw"], LOSSES[horizon]["hmt"]
    seeds = sorted(set(a) & set(h))
    diffs = [h[s] - a[s] for s in seeds]
    return sum(diffs) / len(diffs), float(stats.ttest_rel([h[s] for s in seeds], [a[s] for s in seeds]).pvalue)


def test_per_horizon_delta_and_paired_p_match_scipy(folders) -> None:
    trunks, branches = folders
    runs = wsd.horizon_runs(trunks, branches)
    assert sorted(runs["horizon"].unique()) == [4, 8] and set(runs["row"]) == {"adamw", "hmt"}, runs
    table = wsd.horizon_table(runs, "t", tokens_per_step=1024)
    cells = {(r[0], int(r[1].replace(",", ""))): r for r in table.rows}
    assert set(cells) == {(row, h) for row in ("adamw", "hmt") for h in (4, 8)}, cells
    for horizon in (4, 8):
        delta, p = _expected(horizon)
        row = cells[("hmt", horizon)]
        assert row[5] == f"{delta:+.3f}", (horizon, row, delta)
        assert 0.001 <= p < 1 and row[6] == f"{p:.3f}", (horizon, row, p)
        assert row[3] == str(len(LOSSES[horizon]["hmt"])), row  # seeds run, paired or not
        ref = cells[("adamw", horizon)]
        assert ref[5] == ref[6] == "—", ref  # the reference row has no Δ against itself
    # the numbers themselves, so a wrong pairing that scipy would share cannot pass unnoticed
    assert cells[("hmt", 4)][5] == "-0.090" and cells[("hmt", 8)][5] == "-0.017", cells
    assert [name for name, _ in table.sections] == ["4 steps (0.00 M tokens)", "8 steps (0.01 M tokens)"]


def test_main_writes_the_table_and_figure_with_the_same_numbers(folders, tmp_path: Path) -> None:
    trunks, _ = folders
    out = tmp_path / "out"
    assert wsd.main([str(trunks), "--out", str(out), "--name", "h", "--row-name", "adamw=AdamW split (×64 dense)",
                     "--row-name", "hmt=HMT default"]) == 0
    md = (out / "tables" / "h.md").read_text()
    for horizon in (4, 8):
        delta, p = _expected(horizon)
        assert f"| HMT default | {horizon} | 0.01 | {len(LOSSES[horizon]['hmt'])} |" in md, md
        assert f"| {delta:+.3f} | {p:.3f} |" in md, md
        assert f"| AdamW split (×64 dense) | {horizon} | 0.001 | 3 |" in md, md
    assert "| adamw |" not in md and "| hmt |" not in md, md
    assert (out / "figures" / "h.png").stat().st_size > 0 and (out / "figures" / "h.pdf").stat().st_size > 0


def test_a_name_for_a_missing_row_is_one_error_line(folders, tmp_path: Path, capsys) -> None:
    trunks, _ = folders
    with pytest.raises(SystemExit) as exit_:
        wsd.main([str(trunks), "--out", str(tmp_path / "out"), "--row-name", "galore=GaLore"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("error: --row-name galore=...: no such row"), err


def test_tokens_per_step_come_from_the_trunks_configs(folders, tmp_path: Path) -> None:
    trunks, _ = folders
    assert wsd.tokens_per_step(trunks) == 128 * 8
    odd = trunks / "adamw-tiny-train-s1-h8" / "config.yaml"
    odd.write_text(odd.read_text().replace("seq_len: 128", "seq_len: 64"))
    with pytest.raises(UserError, match=r"tokens per step are \[512, 1024\]"):
        wsd.tokens_per_step(trunks)


def test_the_gap_panel_plots_the_paired_differences_mean_and_std(folders) -> None:
    """The figure's right panel: per horizon, the mean and sample std of HMT − AdamW split over the seeds both ran
    (seed 4 of HMT has no partner), computed here by hand."""
    runs = wsd.horizon_runs(*folders)
    deltas = wsd.paired_deltas(runs)
    assert list(deltas["row"]) == ["hmt", "hmt"], deltas
    for horizon in (4, 8):
        a, h = LOSSES[horizon]["adamw"], LOSSES[horizon]["hmt"]
        diffs = [h[s] - a[s] for s in (1, 2, 3)]
        mean = sum(diffs) / 3
        std = (sum((d - mean) ** 2 for d in diffs) / 2) ** 0.5
        got = deltas[deltas["horizon"] == horizon].iloc[0]
        # float sums in another order: equal to ~1e-15 of values ~0.1
        assert got["pairs"] == 3, got
        assert abs(got["delta"] - mean) < 1e-12 and abs(got["std"] - std) < 1e-12, (got, mean, std)
        assert abs(got["p"] - _expected(horizon)[1]) < 1e-12, (got, _expected(horizon))


def test_two_rows_of_one_method_get_two_colors_and_adamw_split_comes_first(folders) -> None:
    """A second HMT row (the leanest setting beside HMT default) must not share HMT default's color, and the
    reference row leads the legend and each table section whatever its name sorts as."""
    runs = wsd.horizon_runs(*folders, {"adamw": "Zeta AdamW split"})
    lean = runs[runs["method"] == "hmt"].assign(row="hmt: lean", val_loss=lambda f: f["val_loss"] + 0.5)
    runs = pd.concat([runs, lean], ignore_index=True)
    colors = wsd.row_colors(runs)
    assert set(colors) == {"Zeta AdamW split", "hmt", "hmt: lean"} and len(set(colors.values())) == 3, colors
    assert wsd.row_order(runs) == ["Zeta AdamW split", "hmt", "hmt: lean"], wsd.row_order(runs)
    table = wsd.horizon_table(runs, "t", tokens_per_step=1024)
    assert [r[0] for r in table.rows] == ["Zeta AdamW split", "hmt", "hmt: lean"] * 2, table.rows
    deltas = wsd.paired_deltas(runs).set_index(["horizon", "row"])["delta"]
    for horizon in (4, 8):  # the lean row is HMT + 0.5 at every seed: its gap is HMT's + 0.5 (to float rounding)
        assert abs(deltas[(horizon, "hmt: lean")] - deltas[(horizon, "hmt")] - 0.5) < 1e-12, deltas


def test_a_row_keeps_its_label_across_trunks_and_branches_whatever_else_a_folder_holds(folders) -> None:
    """A second HMT setting whose trunk is still running (or that has no branches yet) must not rename HMT default
    in one folder only: labels are told apart among the completed runs of both folders together."""
    trunks, branches = folders
    lean = trunks / "hmt-lean-s1"  # a trunk of another setting (Mode B), still running: not a row yet
    shutil.copytree(trunks / f"hmt-tiny-train-s1-h{TRUNK_STEPS}", lean)
    config = yaml.safe_load((lean / "config.yaml").read_text())
    config["method"]["mode"], config["run_id"] = "B", lean.name
    (lean / "config.yaml").write_text(yaml.safe_dump(config))
    (lean / "summary.json").write_text((lean / "summary.json").read_text().replace(f"-h{TRUNK_STEPS}", "-lean-s1"))
    (lean / "status").write_text("running\n")
    runs = wsd.horizon_runs(trunks, branches)
    assert set(runs["label"]) == {"adamw", "hmt"}, runs.groupby(["label", "horizon"]).size()
    (lean / "status").write_text("completed\n")  # now a row of its own, at the trunk's horizon only
    runs = wsd.horizon_runs(trunks, branches)
    hmt = {label: sorted({int(h) for h in g}) for label, g in runs[runs["method"] == "hmt"].groupby("label")["horizon"]}
    assert hmt == {"hmt: mode=B": [TRUNK_STEPS], "hmt: mode=(unset)": [4, TRUNK_STEPS]}, hmt  # short names


def test_an_extra_folder_at_another_rate_is_its_own_row_and_can_be_the_reference(folders, tmp_path: Path) -> None:
    """AdamW split rerun at 3e-4 to the trunk's horizon in an ``--extra`` folder: the AdamW label now has two rates,
    so two rows ``adamw (lr ...)``; which one the others pair with must be named, and then every Δ at that horizon
    is against it (HMT's and the 1e-3 row's), computed here by hand."""
    trunks, branches = folders
    extra = tmp_path / "retuned"
    retuned = {1: 4.50, 2: 4.56, 3: 4.49}
    for seed, val in retuned.items():
        write_run(extra, "adamw", seed, TRUNK_STEPS, val, lr=3e-4)
    with pytest.raises(UserError, match=r"several AdamW rows \(adamw \(lr 0.0003\), adamw \(lr 0.001\)\)"):
        wsd.horizon_runs(trunks, branches, extra=(extra,))
    with pytest.raises(UserError, match=r"--reference 'hmt': no such AdamW row"):
        wsd.horizon_runs(trunks, branches, extra=(extra,), reference="hmt")
    runs = wsd.horizon_runs(trunks, branches, extra=(extra,), reference="adamw (lr 0.0003)")
    assert set(runs["row"]) == {"adamw (lr 0.0003)", "adamw (lr 0.001)", "hmt"}, set(runs["row"])
    deltas = wsd.paired_deltas(runs).set_index(["horizon", "row"])["delta"]
    for row, losses in (("hmt", LOSSES[TRUNK_STEPS]["hmt"]), ("adamw (lr 0.001)", LOSSES[TRUNK_STEPS]["adamw"])):
        expected = sum(losses[s] - retuned[s] for s in retuned) / len(retuned)
        assert abs(deltas[(TRUNK_STEPS, row)] - expected) < 1e-12, (row, deltas, expected)
    assert (4, "hmt") not in deltas.index, deltas  # the reference has no run at 4 steps: no Δ there
    named = wsd.horizon_runs(trunks, branches, {"hmt": "A-HMT"}, extra=(extra,), reference="adamw (lr 0.0003)")
    # the other AdamW row follows the reference even where another row's name sorts before it
    assert wsd.row_order(named) == ["adamw (lr 0.0003)", "adamw (lr 0.001)", "A-HMT"], wsd.row_order(named)


def test_horizon_keeps_only_the_horizons_named(folders, tmp_path: Path, capsys) -> None:
    trunks, _ = folders
    out = tmp_path / "out"
    assert wsd.main([str(trunks), "--out", str(out), "--name", "h", "--horizon", str(TRUNK_STEPS)]) == 0
    md = (out / "tables" / "h.md").read_text()
    assert f"| hmt | {TRUNK_STEPS} |" in md and "| hmt | 4 |" not in md, md
    with pytest.raises(SystemExit) as exit_:
        wsd.main([str(trunks), "--out", str(out), "--horizon", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1] == "error: --horizon 5: no completed run of that many steps", err
