"""The embedding/head cost table (analysis.embedding_cost) on the committed campaign's runs: each saving is found
by configuration among its own folder's runs, Δ is against the campaign row it changes, rows with no runs read
"not run", and a row matching two settings is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from analysis import embedding_cost
from analysis.load import load_results
from analysis.rows import matches, run_configs
from analysis.settings import _flatten
from experiments.errors import UserError
from tests.test_ablation import _variant

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _runs(keys: dict) -> list[Path]:
    return [d for d in sorted((RESULTS / "campaign").iterdir()) if (d / "summary.json").exists()
            and matches(_flatten(yaml.safe_load((d / "config.yaml").read_text())), keys)]


def _table(root: Path) -> dict[str, list[str]]:
    sources = {name: ((load_results(d), run_configs(d)), None)
               for name, d in ((embedding_cost.EMBEDDING, root), (embedding_cost.CAMPAIGN, RESULTS / "campaign"))}
    return {row[0]: row for row in embedding_cost.embedding_table(sources).rows}


def test_savings_against_the_rows_they_change(tmp_path: Path) -> None:
    default, minimal = _runs(embedding_cost.DEFAULT), _runs(embedding_cost.MINIMAL)
    assert len(default) == 3 and len(minimal) == 3, (default, minimal)  # seeds 1-3 of each committed row
    for i, d in enumerate(default):  # INT8 embedding 0.02 worse than HMT default
        _variant(d, tmp_path, f"int8-{i}", {"embedding_dtype": "int8"}, 0.02)
    for i, d in enumerate(minimal):  # the in-loss head 0.5 better than memory-minimal
        _variant(d, tmp_path, f"inloss-{i}", {"head_update": "in_loss"}, -0.5)
    rows = _table(tmp_path)
    # Δ of means of the same runs shifted by a constant: exact up to the rounding to 3 decimals
    assert rows["+ INT8 embedding and head"][5:8] == ["3", rows["+ INT8 embedding and head"][6], "+0.020"], rows
    assert rows["+ head in the loss"][7:9] == ["-0.500", "lower"], rows  # 0.5 ≈ 20 seed std: Welch says lower
    assert rows["+ embedding rows, SparseAdam"][3:6] == ["not run", "—", "0"], rows
    assert rows["HMT default"][5] == "3" and rows["memory-minimal"][5] == "3", rows


def test_a_row_matching_two_settings_is_refused(tmp_path: Path) -> None:
    d = _runs(embedding_cost.DEFAULT)[0]
    _variant(d, tmp_path, "a", {"embedding_update": "lazy_exact"}, 0.0)
    _variant(d, tmp_path, "b", {"embedding_update": "lazy_exact", "lr": 0.5}, 0.0)
    with pytest.raises(UserError, match="'\\+ embedding rows, lazy exact' matches 2 settings"):
        _table(tmp_path)
