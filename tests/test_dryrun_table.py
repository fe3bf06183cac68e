"""The 7B/13B dry-run table of docs/dryrun.md is what the committed dry runs under ``results/dryrun_table/`` give,
byte for byte (``python -m benchmarks.dryrun_table --render-only --readme docs/dryrun.md`` regenerates it), every
row of it was traced (no "failed"/"not run" cells), and each row's label says what its overrides set."""

from __future__ import annotations

from pathlib import Path

from benchmarks import dryrun_table

REPO = Path(__file__).resolve().parent.parent


def test_dryrun_page_table_is_the_committed_results() -> None:
    out = REPO / "results" / "dryrun_table"
    block = dryrun_table.render(out, list(dryrun_table.MODELS), list(dryrun_table.ROWS))
    assert "failed" not in block and "not run" not in block, block
    page = (REPO / "docs" / "dryrun.md").read_text()
    assert dryrun_table.replace_block(page, block) == page, (
        "docs/dryrun.md table is stale: python -m benchmarks.dryrun_table --render-only --readme docs/dryrun.md")
    assert dryrun_table.main(["--render-only", "--check-readme", str(REPO / "docs" / "dryrun.md")]) == 0


def test_row_labels_follow_the_last_override() -> None:
    overrides = dryrun_table.ROWS["hmt-min-hmt-act"][1]
    assert dryrun_table.activation_of(overrides) == "hmt" and dryrun_table.clip_of(overrides) == "off"
    assert dryrun_table.activation_of(["method=adamw"]) == "none" and dryrun_table.clip_of([]) == "1.0"
