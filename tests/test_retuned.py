"""The horizon/statistics tables (analysis.retuned) on copies of committed campaign runs: each row found by
configuration, Δ and the paired t-test against AdamW split recomputed here from the runs' own files, the last
quarter's fall recomputed from their metrics.jsonl, and "not run" where nothing finished."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import yaml
from scipy import stats as scipy_stats

from analysis import retuned
from tests.test_batch import ADAMW_SPLIT, HMT_DEFAULT, _copy, _final


def _val_curve(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"] + 1: r["loss/val"] for r in rows if "loss/val" in r}


def test_rows_paired_p_and_last_quarter(tmp_path: Path) -> None:
    root = tmp_path / "campaign-horizon"
    adamw, hmt = _final("campaign-controls", ADAMW_SPLIT), _final("campaign", HMT_DEFAULT)
    assert len(adamw) == 3 and len(hmt) == 3, (adamw, hmt)
    a = [_copy(d, root, batch_size=8, shift=0.0) for d in adamw]
    h = [_copy(d, root, batch_size=8, shift=0.0) for d in hmt]
    (root / "stats").mkdir()  # the statistics folder: nothing finished
    out = tmp_path / "docs"
    assert retuned.main([str(root), str(root / "stats"), "--out", str(out)]) == 0
    table = retuned.retuned_table("horizon", "", retuned.HORIZON_ROWS, retuned.with_search(root))
    rows = {row[0]: row for row in table.rows}
    seeds_a = {json.loads((d / "summary.json").read_text())["seed"]: v for d, v in zip(adamw, a)}
    seeds_h = {json.loads((d / "summary.json").read_text())["seed"]: v for d, v in zip(hmt, h)}
    common = sorted(seeds_a)
    p = scipy_stats.ttest_rel([seeds_h[s] for s in common], [seeds_a[s] for s in common]).pvalue
    row = rows[HMT_DEFAULT.label]
    assert row[5:11] == ["3", f"{statistics.mean(h):.3f} ± {statistics.stdev(h):.3f}",
                         f"{statistics.mean(h) - statistics.mean(a):+.3f}", f"{p:.3f}" if p >= 0.001 else "< 0.001",
                         ("higher" if statistics.mean(h) > statistics.mean(a) else "lower") if p < 0.05 else "no",
                         row[10]], (row, p)
    curves = [_val_curve(d) for d in hmt]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    mean = [statistics.mean(c[s] for c in curves) for s in steps]
    at = lambda x: float(np.interp(x, steps, mean))  # noqa: E731
    assert row[10] == f"{100 * (at(0.75 * steps[-1]) - at(steps[-1])) / at(steps[-1]):+.2f}", (row, steps)
    assert rows["GaLore rank 64"][3:7] == ["not run", "—", "0", "—"], rows
    assert (out / "tables" / "statistics.md").exists() and (out / "figures" / "horizon.png").exists()
    assert "not run" in (out / "tables" / "statistics.md").read_text()


def _rename_model(run: Path, model: str) -> None:
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"]["name"] = model
    (run / "config.yaml").write_text(yaml.safe_dump(config))


def test_the_larger_model_rows_take_only_that_models_runs(tmp_path: Path) -> None:
    root = tmp_path / "campaign-30m"
    hmt = _final("campaign", HMT_DEFAULT)
    _copy(hmt[0], root, batch_size=8, shift=0.0)  # still tiny: no larger-model row may take it
    moved = [_copy(d, root, batch_size=8, shift=0.5) for d in _final("campaign-controls", ADAMW_SPLIT)]
    for run in root.iterdir():
        if run.name.startswith(("adamw", "hmt")) and run.name != f"{hmt[0].name}-b8":
            _rename_model(run, retuned.LARGER_MODEL)
    larger = {row[0]: row for row in retuned.retuned_table("larger_model", "", retuned.LARGER_ROWS,
                                                           retuned.with_search(root)).rows}
    tiny = {row[0]: row for row in retuned.retuned_table("statistics", "", retuned.STATISTICS_ROWS,
                                                         retuned.with_search(root)).rows}
    split = ADAMW_SPLIT.label
    assert larger[split][5:7] == [str(len(moved)), f"{statistics.mean(moved):.3f} ± {statistics.stdev(moved):.3f}"], \
        larger[split]
    assert larger[HMT_DEFAULT.label][5] == "0" and tiny[HMT_DEFAULT.label][5] == "1" and tiny[split][5] == "0", \
        (larger, tiny)
    out = tmp_path / "docs"
    assert retuned.main([str(root), str(root), "--out", str(out), "--larger", str(root)]) == 0
    assert "29.5 M-parameter" in (out / "tables" / "larger_model.md").read_text()
    assert (out / "figures" / "larger_model.png").exists()  # drawn once a row has final runs
