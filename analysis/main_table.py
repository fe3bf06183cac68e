"""The paper's main tables: one row per method, model and setting of the completed training runs, pretraining and
fine-tuning in separate sections (``task``, ``analysis.load``), mean over the seeds of a setting.

* ``main``: seeds, learning rate (``method.lr``; the title says whether a search chose it, ``lr_phrase``),
  validation loss mean ± sample std over seeds (nats/token), perplexity exp(mean validation loss), optimizer
  state (MiB, ``method_summary['optim/state_bytes']``), peak memory (GiB, ``summary.memory.peak_bytes``),
  tokens/s and step time as ratios to the plain AdamW row of the same model (``tables._reference_adamw``; "—"
  when the results hold none).
* ``main_systems``: the same rows' average memory, tokens/s, step time, host memory (``cpu_rss_peak_bytes``),
  host↔device bytes, checkpoint size, projection rank over training (``rank_summary``) and the activation
  compression's worst relative error (``activation_error``).
* ``flattening``: whether the validation curve flattened: the relative change (L(0.75T) − L(T)) / L(T) of the
  seed-mean validation loss L over the last quarter of the T steps, and over the third quarter for comparison.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis.load import Results
from analysis.tables import (DASH, GIB, MIB, Table, _columns, _mean, _ratio, _reference_adamw, _variants, fmt,
                             fmt_mean_std, groups)

TASK_ORDER = ("pretraining", "fine-tuning")
TASK_TITLES = {"pretraining": "Pretraining", "fine-tuning": "Fine-tuning"}


def train_runs(results: Results) -> pd.DataFrame:
    runs = results.completed()
    runs = runs[runs["mode"] == "train"]
    return runs.assign(task=runs["task"].fillna("pretraining") if "task" in runs else "pretraining")


def sectioned(runs: pd.DataFrame) -> tuple[bool, list[tuple[str, list[str], pd.DataFrame]]]:
    """(with a Setting column, [(task, [method, model, (setting)], rows)]): pretraining first, then by model,
    method and setting (the baseline setting first)."""
    with_variant = _variants(runs)
    keys = ("model", "method") + (("variant",) if with_variant else ())
    runs = runs.assign(variant=runs["variant"].fillna("")) if with_variant else runs
    found = []
    for task in sorted(runs["task"].unique(), key=lambda t: (TASK_ORDER.index(t) if t in TASK_ORDER else 9, t)):
        for key, g in groups(runs[runs["task"] == task], keys):
            found.append((task, [str(key[1]), str(key[0])] + [str(v) for v in key[2:]], g))
    return with_variant, found


def _sections(found: list[tuple[str, list[str], pd.DataFrame]]) -> list[tuple[str, int]]:
    sections: list[tuple[str, int]] = []
    for i, (task, _, _) in enumerate(found):
        if not sections or sections[-1][0] != TASK_TITLES.get(task, task):
            sections.append((TASK_TITLES.get(task, task), i))
    return sections


def decimals(values, scale: float = 1.0, significant: int = 2, least: int = 2, most: int = 4) -> int:
    """Decimal places that show the column's smallest nonzero value with ``significant`` digits (at least
    ``least``, at most ``most``), so one column shares one precision."""
    finite = [abs(float(v)) / scale for v in values if v is not None and np.isfinite(float(v)) and float(v) != 0]
    if not finite:
        return least
    return int(min(most, max(least, significant - 1 - math.floor(math.log10(min(finite))))))


def rank_summary(results: Results, run_ids) -> tuple[float, float, float] | None:
    """(mean, min, max) projection rank over training and layers, over the runs (seeds) given: per run from the
    histogram of ranks over every basis refresh and layer (``rank_hist``), else the logged ``rank/mean``
    (time-averaged), ``rank/min``, ``rank/max`` metrics, else a fixed rank (``method_summary['rank/fixed']``);
    the mean of the runs' means, the least minimum and the largest maximum. None for methods without a
    projection rank."""
    found = []
    for run_id in run_ids:
        hist = results.rank_hist[results.rank_hist["run_id"] == run_id] if len(results.rank_hist) else []
        metrics = results.metrics[results.metrics["run_id"] == run_id] if len(results.metrics) else pd.DataFrame()
        fixed = results.runs.loc[results.runs["run_id"] == run_id, "rank_fixed"] if "rank_fixed" in results.runs \
            else pd.Series(dtype=float)
        if len(hist) and hist["count"].sum() > 0:
            hist = hist[hist["count"] > 0]
            mean = float((hist["rank"] * hist["count"]).sum() / hist["count"].sum())
            found.append((mean, float(hist["rank"].min()), float(hist["rank"].max())))
        elif "rank/mean" in metrics and metrics["rank/mean"].notna().any():
            means = metrics["rank/mean"].dropna().astype(float)
            lows = metrics["rank/min"].dropna() if "rank/min" in metrics and metrics["rank/min"].notna().any() \
                else means
            highs = metrics["rank/max"].dropna() if "rank/max" in metrics and metrics["rank/max"].notna().any() \
                else means
            found.append((float(means.mean()), float(lows.min()), float(highs.max())))
        elif len(fixed.dropna()):
            rank = float(fixed.dropna().iloc[0])
            found.append((rank, rank, rank))
    if not found:
        return None
    return float(np.mean([f[0] for f in found])), min(f[1] for f in found), max(f[2] for f in found)


def format_rank(summary: tuple[float, float, float] | None) -> str:
    """``42.3 (32–128)``; one number when the rank never changed; "—" without a projection."""
    if summary is None:
        return DASH
    mean, low, high = summary
    return format(low, "g") if low == high else f"{mean:.1f} ({low:g}–{high:g})"


def activation_error(results: Results, run_ids) -> float | None:
    """Mean over the runs of the largest relative error ‖x̂ − x‖ / ‖x‖ among the activation components a run
    compressed (``activations``, from its activation probe); None when no run measured one."""
    acts = results.activations
    if not len(acts):
        return None
    worst = acts[acts["run_id"].isin(list(run_ids))].groupby("run_id")["rel_err"].max().dropna()
    return float(worst.mean()) if len(worst) else None


def lr_phrase(runs: pd.DataFrame, search: Results | None) -> str:
    """What the LR column is: the rate a learning-rate search chose (``search``, the runs of
    ``<results>-lr-search``) for every setting, for some (the others', e.g. ablations, fixed in their sweep), or
    for none (the rate each run was configured with)."""
    settings = set(runs["setting_sans_lr"]) if "setting_sans_lr" in runs else set()
    searched = set(search.runs["setting_sans_lr"]) if search is not None and "setting_sans_lr" in search.runs \
        else set()
    tuned = len(settings & searched)
    if not settings or not tuned:
        return "at each run's configured learning rate, with no learning-rate search beside these results"
    if tuned == len(settings):
        return "at the learning rate a search chose for each (see the learning-rate search table)"
    return (f"at the learning rate a search chose for {tuned} of the {len(settings)} settings, the rest at a rate "
            "set in their sweep")


def main_table(results: Results, search: Results | None = None) -> Table:
    runs = train_runs(results)
    with_variant, found = sectioned(runs)
    mem_places = decimals(runs["peak_bytes"], GIB)
    rows = []
    for task, lead, g in found:
        ref = _reference_adamw(runs[runs["model"].astype(str) == lead[1]])
        ref = {c: (_mean(ref[c]) if ref is not None else None) for c in ("tokens_per_s", "step_time_s")}
        loss = _mean(g["val_loss"])
        lr = _mean(g["lr"]) if "lr" in g else None
        rows.append([*lead, str(g["seed"].nunique(dropna=False)), fmt(lr, "g"), fmt_mean_std(g["val_loss"], ".3f"),
                     fmt(None if loss is None or loss > 700 else math.exp(loss), ",.1f"),
                     fmt(_mean(g["optim_state_bytes"]) if "optim_state_bytes" in g else None, ",.2f", MIB),
                     fmt(_mean(g["peak_bytes"]), f".{mem_places}f", GIB),
                     _ratio(_mean(g["tokens_per_s"]), ref["tokens_per_s"]),
                     _ratio(_mean(g["step_time_s"]), ref["step_time_s"])])
    columns, align = _columns(["Method", "Model"], with_variant, [
        "Seeds", "LR", "Val loss (nats/token)", "Perplexity", "Optimizer state (MiB)", "Peak memory (GiB)",
        "Tokens/s (×AdamW)", "Step time (×AdamW)"])
    alone = "speed_alone" in runs and bool(runs["speed_alone"].fillna(False).any())
    return Table("main", f"Training runs per method, model and setting {lr_phrase(runs, search)} (mean ± std over "
                 "seeds; speed as a ratio to plain AdamW on the same model"
                 + (", each setting timed alone" if alone else "") + ")", columns, rows, align, _sections(found))


def systems_table(results: Results) -> Table:
    runs = train_runs(results)
    with_variant, found = sectioned(runs)
    places = {c: decimals(runs[c], GIB) for c in ("avg_bytes", "cpu_rss_peak_bytes", "host_device_bytes",
                                                   "checkpoint_bytes")}
    rows = []
    for _, lead, g in found:
        ids = list(g["run_id"])
        rows.append([*lead, *(fmt(_mean(g[c]), f".{places[c]}f", GIB) for c in ("avg_bytes",)),
                     fmt(_mean(g["tokens_per_s"]), ",.0f"), fmt(_mean(g["step_time_s"]), ",.1f", 1e-3),
                     *(fmt(_mean(g[c]), f".{places[c]}f", GIB)
                       for c in ("cpu_rss_peak_bytes", "host_device_bytes", "checkpoint_bytes")),
                     format_rank(rank_summary(results, ids)), fmt(activation_error(results, ids), ".2e")])
    columns, align = _columns(["Method", "Model"], with_variant, [
        "Avg memory (GiB)", "Tokens/s", "Step time (ms)", "CPU RAM peak (GiB)", "Host↔device (GiB)",
        "Checkpoint (GiB)", "Rank mean (min–max)", "Activation error (max rel.)"])
    return Table("main_systems", "The same runs: average memory, speed, host memory and traffic, checkpoint size, "
                 "projection rank over training, worst activation-compression error", columns, rows, align,
                 _sections(found))


def val_curve(results: Results, run_ids) -> pd.Series:
    """Seed-mean validation loss indexed by updates done (logged step + 1), at the evaluations every run made."""
    metrics = results.metrics
    if not len(metrics) or "loss/val" not in metrics:
        return pd.Series(dtype=float)
    rows = metrics[metrics["run_id"].isin(list(run_ids))].dropna(subset=["loss/val"])
    wide = rows.pivot_table(index="step", columns="run_id", values="loss/val", aggfunc="last").dropna()
    curve = wide.astype(float).mean(axis=1)
    curve.index = curve.index.astype(int) + 1
    return curve.sort_index()


def relative_change(curve: pd.Series, start: float, end: float) -> float | None:
    """(L(start·T) − L(end·T)) / L(end·T) on the curve, T its last point, L linearly interpolated; None when
    ``start·T`` precedes the first evaluation."""
    if len(curve) < 2:
        return None
    steps, losses, total = curve.index.to_numpy(float), curve.to_numpy(float), float(curve.index[-1])
    if start * total < steps[0]:
        return None
    at = lambda fraction: float(np.interp(fraction * total, steps, losses))  # noqa: E731
    return (at(start) - at(end)) / at(end)


def flattening_table(results: Results) -> Table:
    runs = train_runs(results)
    with_variant, found = sectioned(runs)
    rows = []
    kept = []
    for task, lead, g in found:
        curve = val_curve(results, g["run_id"])
        if len(curve) < 2:
            continue
        total = int(curve.index[-1])
        last, third = relative_change(curve, 0.75, 1.0), relative_change(curve, 0.5, 0.75)
        at = float(np.interp(0.75 * total, curve.index.to_numpy(float), curve.to_numpy(float)))
        seeds = runs[runs["run_id"].isin(g["run_id"])]["seed"].nunique(dropna=False)
        rows.append([*lead, str(seeds), str(total), fmt(at, ".3f"), fmt(float(curve.iloc[-1]), ".3f"),
                     fmt(None if last is None else 100 * last, "+.2f"),
                     fmt(None if third is None else 100 * third, "+.2f")])
        kept.append((task, lead, g))
    columns, align = _columns(["Method", "Model"], with_variant, [
        "Seeds", "Steps T", "Val loss at 0.75T", "Val loss at T", "Last quarter (%)", "Third quarter (%)"])
    return Table("flattening", "Did the validation curves flatten? Relative change of the seed-mean validation "
                 "loss over the last quarter of training, (L(0.75T) − L(T)) / L(T), and over the third, "
                 "(L(0.5T) − L(0.75T)) / L(0.75T), in percent (linear interpolation between evaluations)",
                 columns, rows, align, _sections(kept))


TABLES = (main_table, systems_table)
