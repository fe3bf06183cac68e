"""The README is a landing page: at most ``MAX_LINES`` lines; its set-up commands are the install and test commands
CI runs (``.ci/run``); every figure of its headline table is the one the guide's generated tables print —
docs/results.md's campaign table (``analysis.report``) and docs/dryrun.md's 7B/13B table
(``benchmarks.dryrun_table``), which their own tests check against the committed results."""

from __future__ import annotations

import re
from pathlib import Path

from analysis.report import README_BEGIN, README_END
from benchmarks import dryrun_table

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 250
# README row -> (the campaign's pretraining row (method, setting) or None, the dry-run table's row label)
HEADLINE = {
    "AdamW (BF16, torch's fused kernel)": (("adamw", "default"), "adamw (fused kernels, `method.impl=fused`)"),
    "8-bit AdamW (bitsandbytes)": (("adamw", "8-bit"), "adamw, 8-bit state (bitsandbytes AdamW8bit)"),
    "GaLore (galore-torch)": (("galore", ""), "galore (rank 128, not layer-wise)"),
    "APOLLO (apollo-torch)": (("apollo", "APOLLO"), "apollo (rank d/4, channel)"),
    "APOLLO-Mini (apollo-torch)": (("apollo", "APOLLO-Mini"), "apollo mini (rank 1, tensor)"),
    "QLoRA (NF4 base, LoRA r 16; fine-tuning only)": (None, "qlora (NF4 base, LoRA r 16)"),
    "HMT, defaults": (("hmt", "default"), "hmt (defaults)"),
    "HMT, memory-minimal (Mode B rank 1 + lm_head, BF16 state, full checkpointing, no clipping)":
        (("hmt", "memory-minimal"), "hmt memory-minimal (Mode B rank 1 + lm_head, bf16 state, full ckpt, no clip)"),
    "… + 8-bit embedding moments + INT8 weights": (None, "… + INT8 weights (`method.weight_dtype=int8`)"),
}


def readme() -> str:
    return (REPO / "README.md").read_text(encoding="utf-8")


def cells(line: str) -> list[str]:
    return [c.strip().replace("**", "") for c in line.strip().strip("|").split("|")]


def table_after(text: str, start: str) -> list[list[str]]:
    """The rows (header and separator left out) of the first Markdown table after ``start`` in ``text``."""
    lines = text[text.index(start):].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    return rows


def between(text: str, begin: str, end: str) -> str:
    assert begin in text and end in text, (begin, end)
    return text[text.index(begin):text.index(end)]


def test_readme_is_a_landing_page() -> None:
    n = len(readme().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move the detail into a page under docs/"
    assert "](docs/index.md)" in readme(), "the README links the guide"


def test_setup_commands_are_what_ci_runs() -> None:
    """``.ci/run`` installs with the README's two pip commands (it adds ``-q``) and runs the README's test command."""
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    setup = readme()[readme().index("## Set-up"):]
    setup = setup[:setup.index("\n## ", 1)]
    installs = [line.replace(" -q ", " ") for line in ci if line.startswith("pip install")]
    tests = [line for line in ci if line.startswith("python -m pytest")]
    assert len(installs) == 2 and len(tests) == 1, ci
    for command in installs:
        assert f"&& {command} &&" in setup, (command, setup)
    assert f". .venv/bin/activate && {tests[0]}\n" in setup, (tests[0], setup)


def test_headline_table_quotes_the_generated_tables() -> None:
    rows = table_after(readme(), "## Headline results")
    assert [r[0] for r in rows] == list(HEADLINE), [r[0] for r in rows]
    results = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    campaign = {(r[0], r[2]): r for r in table_after(between(results, README_BEGIN, README_END), "*Pretraining*")
                if r[1] == "tiny"}
    dryrun = between((REPO / "docs" / "dryrun.md").read_text(encoding="utf-8"), dryrun_table.BEGIN,
                     dryrun_table.END)
    peaks = {size: {r[0]: r[3] for r in table_after(dryrun, f"**{size}**")} for size in ("7b", "13b")}
    for row in rows:
        (source, label), (loss, state, peak7, peak13) = HEADLINE[row[0]], row[1:]
        want = ("—", "—") if source is None else (campaign[source][5], campaign[source][7])
        assert (loss, state) == want, (row[0], (loss, state), want)
        assert (peak7, peak13) == (peaks["7b"][label], peaks["13b"][label]), (row[0], peak7, peak13, label)


def test_headline_check_reads_numbers() -> None:
    """The parsers above see figures, not blanks: a loss ± std and GiB with two decimals."""
    rows = table_after(readme(), "## Headline results")
    assert re.fullmatch(r"\d\.\d{3} ± \d\.\d{3}", rows[0][1]) and re.fullmatch(r"\d+\.\d\d", rows[0][3]), rows[0]
