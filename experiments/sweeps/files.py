"""Sweep files: where they are, what they hold, and the override sets (runs) they expand to.

A sweep file (``experiments/sweeps/<name>.yaml``) lists override sets for ``python -m experiments.run``::

    description: what this grid is for
    common: [train.steps=2000]          # added to every run
    grid:                               # cartesian product; the first key varies slowest
      method: [adamw, qlora, galore, apollo, hmt]
      model: [125m, 350m]
      seed: [0, 1, 2]
    runs:                               # explicit override sets, after the grid's
      - [method=hmt, model=1b, seed=0]
    tune:                               # optional: search method.lr per run, rerun the best with seeds
      lrs: [3.0e-4, 1.0e-3, 3.0e-3, 1.0e-2, 3.0e-2]
      seeds: [1, 2, 3]

With ``tune`` (``experiments.sweeps.tuning``) each run above is a row of the comparison, expanded into its learning-rate
search and, once every search has finished, its final seeded runs; expanding it reads finished runs' results,
so callers pass how to find a run's folder (``lookup``).

Precedence, lowest first: ``common``, the grid point / run, overrides given on the command line.

Bad input — an unknown sweep name, a file that is not YAML or not shaped as above, an override that does not
parse — raises ``UserError`` naming the file, the key and the value.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from experiments.errors import UserError
from experiments.sweeps.overrides import merge_overrides
from experiments.sweeps.tuning import RunLookup, TuneSpec, parse_tune, tuned_jobs

SWEEPS_DIR = Path(__file__).resolve().parent  # the sweep files sit beside this module
SWEEP_FILE_KEYS = ("description", "common", "grid", "runs", "tune", "branches")  # branches: experiments.sweeps.branches


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message (its type's name when there is none)."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def resolve_sweep_path(sweep: str | Path) -> Path:
    """A path to a sweep file, or a bare name of one under experiments/sweeps/ (with or without .yaml)."""
    path = Path(sweep)
    if path.is_file():
        return path
    for candidate in (SWEEPS_DIR / f"{sweep}.yaml", SWEEPS_DIR / str(sweep)):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml")))
    what = "is a folder, not a sweep file" if path.is_dir() else "not found"
    raise UserError(f"sweep {sweep}: {what} (nor {SWEEPS_DIR / f'{path.stem}.yaml'}); sweeps in {SWEEPS_DIR}: {known}")


def _scalar(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise UserError(f"grid value for {key!r} must be a scalar, got {value!r}; write it in `runs` as an override")


def _override_list(where: str, value: Any) -> list[str]:
    """A YAML list of overrides (strings like ``key=value``; numbers and booleans are not overrides)."""
    if not isinstance(value, list):
        raise UserError(f"{where} must be a list of overrides like [train.steps=3], got {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise UserError(f"{where}: {item!r} is not an override; write key=value (in YAML `key: value` is a "
                            "mapping, `key=value` an override)")
    return list(value)


def expand_sweep(spec: dict) -> list[list[str]]:
    """The override sets of a parsed sweep file, in a fixed order (grid first, then ``runs``)."""
    unknown = set(spec) - set(SWEEP_FILE_KEYS)
    if unknown:
        raise UserError(f"unknown sweep file keys {sorted(unknown)}; allowed: {', '.join(SWEEP_FILE_KEYS)}")
    common = _override_list("`common`", spec.get("common") or [])
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict):
        raise UserError(f"`grid` must be a mapping of key: [values], got {grid!r}")
    points: list[list[str]] = []
    if grid:
        axes = []
        for key, values in grid.items():
            values = values if isinstance(values, list) else [values]
            if not values:
                raise UserError(f"`grid` key {key!r} has no values (an empty list would make the grid empty)")
            axes.append([f"{key}={_scalar(key, v)}" for v in values])
        points.extend(list(point) for point in itertools.product(*axes))
    runs = spec.get("runs") or []
    if not isinstance(runs, list):
        raise UserError(f"`runs` must be a list of override lists, got {runs!r}")
    for number, run in enumerate(runs):
        if not isinstance(run, list):
            raise UserError(f"each entry of `runs` must be a list of overrides, got {run!r}")
        points.append(_override_list(f"`runs` entry {number}", run))
    if not points:
        raise UserError("sweep file has neither `grid` nor `runs`")
    return [merge_overrides(common, point) for point in points]


def load_sweep(sweep: str | Path) -> list[list[str]]:
    """The override sets (rows) a sweep file lists; a ``tune`` block is validated but not applied here."""
    return read_sweep_spec(sweep)[0]


def read_sweep_spec(sweep: str | Path) -> tuple[list[list[str]], TuneSpec | None]:
    """(rows, tune spec or None) of a sweep file, validated."""
    path = resolve_sweep_path(sweep)
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot be read ({e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise UserError(f"{path}: not valid YAML ({getattr(e, 'problem', None) or e}{where})") from None
    if not isinstance(spec, dict):
        raise UserError(f"{path}: a sweep file is a mapping with grid/runs/common/description, "
                        f"not a {type(spec).__name__}")
    try:
        return expand_sweep(spec), (parse_tune(spec["tune"]) if "tune" in spec else None)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def sweep_label(sweep: str | Path | None) -> str:
    """How errors name where a run came from: the sweep file, or the command line."""
    if sweep in (None, "", "-"):
        return "the command-line grid"
    try:
        path = resolve_sweep_path(sweep).absolute()
    except UserError:
        return str(sweep)
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def expand_command_line(overrides: Sequence[str], config_loader: Any = None) -> list[list[str]]:
    """Hydra's multirun grid of command-line overrides (``method=adamw,qlora seed=0,1`` -> 4 override lists)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(list(overrides))
    except OverrideParseException as e:
        raise UserError(f"bad override {e.override!r}: {first_line(e)}") from None
    return BasicSweeper.split_arguments(parsed, None)[0]


def sweep_jobs(sweep: str | Path | None, overrides: Sequence[str], config_loader: Any = None,
               lookup: RunLookup | None = None) -> list[list[str]]:
    """The runs of a multirun: each run of the sweep file (none: one empty run) x the command-line grid, a later
    override of a key replacing an earlier one; a tuned sweep expands each of them into its learning-rate search
    and final runs (``lookup`` finds finished runs). The sweeper and the CLI both use this, so they agree."""
    from_file, tune = read_sweep_spec(sweep) if sweep not in (None, "", "-") else ([[]], None)
    command_line = expand_command_line(overrides, config_loader)
    rows = [merge_overrides(f, c) for f in from_file for c in command_line]
    if tune is None:
        return rows
    if lookup is None:
        raise UserError("a tuned sweep's runs depend on finished runs; no way to find them was given")
    try:
        return tuned_jobs(rows, tune, lookup)
    except UserError as e:
        raise UserError(f"{sweep_label(sweep)}: {e}") from None
