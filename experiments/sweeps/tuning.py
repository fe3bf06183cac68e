"""Learning-rate tuning inside a sweep: search a grid per setting, pick the best by validation loss, rerun the
winner with fresh seeds.

Comparing methods each at its own default learning rate compares learning rates, not methods (GaLore, Zhao et al.
2024, §5, and APOLLO, Zhu et al. 2024, §5, tune each baseline's learning rate). A sweep file with a ``tune`` block
turns every run it lists (its ``grid`` and ``runs``: the *rows* of the comparison) into:

1. the **search**: the row at each learning rate of the grid (``method.lr=<lr>``), with ``seed=<search_seed>``,
   written under ``<results_dir>-lr-search`` so the report on ``<results_dir>`` holds final runs only;
2. once *every* row's search has finished (a global barrier: the list of runs, and so a Slurm array index, is the
   same while the search runs and only grows afterwards), the **final** runs: the row at its best learning rate
   with each of ``seeds``. The search seed is not among them: the winner's search run was picked *because* its
   loss was lowest, so reusing it would bias the mean downwards (the winner's curse).

    tune:
      lrs: [3.0e-4, 1.0e-3, 3.0e-3, 1.0e-2, 3.0e-2]  # ≥ 5 values, log-spaced, for every row ...
      lrs_by_method: {qlora: [...]}                 # ... except where a method needs another range
      search_seed: 0
      seeds: [1, 2, 3]                               # ≥ 3
      metric: val_loss                               # a summary.json number, lower is better
      scan: {method.dense_lr_scale: [4, 16, 1]}      # optional: a second axis, one key, >= 3 values

With ``scan`` the search is the grid of (learning rate, value) pairs — a 2-D search, e.g. AdamW's matrix rate
and its embedding/head rate multiplier; each axis then needs at least ``MIN_AXIS`` values (3 × 3 = 9 runs, as
many as a 5-point search plus its spares) — and the final runs take the best pair. A pair is bracketed when
both of its coordinates are interior to their axes.

The best learning rate is the one with the lowest metric (a failed or non-finite run counts as +∞; ties go to the
smaller learning rate); a winner at either end of its grid is reported as not bracketed (``bracketed``), since
the optimum may lie outside the grid. ``analysis`` renders the search (``lr_search_table``) with the same rule.
This module imports neither torch nor Hydra: the report uses it too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from experiments import methods
from experiments.errors import UserError
from experiments.sweeps.overrides import merge_overrides, override_key

TUNE_KEYS = ("lrs", "lrs_by_method", "search_seed", "seeds", "metric", "scan")
MIN_GRID, MIN_SEEDS, MIN_AXIS = 5, 3, 3
SEARCH_SUFFIX = "-lr-search"


@dataclass(frozen=True, kw_only=True)
class TuneSpec:
    lrs: tuple[float, ...]
    lrs_by_method: Mapping[str, tuple[float, ...]]
    search_seed: int = 0
    seeds: tuple[int, ...] = (1, 2, 3)
    metric: str = "val_loss"
    scan_key: str | None = None  # the second search axis (``scan``), or None
    scan_values: tuple[str, ...] = ()  # its values, as override strings

    def grid_for(self, method: str) -> tuple[float, ...]:
        return tuple(self.lrs_by_method.get(method, self.lrs))


def _numbers(where: str, values, what: str) -> tuple[float, ...]:
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in values):
        raise UserError(f"{where} must be a list of numbers ({what}), got {values!r}")
    return tuple(sorted(float(v) for v in values))


def _grid(where: str, values, least: int = MIN_GRID) -> tuple[float, ...]:
    grid = _numbers(where, values, "learning rates")
    if len(set(grid)) < least or grid[0] <= 0:
        raise UserError(f"{where} needs at least {least} distinct positive learning rates (log-spaced, "
                            f"bracketing the best), got {values!r}")
    return grid


def _scan(block) -> tuple[str | None, tuple[str, ...]]:
    """(key, values as override strings) of ``tune.scan``, or (None, ()) without one."""
    if block is None:
        return None, ()
    if not isinstance(block, dict) or len(block) != 1:
        raise UserError(f"`tune.scan` must map one config key to its values, got {block!r}")
    (key, values), = block.items()
    if key in ("method.lr", "seed"):
        raise UserError(f"`tune.scan` cannot scan {key}: the search sets it")
    _numbers(f"`tune.scan.{key}`", values, "the values searched")
    if len(set(values)) < MIN_AXIS or len(set(values)) < len(values):
        raise UserError(f"`tune.scan.{key}` needs at least {MIN_AXIS} distinct values, got {list(values)}")
    return str(key), tuple(format(float(v), "g") for v in values)  # the file's order: the search runs in it


def parse_tune(block) -> TuneSpec:
    if not isinstance(block, dict):
        raise UserError(f"`tune` must be a mapping with {', '.join(TUNE_KEYS)}, got {block!r}")
    unknown = sorted(set(block) - set(TUNE_KEYS))
    if unknown:
        raise UserError(f"unknown `tune` keys {unknown}; allowed: {', '.join(TUNE_KEYS)}")
    if "lrs" not in block:
        raise UserError("`tune` needs `lrs`, the learning-rate grid")
    by_method = block.get("lrs_by_method") or {}
    if not isinstance(by_method, dict):
        raise UserError(f"`tune.lrs_by_method` must map a method name to a grid, got {by_method!r}")
    seeds = block.get("seeds", [1, 2, 3])
    search_seed = block.get("search_seed", 0)
    if (not isinstance(seeds, list) or len(set(seeds)) < MIN_SEEDS
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        raise UserError(f"`tune.seeds` must list at least {MIN_SEEDS} distinct seeds >= 0, got {seeds!r}")
    if not isinstance(search_seed, int) or isinstance(search_seed, bool) or search_seed < 0:
        raise UserError(f"`tune.search_seed` must be a seed >= 0, got {search_seed!r}")
    if search_seed in seeds:
        raise UserError(f"`tune.seeds` must not contain the search seed {search_seed} (the winner's search run "
                            "is the luckiest of its grid; reusing it biases the mean)")
    metric = block.get("metric", "val_loss")
    if not isinstance(metric, str) or not metric:
        raise UserError(f"`tune.metric` must name a summary.json number, got {metric!r}")
    scan_key, scan_values = _scan(block.get("scan"))
    least = MIN_AXIS if scan_key else MIN_GRID
    return TuneSpec(lrs=_grid("`tune.lrs`", block["lrs"], least),
                    lrs_by_method={str(m): _grid(f"`tune.lrs_by_method.{m}`", g, least)
                                   for m, g in by_method.items()},
                    search_seed=search_seed, seeds=tuple(seeds), metric=metric, scan_key=scan_key,
                    scan_values=scan_values)


# ---- the selection rule (shared with analysis) -----------------------------------------------------------------
def metric_or_inf(value) -> float:
    """A run's metric as a float; a missing or non-finite value (failed or diverged run) is +∞."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return math.inf
    return value if math.isfinite(value) else math.inf


def select_lr(losses: Mapping[float, float]) -> tuple[float, bool]:
    """(best learning rate, bracketed): the lowest metric, ties to the smaller rate; ``bracketed`` is False when
    the best is the smallest or largest rate searched (the optimum may lie beyond the grid) or nothing finished."""
    grid = sorted(losses)
    best = min(grid, key=lambda lr: (metric_or_inf(losses[lr]), lr))
    finite = math.isfinite(metric_or_inf(losses[best]))
    return best, finite and grid[0] < best < grid[-1]


def select_pair(losses: Mapping[tuple[float, float], float]) -> tuple[tuple[float, float], bool]:
    """``select_lr`` on a 2-D search: the (rate, value) pair with the lowest metric (ties to the smaller rate,
    then the smaller value), bracketed when both coordinates are interior to their axes."""
    best = min(losses, key=lambda pair: (metric_or_inf(losses[pair]), pair))
    rates, values = sorted({p[0] for p in losses}), sorted({p[1] for p in losses})
    finite = math.isfinite(metric_or_inf(losses[best]))
    return best, finite and rates[0] < best[0] < rates[-1] and values[0] < best[1] < values[-1]


# ---- expansion ---------------------------------------------------------------------------------------------------
def _value(row: Sequence[str], key: str) -> str | None:
    values = [o.partition("=")[2] for o in row if override_key(o) == key]
    return values[-1] if values else None


def search_results_dir(results_dir: str) -> str:
    return str(results_dir).rstrip("/") + SEARCH_SUFFIX


def is_search_run(job: Sequence[str]) -> bool:
    """Whether a job is a learning-rate search run (its failure, e.g. divergence at a high rate, is a result)."""
    return (_value(job, "results_dir") or "").endswith(SEARCH_SUFFIX)


@dataclass(frozen=True)
class RunLookup:
    """What the expansion needs from the runner: a run's folder (composing its config) and its default results
    folder. Kept as callables so this module never imports the runner."""

    run_path: Callable[[list[str]], Path]
    default_results_dir: str = "results"


def read_metric(run_dir: Path, metric: str) -> tuple[str, float]:
    """(state, metric) of a finished run directory: state is the ``status`` word (``pending`` if none)."""
    try:
        state = (run_dir / "status").read_text().strip() or "pending"
    except (FileNotFoundError, NotADirectoryError):
        return "pending", math.inf
    if state != "completed":
        return state, math.inf
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return state, math.inf
    return state, metric_or_inf(summary.get(metric) if isinstance(summary, dict) else None)


def _search_points(spec: TuneSpec, method: str) -> list[list[str]]:
    """The overrides of each search point of a row: its rate, and its ``scan`` value when there is a scan (value
    by value in the file's order, each over every rate: a search cut short has whole rate columns)."""
    rates = [f"method.lr={lr:g}" for lr in spec.grid_for(method)]
    if spec.scan_key is None:
        return [[rate] for rate in rates]
    return [[rate, f"{spec.scan_key}={value}"] for value in spec.scan_values for rate in rates]


def _best(jobs: Sequence[Sequence[str]], outcomes, spec: TuneSpec) -> tuple[list[str], float]:
    """(the winning search point's overrides, its metric) by ``select_lr`` / ``select_pair``."""
    if spec.scan_key is None:
        losses = {float(_value(job, "method.lr")): loss for job, (_, loss) in zip(jobs, outcomes)}
        best, _ = select_lr(losses)
        return [f"method.lr={best:g}"], losses[best]
    pairs = {(float(_value(job, "method.lr")), float(_value(job, spec.scan_key))): loss
             for job, (_, loss) in zip(jobs, outcomes)}
    (lr, value), _ = select_pair(pairs)
    return [f"method.lr={lr:g}", f"{spec.scan_key}={value:g}"], pairs[(lr, value)]


def tuned_jobs(rows: Sequence[Sequence[str]], spec: TuneSpec, lookup: RunLookup) -> list[list[str]]:
    """The search runs of every row, then — once every search run has finished (completed, failed or diverged) —
    each row's final runs at its best learning rate (and ``scan`` value)."""
    search: list[list[list[str]]] = []
    for row in rows:
        for key, why in (("method.lr", "the learning rate is searched (`tune.lrs`)"),
                         ("seed", "a tuned sweep sets seeds (`tune.seeds`)"),
                         (spec.scan_key, "it is searched (`tune.scan`)")):
            if key is not None and _value(row, key) is not None:
                raise UserError(f"run [{' '.join(row)}] sets {key}; in a tuned sweep {why}")
        method = _value(row, "method") or methods.DEFAULT
        results_dir = search_results_dir(_value(row, "results_dir") or lookup.default_results_dir)
        search.append([merge_overrides(row, [*point, f"seed={spec.search_seed}", f"results_dir={results_dir}"])
                       for point in _search_points(spec, method)])
    jobs = [job for row_jobs in search for job in row_jobs]
    outcomes = [[read_metric(lookup.run_path(job), spec.metric) for job in row_jobs] for row_jobs in search]
    if any(state not in ("completed", "failed", "diverged") for row in outcomes for state, _ in row):
        return jobs
    for row, row_jobs, row_outcomes in zip(rows, search, outcomes):
        point, loss = _best(row_jobs, row_outcomes, spec)
        if not math.isfinite(loss):
            raise UserError(f"no learning rate of the search finished with a finite {spec.metric} for "
                                f"[{' '.join(row)}]; widen or lower `tune.lrs`")
        jobs.extend(merge_overrides(row, [*point, f"seed={seed}"]) for seed in spec.seeds)
    return jobs
