"""``benchmarks.step_time_commits``: its one-line refusals before anything runs, and the page's table being the one
the committed results render (``--check-docs``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import step_time_commits as stc

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, fragment", [
    (["--base", "/nonexistent"], "is not a checkout of this repository"),
    (["--base", str(REPO), "--rows", "hmt,adamw-fused"], "--rows must start with adamw-fused"),
    (["--base", str(REPO), "--rows", "adamw-fused,nope"], "nope"),
])
def test_bad_arguments_are_refused_in_one_line(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        stc.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and fragment in err, err


def test_step_profile_page_holds_the_committed_comparison():
    assert stc.main(["--check-docs", str(REPO / "docs" / "step_profile.md")]) == 0
