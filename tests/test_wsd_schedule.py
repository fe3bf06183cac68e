"""The warmup-stable-decay schedule (``train.schedule=wsd``, Hägele et al. 2024; ``experiments.loop.lr_scale``):
the rate at every step against the formula written out here, its independence of the horizon before the cool-down
(what cool-down branches rely on), the cosine default unchanged, and bad values refused in one line."""

from __future__ import annotations

import math

import pytest

from experiments.config import TrainConfig
from experiments.loop import lr_scale


def wsd_by_hand(step: int, steps: int, warmup: int, frac: float, floor: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    decay = max(1, round(steps * frac))
    start = steps - decay
    return 1.0 if step < start else 1 - (1 - floor) * (step - start) / decay


@pytest.mark.parametrize("steps,warmup,frac,floor", [(40, 4, 0.25, 0.0), (300, 30, 0.2, 0.1), (7, 0, 1.0, 0.0)])
def test_wsd_rate_per_step_is_the_formula(steps: int, warmup: int, frac: float, floor: float) -> None:
    cfg = TrainConfig(steps=steps, warmup_steps=warmup, schedule="wsd", cooldown_frac=frac, min_lr_ratio=floor)
    got = [lr_scale(s, cfg) for s in range(steps)]
    want = [wsd_by_hand(s, steps, warmup, frac, floor) for s in range(steps)]
    # 1e-15: the same arithmetic in two places; only the order of two float operations may differ
    bad = [(s, g, w) for s, (g, w) in enumerate(zip(got, want)) if abs(g - w) > 1e-15]
    assert not bad, bad


def test_wsd_key_points() -> None:
    cfg = TrainConfig(steps=40, warmup_steps=4, schedule="wsd", cooldown_frac=0.25, min_lr_ratio=0.0)
    # warm-up 0.25, 0.5, 0.75, 1; constant through step 29; the cool-down (10 steps) from step 30: 1, 0.9, ..., 0.1
    want = {0: 0.25, 3: 1.0, 4: 1.0, 29: 1.0, 30: 1.0, 31: 0.9, 39: 0.1}
    got = {s: lr_scale(s, cfg) for s in want}
    assert all(abs(got[s] - v) < 1e-15 for s, v in want.items()), (got, want)  # 1e-15: 1 - 0.9·k/10 rounding


def test_before_its_cooldown_a_horizon_is_the_longer_runs_rate() -> None:
    """A branch of H steps leaves its trunk at H's cool-down start D; up to and at D both rates agree (1 after
    warm-up), so the branch's first step runs at the trunk's rate."""
    trunk = TrainConfig(steps=4800, warmup_steps=30, schedule="wsd", cooldown_frac=0.2, min_lr_ratio=0.0)
    for horizon in (300, 600, 1200, 2400):
        branch = TrainConfig(steps=horizon, warmup_steps=30, schedule="wsd", cooldown_frac=0.2, min_lr_ratio=0.0)
        start = horizon - round(0.2 * horizon)
        differ = [s for s in range(start + 1) if lr_scale(s, branch) != lr_scale(s, trunk)]
        assert not differ and lr_scale(start, branch) == 1.0, (horizon, differ[:5])


def test_cosine_stays_the_default_and_unchanged() -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert cfg.schedule == "cosine"
    for step in (10, 55, 99):
        want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 10) / 90))
        assert abs(lr_scale(step, cfg) - want) < 1e-15, (step, lr_scale(step, cfg), want)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"schedule": "linear"}, "train.schedule"),
    ({"schedule": "wsd", "cooldown_frac": 0.0}, "train.cooldown_frac must be in (0, 1]"),
    ({"schedule": "wsd", "cooldown_frac": 1.5}, "train.cooldown_frac must be in (0, 1]"),
    ({"schedule": "wsd", "steps": 10, "warmup_steps": 9, "cooldown_frac": 0.5}, "runs into the wsd cool-down"),
])
def test_bad_schedule_values_are_refused_in_one_line(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as error:
        TrainConfig(**kwargs)
    message = str(error.value)
    assert fragment in message and "\n" not in message, message
