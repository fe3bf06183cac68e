"""``benchmarks.plan_answer_times``: a fresh answer is read back from the plan record it writes, a refusal is its
``error:`` line, and bad arguments are refused before any answer runs."""

from __future__ import annotations

import json

from benchmarks.plan_answer_times import TARGET_S, main


def test_a_fresh_answer_comes_from_the_committed_table_within_the_target(tmp_path, capsys):
    out = tmp_path / "times.json"
    assert main(["--models", "7b", "--seq", "2048,8192", "--budgets", "16", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    print(rows)
    answered, refused = rows
    # the committed 7B table holds every sample the 16 GiB answer needs: nothing traced, seconds not minutes
    assert answered["traced"] == 0 and answered["from_table"] > 0
    assert answered["micro_batch"] >= 1 and answered["predicted_peak_gib"] < 16
    assert answered["wall_s"] < TARGET_S
    # the Llama-2 shapes stop at 4,096 positions: one error line, no plan
    assert refused["error"].startswith("error: train.seq_len=8192") and "micro_batch" not in refused


def test_unknown_models_are_refused_before_any_answer(tmp_path, capsys):
    out = tmp_path / "times.json"
    assert main(["--models", "7b,llama9-1t", "--out", str(out)]) == 2
    assert "error: --models: unknown llama9-1t" in capsys.readouterr().err
    assert not out.exists()
