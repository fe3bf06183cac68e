"""A CPU training run whose step the time model puts above ``CONFIRM_S`` asks first (``experiments.step_time``).

What is proven: a 7B training step on this CPU is refused in one line naming ``train.confirm=true`` when the input
is not a terminal (at a fixed, slow matmul rate), asked (y/N) when it is, and let through with ``train.confirm=true``, as a dry run and a GPU run
are; a tiny model is let through without measuring anything (the cheap bound decides).
"""

from __future__ import annotations

import dataclasses
import io

import pytest

from experiments import step_time
from experiments.errors import UserError
from experiments.planner.plan import run_config


def _run(*overrides: str):
    return run_config(["mode=train", *overrides])


SLOW_CPU = {"flops_per_s": 1e10}  # a fixed rate: what is tested is the decision, not this CPU's speed


def test_a_7b_step_on_a_slow_cpu_is_refused_without_confirmation(monkeypatch):
    run = _run("model=7b", "train.seq_len=2048", "train.batch_size=1")
    monkeypatch.setattr(step_time, "calibrate", lambda *a, **k: SLOW_CPU)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal
    with pytest.raises(UserError) as exc:
        step_time.check_step_time(run, "cpu")
    msg = str(exc.value)
    assert "train.confirm=true" in msg and "s on this CPU" in msg and "\n" not in msg, msg
    # 7B: 6.74e9 trainable parameters x 6 x 2048 tokens = 8.3e13 FLOPs = 8,280 s at 1e10 FLOP/s > CONFIRM_S
    assert "8,2" in msg, msg
    assert step_time.trainable_params(run) == pytest.approx(6.74e9, rel=0.01), step_time.trainable_params(run)
    step_time.check_step_time(dataclasses.replace(run, train=dataclasses.replace(run.train, confirm=True)), "cpu")
    step_time.check_step_time(run, "cuda")
    step_time.check_step_time(dataclasses.replace(run, mode="dryrun"), "cpu")


@pytest.mark.parametrize("answer, ok", [("y", True), ("", False)])
def test_an_interactive_run_is_asked(monkeypatch, answer, ok):
    run = _run("model=7b", "train.seq_len=2048", "train.batch_size=1")
    monkeypatch.setattr(step_time, "calibrate", lambda *a, **k: SLOW_CPU)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal(""))
    asked = []
    ask = lambda prompt: asked.append(prompt) or answer  # noqa: E731
    if ok:
        step_time.check_step_time(run, "cpu", ask=ask)
    else:
        with pytest.raises(UserError, match="not confirmed"):
            step_time.check_step_time(run, "cpu", ask=ask)
    assert len(asked) == 1 and "[y/N]" in asked[0], asked


def test_a_tiny_model_measures_nothing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("calibrated for a tiny model")

    monkeypatch.setattr(step_time, "calibrate", boom)
    step_time.check_step_time(_run("model=tiny"), "cpu")
