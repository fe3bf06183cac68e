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

from experiments.errors import UserError
from experiments.sweeps.overrides import merge_overrides, override_key

TUNE_KEYS = ("lrs", "lrs_by_method", "search_seed", "seeds", "metric")
MIN_GRID, MIN_SEEDS = 5, 3
SEARCH_SUFFIX = "-lr-search"


@dataclass(frozen=True, kw_only=True)
class TuneSpec:
    lrs: tuple[float, ...]
    lrs_by_method: Mapping[str, tuple[float, ...]]
    search_seed: int = 0
    seeds: tuple[int, ...] = (1, 2, 3)
    metric: str = "val_loss"

    def grid_for(self, method: str) -> tuple[float, ...]:
        return tuple(self.lrs_by_method.get(method, self.lrs))


def _grid(where: str, values) -> tuple[float, ...]:
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in values):
        raise UserError(f"{where} must be a list of numbers (learning rates), got {values!r}")
    grid = tuple(sorted(float(v) for v in values))
    if len(set(grid)) < MIN_GRID or grid[0] <= 0:
        raise UserError(f"{where} needs at least {MIN_GRID} distinct positive learning rates (log-spaced, "
                            f"bracketing the best), got {values!r}")
    return grid


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
    return TuneSpec(lrs=_grid("`tune.lrs`", block["lrs"]),
                    lrs_by_method={str(m): _grid(f"`tune.lrs_by_method.{m}`", g) for m, g in by_method.items()},
                    search_seed=search_seed, seeds=tuple(seeds), metric=metric)


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


def tuned_jobs(rows: Sequence[Sequence[str]], spec: TuneSpec, lookup: RunLookup) -> list[list[str]]:
    """The search runs of every row, then — once every search run has finished (completed or failed) — each
    row's final runs at its best learning rate."""
    search: list[list[list[str]]] = []
    for row in rows:
        if _value(row, "method.lr") is not None:
            raise UserError(f"run [{' '.join(row)}] sets method.lr; in a tuned sweep the learning rate is "
                                "searched (`tune.lrs`)")
        if _value(row, "seed") is not None:
            raise UserError(f"run [{' '.join(row)}] sets seed; a tuned sweep sets seeds (`tune.seeds`)")
        method = _value(row, "method") or "hmt"
        results_dir = search_results_dir(_value(row, "results_dir") or lookup.default_results_dir)
        search.append([merge_overrides(row, [f"method.lr={lr:g}", f"seed={spec.search_seed}",
                                             f"results_dir={results_dir}"]) for lr in spec.grid_for(method)])
    jobs = [job for row_jobs in search for job in row_jobs]
    outcomes = [[read_metric(lookup.run_path(job), spec.metric) for job in row_jobs] for row_jobs in search]
    if any(state not in ("completed", "failed") for row in outcomes for state, _ in row):
        return jobs
    for row, row_jobs, row_outcomes in zip(rows, search, outcomes):
        losses = {float(_value(job, "method.lr")): loss for job, (_, loss) in zip(row_jobs, row_outcomes)}
        best, _ = select_lr(losses)
        if not math.isfinite(losses[best]):
            raise UserError(f"no learning rate of the search finished with a finite {spec.metric} for "
                                f"[{' '.join(row)}]; widen or lower `tune.lrs`")
        jobs.extend(merge_overrides(row, [f"method.lr={best:g}", f"seed={seed}"]) for seed in spec.seeds)
    return jobs
