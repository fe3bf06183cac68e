"""HMT's capacity cells when not one sequence of ``train.seq_len`` fits (``experiments.planner.hmt_capacity``).

The planner is replaced by a stand-in whose verified step bytes are a known line in the sequence length, so the
search's answer and the number of planner calls (each one or more full-size traces on a real model) can be
checked exactly. Seen on Llama-3.2-3B at 32k and 16 GiB: the cost model was ~2 GiB optimistic (the caching
allocator's slack), and a search that re-solved the uncorrected model after each miss walked down 64 tokens per
two traces (60 traces, 30 min, still over).
"""

from __future__ import annotations

import pytest

from experiments.planner import hmt_capacity
from experiments.planner.bracket import MAX_VERIFY, SEQ_STEP
from experiments.planner.costs import GIB
from experiments.planner.plan import NoPlan, run_config

SEQ = 8192
SIZE = 14  # GiB, no GPU allowance (flat reserve of 0)


def _measured_gib(tokens: int) -> float:
    return 10.0 + 0.001 * tokens  # the traced step at one sequence: 2 GiB above the model's line (below)


def _predicted_gib(tokens: int) -> float:
    return 8.0 + 0.001 * tokens


def _stand_in(calls: list, untraced_over: int | None = None):
    """``plan_with`` with a verified answer when the measured step fits; else ``NoPlan`` with the measured excess
    (traced), or at ``untraced_over`` tokens a predicted one (the corrected model left no choice untraced)."""

    def plan_with(prep, planner, size, *, seq_len=None, name=None, record_dir=None, log=print):
        tokens = seq_len or SEQ
        calls.append((tokens, name))
        measured = _measured_gib(tokens)
        if measured > size:
            err = NoPlan(f"over at {tokens}")
            err.traced, err.excess_gib = tokens != untraced_over, measured - size
            raise err
        return {"verified": {"fits": True, "step_bytes": measured * GIB, "verdict_peak_bytes": measured * GIB},
                "choice": {"batch_size": 1, "tokens_per_micro_batch": tokens, "optimizer_label": "Mode B",
                           "activation": {}, "layer_recompute": True},
                "seq_len": tokens, "iterations": [{}], "run_command": f"run +plans={name}"}

    return plan_with


@pytest.fixture()
def run():
    return run_config(["model=tiny", f"train.seq_len={SEQ}", "dryrun.reserve=flat", "dryrun.cuda_context_gib=0"])


def _cell(monkeypatch, run, tmp_path, calls, untraced_over=None, size=SIZE):
    monkeypatch.setattr(hmt_capacity, "plan_with", _stand_in(calls, untraced_over))
    monkeypatch.setattr(hmt_capacity, "lean_gib", lambda prep, size, tokens: _predicted_gib(tokens))
    return hmt_capacity.hmt_cell(None, {"plan_dir": str(tmp_path)}, run, size, tmp_path, lambda _: None)


def test_not_one_sequence_fits_the_longest_length_is_bracketed_from_the_measured_excess(monkeypatch, run,
                                                                                         tmp_path):
    calls = []
    entry = _cell(monkeypatch, run, tmp_path, calls)
    # 10 + 0.001·s ≤ 14 → s ≤ 4000: 62 × 64 = 3968 fits, 63 × 64 = 4032 is over (14.032 GiB)
    assert (entry["fits"], entry["seq_len"], entry["tokens"], entry["exact"]) == (True, 3968, 3968, True), entry
    assert entry["verified_peak_gib"] == pytest.approx(_measured_gib(3968)), entry
    # the first miss at 8192 tokens (4.192 GiB over, 0.064 GiB per 64 tokens by the model) lands on 62 steps
    assert [t for t, _ in calls] == [SEQ, 3968, 4032], calls
    assert entry["run_command"].endswith("-seq3968"), entry  # each length's plan under its own name
    assert len({name for _, name in calls}) == len(calls), calls


def test_a_length_only_predicted_over_leaves_the_cell_not_exact(monkeypatch, run, tmp_path):
    calls = []
    entry = _cell(monkeypatch, run, tmp_path, calls, untraced_over=4032)
    assert (entry["fits"], entry["seq_len"], entry["exact"]) == (True, 3968, False), (entry, calls)


def test_not_even_one_step_of_tokens_fits(monkeypatch, run, tmp_path):
    calls = []
    entry = _cell(monkeypatch, run, tmp_path, calls, size=9)  # 10 GiB at 0 tokens: nothing fits
    assert not entry["fits"] and entry["tokens"] == 0 and entry["note"] == "no plan fits", entry
    assert len(calls) <= 1 + MAX_VERIFY, calls
    assert all(t % SEQ_STEP == 0 for t, _ in calls), calls
