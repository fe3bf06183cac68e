"""docs/memory.md's host/device table is what the committed dry runs under ``results/host_device_memory/`` give
(``python -m benchmarks.host_device_memory --render-only --docs docs/memory.md`` regenerates it), every row was
traced, and the rows' figures are consistent with the runs' own summaries."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import host_device_memory as hdm

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "results" / "host_device_memory"


def test_docs_table_is_the_committed_results() -> None:
    assert hdm.main(["--render-only", "--out", str(OUT), "--check-docs", str(REPO / "docs" / "memory.md")]) == 0
    table = json.loads((OUT / "table.json").read_text())
    assert [r["row"] for r in table["rows"]] == list(hdm.ROWS) and not any("error" in r for r in table["rows"])
    assert table["rows"] == [hdm.read_row(OUT, name) for name in hdm.ROWS]


def test_offload_rows_ran_with_their_settings() -> None:
    for name, (_, overrides) in hdm.ROWS.items():
        summary = json.loads((OUT / name / "summary.json").read_text())
        config = (OUT / name / "config.yaml").read_text()
        offload = "method.offload_bases=true" in overrides
        assert f"offload_bases: {str(offload).lower()}" in config, name
        assert (summary["method_summary"].get("cache/host_bytes", 0) > 0) == offload, name
        policy = (summary.get("activation_summary") or {}).get("policy") or {}
        assert (policy.get("mlp_intermediate") == "offload_cpu") == (hdm.OFFLOAD_ACT in overrides), name
