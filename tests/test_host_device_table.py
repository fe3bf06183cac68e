"""docs/memory.md's host/device tables are what the committed results under ``results/host_device_memory/`` give:
the CPU dry runs (``python -m benchmarks.host_device_memory --render-only --docs docs/memory.md``) and the fake-CUDA
rows (``fake_cuda/``, ``python -m benchmarks.host_device_fake_cuda --render-only --docs docs/memory.md``); every
row was traced, and the rows' figures are consistent with the runs' own summaries."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import host_device_fake_cuda as hdfc
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


FAKE = OUT / "fake_cuda"  # python -m benchmarks.host_device_fake_cuda (CUDA build of torch, no GPU)


def test_fake_cuda_docs_table_is_the_committed_results() -> None:
    assert hdfc.main(["--render-only", "--out", str(FAKE), "--check-docs", str(REPO / "docs" / "memory.md")]) == 0
    rows = json.loads((FAKE / "table.json").read_text())["rows"]
    assert [(r["model"], r["row"]) for r in rows] == [(m, r) for m in hdfc.MODELS for r in hdfc.ROWS]
    assert rows == [hdfc.read_row(FAKE, r["model"], r["row"]) for r in rows]
    assert {r["device"] for r in rows} == {"cuda:0"} and {r["source"] for r in rows} == {"fake"}


def test_fake_cuda_offload_moves_bytes_to_the_host() -> None:
    """In the committed summaries: the parked bases leave the device state byte for byte, and offloaded
    activations are host bytes, only in the rows that ask for them."""
    without_parking = {tuple(o for o in overrides if o != "method.offload_bases=true"): row
                       for row, (_, overrides) in hdfc.ROWS.items() if "method.offload_bases=true" not in overrides}
    for model in hdfc.MODELS:
        summary = {row: json.loads((FAKE / f"{model}-{row}.json").read_text()) for row in hdfc.ROWS}
        state = {row: (s["method_summary"]["optim/state_device_bytes"], s["method_summary"]["optim/state_host_bytes"])
                 for row, s in summary.items()}
        for row, (_, overrides) in hdfc.ROWS.items():
            parked = "method.offload_bases=true" in overrides
            base = without_parking[tuple(o for o in overrides if o != "method.offload_bases=true")]
            host_act = summary[row]["memory"]["host_peak_by_category_bytes"]["activations"]
            assert (state[row][1] > 0) == parked and (host_act > 0) == (hdm.OFFLOAD_ACT in overrides), (model, row)
            assert state[base][0] - state[row][0] == state[row][1], (model, row, state)
