"""``analysis.wsd_bracket`` on hand-made folders: the horizon table's trunks (AdamW split at 1e-3, HMT at 1e-2,
seeds 1-2, 8 steps) and a bracket folder with seed 1 of each at 1/3 and 3× its rate. Per row the best rate is the
lowest loss (ties to the smaller rate), Δ is its loss minus the used rate's, bracketed means interior; seed 2 (no
bracket runs) is not a row; a bracket run without its used run, or a name for a missing row, is one ``error:`` line."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_wsd_analysis import write_run

from analysis import wsd_bracket
from experiments.errors import UserError

STEPS = 8
# {method: {lr: seed-1 loss}}; the used rates (test_wsd_analysis.LRS) are 1e-3 and 1e-2
SEED1 = {"adamw": {3e-4: 4.70, 1e-3: 4.60, 3e-3: 4.65},   # used rate wins: bracketed, Δ 0
         "hmt": {3e-3: 4.80, 1e-2: 4.58, 3e-2: 4.51}}     # 3× wins by 0.07: not bracketed


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    trunks, bracket = tmp_path / "wsd", tmp_path / "bracket"
    for method, used in (("adamw", 1e-3), ("hmt", 1e-2)):
        write_run(trunks, method, 2, STEPS, 4.9)
        for lr, val in SEED1[method].items():
            write_run(trunks if lr == used else bracket, method, 1, STEPS, val, lr=lr)
    return trunks, bracket


def test_best_rate_delta_and_bracketing_per_row(folders) -> None:
    runs = wsd_bracket.bracket_runs([folders[0]], folders[1])
    assert sorted(runs["seed"].unique()) == [1], runs  # seed 2 has no bracket runs
    table = wsd_bracket.bracket_table(runs, "b")
    rows = {r[0]: r for r in table.rows}
    assert set(rows) == {"adamw", "hmt"}, table.rows
    assert rows["adamw"][3:] == ["0.0003: 4.700, 0.001*: 4.600, 0.003: 4.650", "0.001", "0.001", "+0.000", "yes"]
    assert rows["hmt"][3:] == ["0.003: 4.800, 0.01*: 4.580, 0.03: 4.510", "0.01", "0.03", "-0.070", "no"]


def test_main_writes_the_table_under_the_row_names_with_the_branches_horizons(folders, tmp_path: Path) -> None:
    """A longer horizon's used run is a branch (``<trunks>-branches``): its bracket run pairs with it."""
    trunks, bracket = folders
    write_run(trunks.parent / (trunks.name + "-branches"), "hmt", 1, 2 * STEPS, 4.30)  # at the used 1e-2
    write_run(bracket, "hmt", 1, 2 * STEPS, 4.25, lr=3e-3)
    out = tmp_path / "out"
    assert wsd_bracket.main([str(trunks), str(bracket), "--out", str(out), "--row-name", "hmt=HMT default"]) == 0
    md = (out / "tables" / "wsd_rate_bracket.md").read_text()
    assert "| HMT default | 8 | 1 | 0.003: 4.800, 0.01*: 4.580, 0.03: 4.510 | 0.01 | 0.03 | -0.070 | no |" in md, md
    assert "| HMT default | 16 | 1 | 0.003: 4.250, 0.01*: 4.300 | 0.01 | 0.003 | -0.050 | no |" in md, md
    assert (out / "tables" / "wsd_rate_bracket.tex").stat().st_size > 0


def test_a_bracket_run_without_its_used_run_is_refused(folders) -> None:
    trunks, bracket = folders
    write_run(bracket, "hmt", 3, STEPS, 4.7, lr=3e-2)  # seed 3 never ran at the used rate
    with pytest.raises(UserError, match=r"row 'hmt' seed 3 at 8 steps needs one run at the used rate"):
        wsd_bracket.bracket_runs([trunks], bracket)


def test_a_name_for_a_missing_row_is_one_error_line(folders, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        wsd_bracket.main([*map(str, folders), "--out", str(tmp_path / "out"), "--row-name", "galore=GaLore"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("error: --row-name galore=...: no such row"), err
