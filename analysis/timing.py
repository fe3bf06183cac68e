"""Speed measured alone (``analysis.report --timing DIR``): a campaign's training runs share the CPU or GPU with
each other (two lanes on two cores, say), so their step times measure the contention as much as the method. A
timing sweep (``experiments/sweeps/campaign_timing.yaml``) reruns every setting for a few steps, one run at a time;
this module puts those runs' ``tokens_per_s`` and ``step_time_s`` in place of the campaign runs' own.

A timing run stands for every campaign run with the same *speed setting*: the setting (``analysis.settings``) less
the keys that change neither the work per step nor its cost — the learning rate, the number of steps, warm-up and
evaluation cadence. A campaign run without a timing run gets no speed ("—"): measured-alone and contended numbers
are never mixed in one column.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from analysis.settings import setting_id

SPEED_IGNORED = ("method.lr", "train.steps", "train.warmup_steps", "train.eval_every", "train.eval_batches",
                 "train.save_model", "data.min_year", "data.max_year")
SPEED_COLUMNS = ("tokens_per_s", "step_time_s")


def speed_setting(setting: Mapping[str, Any]) -> str:
    """Id of a setting less ``SPEED_IGNORED`` (equal work per step, equal id). The corpus years are ignored too:
    the per-step work is fixed by batch × sequence length, not by which addresses fill it."""
    return setting_id({k: v for k, v in setting.items() if k not in SPEED_IGNORED})


def with_timing(runs: pd.DataFrame, timing: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """``runs`` with tokens/s and step time from the completed ``timing`` runs of the same speed setting (mean when
    several), else missing; and how many completed runs found a timing run."""
    done = timing[timing["status"] == "completed"] if "status" in timing else timing
    speed = done.groupby("speed_setting")[list(SPEED_COLUMNS)].mean()
    out = runs.copy()
    for column in SPEED_COLUMNS:
        out[column] = out["speed_setting"].map(speed[column]) if len(speed) else float("nan")
    out["speed_alone"] = True
    matched = int(out.loc[out["status"] == "completed", "speed_setting"].isin(speed.index).sum())
    return out, matched
