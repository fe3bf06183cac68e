"""The ablation table (analysis.ablation) on the committed campaign's runs: each row finds its one setting by
configuration, Δ is against the chain row above (controls: against HMT default), a row with no runs reads
"not run", and a row matching two settings is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from analysis import ablation, rows
from analysis.load import load_results
from analysis.settings import _flatten
from experiments.errors import UserError

CAMPAIGN = Path(__file__).resolve().parent.parent / "results" / "campaign"


def _hmt_default_runs() -> list[Path]:
    out = []
    for d in sorted(CAMPAIGN.glob("hmt-tiny-train-s*")):
        flat = _flatten(yaml.safe_load((d / "config.yaml").read_text()))
        if rows.matches(flat, ablation.HMT):
            out.append(d)
    return out


def _variant(src: Path, root: Path, name: str, method: dict, shift: float) -> float:
    """A copy of run ``src`` as run ``name`` with ``method`` keys changed and val_loss + ``shift``."""
    dst = root / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints"))
    config = yaml.safe_load((dst / "config.yaml").read_text())
    config["method"].update(method)
    config["run_id"] = name
    (dst / "config.yaml").write_text(yaml.safe_dump(config))
    summary = json.loads((dst / "summary.json").read_text())
    summary["run_id"], summary["val_loss"] = name, summary["val_loss"] + shift
    (dst / "summary.json").write_text(json.dumps(summary))
    return summary["val_loss"]


def _table(controls: Path) -> dict[str, list[str]]:
    sources = {ablation.CONTROLS: (load_results(controls), rows.run_configs(controls)),
               ablation.CAMPAIGN: (load_results(CAMPAIGN), rows.run_configs(CAMPAIGN))}
    return {row[0]: row for row in ablation.ablation_table(sources).rows}


def test_rows_deltas_and_missing_rows(tmp_path: Path) -> None:
    default = _hmt_default_runs()
    assert len(default) == 3, default  # the campaign's HMT default: seeds 1-3 of one setting
    for i, d in enumerate(default):  # "+ energy rank" (no limiter) 0.25 worse, GaLore's ε 0.5 worse
        _variant(d, tmp_path, f"nolim-{i}", {"norm_limiter": False}, 0.25)
        _variant(d, tmp_path, f"eps-{i}", {"eps": 1e-6}, 0.5)
    rows = _table(tmp_path)
    # Δ is a difference of means of the same runs shifted by a constant: exact up to float rounding of 3 decimals
    assert rows["+ limiter = HMT default"][3:6] == ["3", rows["+ limiter = HMT default"][4], "-0.250"], rows
    assert rows["+ energy rank"][5] == "—", "the row above it has not run: no Δ"
    assert rows["+ randomized basis"][2:5] == ["not run", "0", "—"], rows
    assert rows["HMT, GaLore's ε"][5] == "+0.500" and rows["HMT identity"][2] == "not run", rows
    # Welch's verdict on the same three seeds shifted by 0.25 / 0.5 (≈ 10 seed std): significant in both directions
    assert rows["+ limiter = HMT default"][6] == "lower" and rows["HMT, GaLore's ε"][6] == "higher", rows
    assert rows["AdamW"][3] == "3" and rows["GaLore rank 64"][3] == "3", rows


def test_a_row_matching_two_settings_is_refused(tmp_path: Path) -> None:
    d = _hmt_default_runs()[0]
    _variant(d, tmp_path, "a", {"norm_limiter": False}, 0.0)
    _variant(d, tmp_path, "b", {"norm_limiter": False, "lr": 0.5}, 0.0)
    with pytest.raises(UserError, match="'\\+ energy rank' matches 2 settings"):
        _table(tmp_path)


def _settings(root: Path) -> list[tuple[dict, int, str, float]]:
    """(setting less the searched keys, seed, status, val_loss) of every run under ``root``, searched keys kept
    apart: method.lr and, for AdamW's 2-D search, method.dense_lr_scale."""
    from analysis.settings import setting_of

    out = []
    for d in sorted(p for p in root.iterdir() if (p / "config.yaml").exists()) if root.is_dir() else []:
        config = yaml.safe_load((d / "config.yaml").read_text())
        setting = setting_of(config)
        point = (setting.pop("method.lr"), setting.pop("method.dense_lr_scale", 1.0))
        status = (d / "status").read_text().strip() if (d / "status").exists() else "pending"
        loss = json.loads((d / "summary.json").read_text())["val_loss"] if status == "completed" else float("inf")
        out.append((json.dumps(setting, sort_keys=True, default=str), point, config["seed"], status, loss))
    return out


@pytest.mark.parametrize("folder", ["campaign-controls", "campaign-batch"])
def test_committed_runs_follow_the_tuning_protocol(folder: str) -> None:
    """Every completed final setting of a committed campaign folder (the controls, the batch campaign) ran with
    seeds 1-3 only at the point (rate, and AdamW's dense-rate multiplier) with the lowest validation loss of its
    finished search at seed 0, which holds ≥ 5 points (the 2-D search: 3 × 3) and has that point inside its grid
    on every axis searched (bracketed)."""
    root = CAMPAIGN.parent
    finals, search = _settings(root / folder), _settings(root / f"{folder}-lr-search")
    assert finals and search, f"no committed runs under results/{folder}"
    for setting in {f[0] for f in finals}:
        points = {s[1]: (s[4] if s[3] == "completed" else float("inf")) for s in search if s[0] == setting}
        assert len(points) >= 5 and all(s[3] in ("completed", "failed") for s in search if s[0] == setting), points
        best = min(sorted(points), key=lambda p: points[p])
        mine = [f for f in finals if f[0] == setting]
        assert {f[1] for f in mine} == {best} and {f[2] for f in mine} <= {1, 2, 3}, (setting, points, mine)
        for axis in (0, 1):  # the rate, then the multiplier (a single value where it was not searched)
            values = sorted({p[axis] for p in points})
            assert len(values) == 1 or values[0] < best[axis] < values[-1], (setting, axis, best, points)
