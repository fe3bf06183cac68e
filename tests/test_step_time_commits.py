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


def test_paired_change_is_the_mean_of_the_per_round_differences_with_its_t_test():
    base, head = [1.30, 1.40, 1.35, 1.32], [1.33, 1.41, 1.39, 1.33]
    mean, sd, p = stc.paired_change(base, head)
    diffs = [0.03, 0.01, 0.04, 0.01]
    assert mean == pytest.approx(sum(diffs) / 4, abs=1e-12), mean  # float sums: exact to rounding
    assert sd == pytest.approx(0.015, abs=1e-12), sd  # squared deviations sum to 6.75e-4; / 3 = 2.25e-4 = 0.015²
    # t = mean / (sd / sqrt(n)) = 0.0225 / 0.0075 = 3.0 with 3 degrees of freedom: two-sided p = 0.0577
    assert p == pytest.approx(0.0577, abs=5e-4), p
    assert stc.paired_change([1.0, 1.0], [1.0, 1.0]) is None and stc.paired_change([1.2], [1.3]) is None
