"""Rows of the tuned campaign found by configuration: the final runs of one setting, its tuned rate and whether
its learning-rate search bracketed that rate (``experiments.sweeps.tuning``'s rule).

A row is a few dotted config keys and their values (a key absent from a run's config reads as its default,
``ABSENT``: the key was added later with that default, ``experiments.config`` / ``hmt_core.hmt.Config``). The
campaign tables (``analysis.ablation``, ``analysis.batch``, ``analysis.embedding_cost``) look rows up this way, so
a row never depends on a run id and never averages over two configurations: two settings matching one row are an
error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from analysis import stats
from analysis.load import Results, load_results
from analysis.rundirs import find_run_dirs, read_run, read_status
from analysis.settings import _flatten
from analysis.tables import DASH, MIB, fmt, fmt_mean_std
from experiments.errors import UserError
from experiments.sweeps.tuning import search_results_dir, select_lr

FINISHED = ("completed", "failed", "diverged")  # the statuses a run ends with (diverged: a failure)
ABSENT = {"method.dense_lr_scale": 1.0, "method.embedding_dtype": "bf16", "method.embedding_update": "dense",
          "method.head_update": "dense"}
Source = tuple[Results, dict[str, dict]]  # the runs of a results folder and their flattened configs by run id


def run_configs(results_dir: Path) -> dict[str, dict]:
    """run id -> flattened config.yaml of every run under ``results_dir``."""
    out = {}
    for path in find_run_dirs(results_dir):
        run = read_run(path, lambda _: None)
        if run is not None:
            out[str(run.summary.get("run_id") or path.name)] = _flatten(run.config)
    return out


def load_source(folder: Path, *, may_be_empty: bool = False) -> Source:
    """(runs, configs) of ``folder``; with ``may_be_empty``, a folder not made yet or without a finished run (a
    campaign while its searches run) reads as no runs, so its rows say "not run"."""
    if may_be_empty and not any(read_status(d) in FINISHED for d in find_run_dirs(folder)):
        runs = pd.DataFrame(columns=["run_id", "status", "setting", "lr", "steps", "val_loss", "seed"])
        return Results(runs=runs, metrics=pd.DataFrame(), ranks=pd.DataFrame(), rank_hist=pd.DataFrame(),
                       activations=pd.DataFrame()), {}
    return load_results(folder), run_configs(folder)


def with_search(folder: Path, *, may_be_empty: bool = False) -> tuple[Source, Source | None]:
    """(final runs, search runs or None) of a tuned campaign's folder and its ``<folder>-lr-search``."""
    search = Path(search_results_dir(str(folder)))
    return (load_source(folder, may_be_empty=may_be_empty),
            load_source(search, may_be_empty=may_be_empty) if search.is_dir() else None)


def matches(config: Mapping[str, Any], keys: Mapping[str, Any]) -> bool:
    return all(config.get(k, ABSENT.get(k)) == v for k, v in keys.items())


def row_runs(label: str, keys: Mapping[str, Any], source: Source) -> pd.DataFrame:
    """The completed runs of the one setting matching ``keys`` (empty if none); two settings are a ``UserError``
    naming the row ``label``."""
    results, configs = source
    runs = results.completed()
    runs = runs[runs["run_id"].map(lambda r: matches(configs.get(r, {}), keys)).astype(bool)]
    if runs["setting"].nunique() > 1:
        raise UserError(f"campaign row {label!r} matches {runs['setting'].nunique()} settings "
                        f"({', '.join(sorted(runs['run_id']))}); narrow its keys")
    return runs


def tuned_rate(runs: pd.DataFrame, configs: Mapping[str, dict]) -> str:
    """The rows' learning rate as text, with the dense-rate multiplier where it is not 1; "not run" if none."""
    if runs.empty:
        return "not run"
    config = configs[runs["run_id"].iloc[0]]
    rate = format(float(config["method.lr"]), "g")
    scale = config.get("method.dense_lr_scale", 1.0)
    return rate if scale == 1 else f"{rate} (×{scale:g} dense)"


def search_best(keys: Mapping[str, Any], search: Source | None) -> tuple[float, float, bool] | None:
    """(best rate, its metric, bracketed) of the search runs of ``keys``'s setting (every rate, the other keys as
    the row's) by ``select_lr``; None without a search of at least 3 finished rates."""
    if search is None:
        return None
    results, configs = search
    found = results.runs[results.runs["run_id"].map(lambda r: matches(configs.get(r, {}), keys)).astype(bool)]
    found = found[found["status"].isin(FINISHED)]
    losses = {float(configs[r]["method.lr"]): (v if s == "completed" else math.inf)
              for r, v, s in zip(found["run_id"], found["val_loss"], found["status"])}
    if len(losses) < 3:
        return None
    best, inside = select_lr(losses)
    return best, float(losses[best]), inside


def search_cells(keys: Mapping[str, Any], search: Source | None) -> list[str]:
    """[the search's best rate ("(edge)" at an end of its grid), its loss] of ``keys``'s row; dashes without one."""
    best = search_best(keys, search)
    return [DASH, DASH] if best is None else [f"{best[0]:g}" + ("" if best[2] else " (edge)"), fmt(best[1], ".3f")]


def bracketed(runs: pd.DataFrame, keys: Mapping[str, Any], search: Source | None) -> str:
    """Whether the row's search puts its tuned rate strictly inside the grid (``search_best``): "yes" / "no" /
    "—" (no search or no final runs)."""
    best = search_best(keys, search)
    if best is None or runs.empty:
        return "—"
    tuned = float(runs["lr"].iloc[0]) if "lr" in runs and pd.notna(runs["lr"].iloc[0]) else best[0]
    return "yes" if best[2] and math.isclose(best[0], tuned) else "no"


def loss_by_seed(runs: pd.DataFrame) -> dict[int, float]:
    """``{seed: final validation loss}`` of a row's runs (the seeds share their data order across rows)."""
    loss = pd.to_numeric(runs["val_loss"], errors="coerce")
    return {int(seed): float(value) for seed, value in zip(runs["seed"], loss)}


def loss_cells(runs: pd.DataFrame, reference: pd.DataFrame | None) -> list[str]:
    """[val loss mean ± std, Δ of the means against ``reference``, the paired t-test's verdict over the seeds both
    ran (``analysis.stats.verdict``)] ("—" where undefined)."""
    loss = pd.to_numeric(runs["val_loss"], errors="coerce")
    ref = pd.to_numeric(reference["val_loss"], errors="coerce") if reference is not None else pd.Series(dtype=float)
    delta = loss.mean() - ref.mean() if len(loss) and len(ref) else None
    return [fmt_mean_std(runs["val_loss"], ".3f") if len(runs) else "—", fmt(delta, "+.3f"),
            stats.verdict(loss_by_seed(runs), loss_by_seed(reference)) if delta is not None else "—"]


def mean_mib(runs: pd.DataFrame, column: str) -> str:
    """The mean of a byte column in MiB, one decimal ("—" without runs)."""
    value = pd.to_numeric(runs.get(column), errors="coerce").mean() if len(runs) else None
    return fmt(value, ".1f", MIB)
