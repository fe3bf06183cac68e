"""The guide's memory tables quote the committed results they come from: docs/models.md's architecture table
(``results/arch_dryrun/``), docs/results.md's memory-by-size table (``docs/campaign/tables/memory_by_size.md``,
rendered from ``results/paper_memory/``), docs/memory_savings.md's INT8 AdamW rows
(``results/int8_bench/int8_bench.json``) and
docs/gpu-memory-model.md's AdamW example (``results/dryrun_table/7b-adamw``). Figures are compared as the tables
print them (two decimals of GiB), so a regenerated result that moves a printed figure fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks import arch_dryrun

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def page(name: str) -> str:
    return (REPO / "docs" / name).read_text()


def test_architecture_table_is_the_committed_runs() -> None:
    table = (REPO / "results" / "arch_dryrun" / "table.md").read_text()
    start = table.index("| architecture | params |")
    assert table[start:].strip() in page("models.md"), (
        "docs/models.md architecture table differs from results/arch_dryrun/table.md")
    for arch in arch_dryrun.ARCHS:
        for method in arch_dryrun.METHODS:
            summary = json.loads((REPO / "results" / "arch_dryrun" / f"{arch}-{method}" / "summary.json").read_text())
            row = f"| {arch} | {method} | {gib(summary['memory']['peak_bytes'])} |"
            assert row in table, (row, f"{arch}-{method}")


def test_memory_by_size_rows_are_the_reports() -> None:
    rendered = (REPO / "docs" / "campaign" / "tables" / "memory_by_size.md").read_text()
    rows = [line for line in rendered.splitlines() if line.startswith("| ") and not line.startswith("| Method")]
    assert rows, rendered
    for line in rows:
        assert line in page("results.md"), line
    adamw = json.loads(next((REPO / "results" / "paper_memory").glob("adamw-7b-dryrun-*/summary.json")).read_text())
    assert f"{gib(adamw['memory']['peak_bytes'])} (" in next(r for r in rows if r.startswith("| adamw |")), rows


def test_int8_section_adamw_rows_are_the_bench() -> None:
    sizes = json.loads((REPO / "results" / "int8_bench" / "int8_bench.json").read_text())["dryrun"]["sizes"]
    for size in ("7b", "13b"):
        full, eight = sizes[size]["adamw"], sizes[size]["adamw 8-bit"]
        cat = lambda r, c: gib(r["peak_by_category_bytes"][c])  # noqa: E731
        row = (f"| {size} | adamw / adamw `eight_bit` | {gib(full['peak_bytes'])} / {gib(eight['peak_bytes'])} | "
               f"{cat(full, 'params')} | {cat(full, 'grads')} | {cat(full, 'optimizer')} / {cat(eight, 'optimizer')} | "
               f"{cat(full, 'activations')} | {cat(full, 'temp')} / {cat(eight, 'temp')} | — |")
        assert row in page("memory_savings.md"), row


def test_gpu_memory_model_adamw_example_is_the_dryrun_table() -> None:
    summary = json.loads((REPO / "results" / "dryrun_table" / "7b-adamw" / "summary.json").read_text())
    predicted = summary["dryrun"]["predicted"]
    doc = (REPO / "docs" / "gpu-memory-model.md").read_text()
    row = re.search(r"^\| adamw \| ([\d.]+) GiB \| ([\d.]+) GiB \| ([\d.]+) GiB \| (\d+) \|", doc, re.M)
    assert row is not None, "docs/gpu-memory-model.md has no adamw example row"
    want = (gib(summary["memory"]["peak_bytes"]), gib(predicted["peak_allocated_bytes"]),
            gib(predicted["peak_reserved_bytes"]), str(predicted["segments"]))
    assert row.groups() == want, (row.groups(), want)
