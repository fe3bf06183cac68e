"""Sweep files, run identity and run state: what a sweep is, which of its runs are done, and a CLI over them.

A sweep file (``experiments/sweeps/<name>.yaml``) lists override sets for ``python -m experiments.run``::

    description: what this grid is for
    common: [train.steps=2000]          # added to every run
    grid:                               # cartesian product; the first key varies slowest
      method: [adamw, qlora, galore, apollo, hmt]
      model: [125m, 350m]
      seed: [0, 1, 2]
    runs:                               # explicit override sets, after the grid's
      - [method=hmt, model=1b, seed=0]

Precedence, lowest first: ``common``, the grid point / run, overrides given on the command line.

A run's identity is the runner's own: the ``run_id`` it would write to (``run_id=`` if given, else
``experiments.run.default_run_id`` of the composed, validated config), under ``results_dir``. Its state is the
word in ``<results_dir>/<run_id>/status`` (running | completed | failed) or ``pending`` when the run has not
started. Completed runs are skipped by the sweeper (``hydra_plugins/hmt_sweeper``) and by the runner unless
``force=true``.

CLI (the sweep argument is a path or a name under experiments/sweeps/, or ``-`` for none; trailing overrides
are added to every run and may sweep (``seed=0,1,2``), exactly as on the ``experiments.run -m`` command line)::

    python -m experiments.sweep list     <sweep> [overrides]      index and overrides of every run
    python -m experiments.sweep count    <sweep>                  number of runs
    python -m experiments.sweep status   <sweep> [--results-dir D] [overrides]   state of every run
    python -m experiments.sweep overrides <sweep> --index I [overrides]  run I's overrides, one per line
    python -m experiments.sweep array    <sweep> [overrides]      sbatch --array spec of the runs not completed
    python -m experiments.sweep mark-failed <sweep> --index I --reason TEXT [overrides]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
SWEEPS_DIR = REPO_ROOT / "experiments" / "sweeps"
CONF_DIR = REPO_ROOT / "experiments" / "conf"
STATES = ("pending", "running", "completed", "failed")
# Overrides that never change what a run computes; dropped before composing a config only to learn its id.
NON_IDENTITY_KEYS = ("cluster", "hydra")


# ---- sweep files -----------------------------------------------------------------------------------------------
def resolve_sweep_path(sweep: str | Path) -> Path:
    """A path to a sweep file, or a bare name of one under experiments/sweeps/ (with or without .yaml)."""
    path = Path(sweep)
    if path.exists():
        return path
    for candidate in (SWEEPS_DIR / f"{sweep}.yaml", SWEEPS_DIR / str(sweep)):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"sweep file not found: {sweep} (nor {SWEEPS_DIR / f'{sweep}.yaml'})")


def _scalar(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ValueError(f"grid value for {key!r} must be a scalar, got {value!r}; write it in `runs` as an override")


def expand_sweep(spec: dict) -> list[list[str]]:
    """The override sets of a parsed sweep file, in a fixed order (grid first, then ``runs``)."""
    unknown = set(spec) - {"description", "common", "grid", "runs"}
    if unknown:
        raise ValueError(f"unknown sweep file keys {sorted(unknown)}; allowed: description, common, grid, runs")
    common = [str(o) for o in spec.get("common") or []]
    grid = spec.get("grid") or {}
    points: list[list[str]] = []
    if grid:
        axes = [[f"{key}={_scalar(key, v)}" for v in (values if isinstance(values, list) else [values])]
                for key, values in grid.items()]
        points.extend(list(point) for point in itertools.product(*axes))
    for run in spec.get("runs") or []:
        if not isinstance(run, list):
            raise ValueError(f"each entry of `runs` must be a list of overrides, got {run!r}")
        points.append([str(o) for o in run])
    if not points:
        raise ValueError("sweep file has neither `grid` nor `runs`")
    return [merge_overrides(common, point) for point in points]


def load_sweep(sweep: str | Path) -> list[list[str]]:
    path = resolve_sweep_path(sweep)
    spec = yaml.safe_load(path.read_text()) or {}
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a sweep file is a mapping with grid/runs/common/description")
    try:
        return expand_sweep(spec)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def expand_command_line(overrides: Sequence[str], config_loader: Any = None) -> list[list[str]]:
    """Hydra's multirun grid of command-line overrides (``method=adamw,qlora seed=0,1`` -> 4 override lists)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(list(overrides))
    return BasicSweeper.split_arguments(parsed, None)[0]


def sweep_jobs(sweep: str | Path | None, overrides: Sequence[str], config_loader: Any = None) -> list[list[str]]:
    """The runs of a multirun: each run of the sweep file (none: one empty run) x the command-line grid, a later
    override of a key replacing an earlier one. The sweeper and the CLI both use this, so they agree."""
    from_file = load_sweep(sweep) if sweep not in (None, "", "-") else [[]]
    command_line = expand_command_line(overrides, config_loader)
    return [merge_overrides(f, c) for f in from_file for c in command_line]


def override_key(override: str) -> str:
    """``+train.steps=3`` -> ``train.steps``; ``~foo`` -> ``foo``; ``hydra/launcher=x`` -> ``hydra/launcher``."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*lists: Sequence[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces an earlier one (in place)."""
    merged: dict[str, str] = {}
    for overrides in lists:
        for override in overrides:
            key = override_key(override)
            merged.pop(key, None)
            merged[key] = override
    return list(merged.values())


# ---- run identity and state ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunRef:
    """Where one run of a sweep writes: ``results_dir / run_id``."""

    results_dir: Path
    run_id: str
    force: bool

    @property
    def path(self) -> Path:
        return self.results_dir / self.run_id


def validated_run_config(cfg: Any) -> Any:
    """The runner's frozen ``RunConfig`` of a composed Hydra config (with or without its ``hydra`` node)."""
    from omegaconf import OmegaConf

    from experiments.config import to_run_config

    if "hydra" in cfg:  # a job's config: its hydra node may hold values only set inside the job
        cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    return to_run_config(cfg)


def run_ref_from_config(cfg: Any) -> RunRef:
    """The run a composed Hydra config would write, per the runner's rules (validating the config)."""
    from experiments.run import default_run_id

    run = validated_run_config(cfg)
    return RunRef(Path(run.results_dir).expanduser(), run.run_id or default_run_id(run), bool(run.force))


def compose_run_config(overrides: Sequence[str]) -> Any:
    """Compose ``experiments/conf/run.yaml`` with ``overrides`` (Hydra's compose API; no job is run)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import experiments.run  # noqa: F401  (registers the structured configs)

    identity = [o for o in overrides if override_key(o).split(".")[0].split("/")[0] not in NON_IDENTITY_KEYS]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="run", overrides=identity)


def _plain_config(cfg: Any) -> dict:
    from experiments.config import to_plain_dict

    return to_plain_dict(validated_run_config(cfg))


def run_ref_for(overrides: Sequence[str]) -> RunRef:
    return run_ref_from_config(compose_run_config(overrides))


def run_state(run_dir: Path) -> str:
    """``pending`` (never started), or the word in ``status``: running | completed | failed."""
    try:
        word = (Path(run_dir) / "status").read_text().strip()
    except FileNotFoundError:
        return "pending"
    return word or "pending"


def is_completed(results_dir: str | Path, run_id: str) -> bool:
    return run_state(Path(results_dir).expanduser() / run_id) == "completed"


def last_update_s(run_dir: Path) -> float | None:
    """Seconds since any of the run's files last changed (a long-silent ``running`` run may have been killed)."""
    times = [p.stat().st_mtime for p in Path(run_dir).glob("*") if p.is_file()]
    return time.time() - max(times) if times else None


def split_completed(jobs: Sequence[Sequence[str]], refs: Sequence[RunRef]) -> tuple[list, list]:
    """(to launch, skipped) — a job is skipped when its run is completed and not forced."""
    launch, skipped = [], []
    for job, ref in zip(jobs, refs):
        (skipped if run_state(ref.path) == "completed" and not ref.force else launch).append(list(job))
    return launch, skipped


# ---- CLI -------------------------------------------------------------------------------------------------------
def _jobs(args: argparse.Namespace) -> list[list[str]]:
    extra = list(args.overrides)
    if getattr(args, "results_dir", None):
        extra.append(f"results_dir={args.results_dir}")
    return sweep_jobs(args.sweep, extra)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def status_rows(jobs: Sequence[Sequence[str]]) -> list[dict]:
    rows = []
    for index, job in enumerate(jobs):
        ref = run_ref_for(job)
        state = run_state(ref.path)
        error = ""
        if state == "failed" and (ref.path / "error.txt").exists():
            lines = [line for line in (ref.path / "error.txt").read_text().splitlines() if line.strip()]
            error = lines[-1][:120] if lines else ""
        rows.append({"index": index, "state": state, "run_id": ref.run_id, "path": str(ref.path),
                     "updated": _age(last_update_s(ref.path)) if state != "pending" else "-",
                     "overrides": " ".join(job), "error": error})
    return rows


def print_status(rows: Sequence[dict], out=None) -> None:
    out = out or sys.stdout
    id_width = max([len(r["run_id"]) for r in rows] + [6])
    print(f"{'#':>3}  {'state':<9}  {'run_id':<{id_width}}  {'updated':<8}  overrides", file=out)
    for r in rows:
        print(f"{r['index']:>3}  {r['state']:<9}  {r['run_id']:<{id_width}}  {r['updated']:<8}  {r['overrides']}",
              file=out)
        if r["error"]:
            print(f"{'':>3}  {'':<9}  error: {r['error']}", file=out)
    counts = {s: sum(r["state"] == s for r in rows) for s in STATES}
    others = len(rows) - sum(counts.values())
    print(", ".join(f"{n} {s}" for s, n in counts.items()) + (f", {others} other" if others else "")
          + f" of {len(rows)}", file=out)


def array_spec(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5`` (the form ``sbatch --array`` takes)."""
    parts, i = [], 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        parts.append(str(indices[i]) if i == j else f"{indices[i]}-{indices[j]}")
        i = j + 1
    return ",".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.sweep", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("list", "count", "status", "overrides", "array", "mark-failed"):
        p = sub.add_parser(name)
        p.add_argument("sweep")
        p.add_argument("overrides", nargs="*", help="key=value overrides added to every run")
        p.add_argument("--results-dir", default=None, help="same as the override results_dir=...")
        if name in ("overrides", "mark-failed"):
            p.add_argument("--index", type=int, required=True)
        if name == "mark-failed":
            p.add_argument("--reason", required=True)
    args, rest = parser.parse_known_args(argv)  # overrides may also follow the options
    if any(arg.startswith("-") for arg in rest):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = list(args.overrides) + rest
    jobs = _jobs(args)

    if args.command == "count":
        print(len(jobs))
    elif args.command == "list":
        for index, job in enumerate(jobs):
            print(f"{index:>3}  {' '.join(job)}")
    elif args.command == "status":
        print_status(status_rows(jobs))
    elif args.command == "array":
        todo = [i for i, job in enumerate(jobs) if run_state(run_ref_for(job).path) != "completed"]
        if not todo:
            print("every run of this sweep is completed", file=sys.stderr)
            return 1
        print(array_spec(todo))
    else:
        if not 0 <= args.index < len(jobs):
            print(f"--index {args.index} out of range: the sweep has {len(jobs)} runs", file=sys.stderr)
            return 2
        job = jobs[args.index]
        if args.command == "overrides":
            print("\n".join(job))
        else:
            cfg = compose_run_config(job)
            return mark_failed(run_ref_from_config(cfg), args.reason, _plain_config(cfg))
    return 0


def mark_failed(ref: RunRef, reason: str, config: dict | None = None) -> int:
    """Record a run that died without writing its own final status (killed, OOM, crashed before starting);
    ``config`` (the run's resolved config) is written as its config.yaml when the run never got to write one."""
    from experiments.results import RunDir, atomic_write_text

    state = run_state(ref.path)
    if state in ("completed", "failed"):
        print(f"{ref.run_id}: already {state}; left as is", file=sys.stderr)
        return 0
    if config is not None and not (ref.path / "config.yaml").exists():
        atomic_write_text(ref.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    RunDir(ref.results_dir, ref.run_id).fail(reason.rstrip("\n") + "\n")
    print(f"{ref.run_id}: marked failed ({reason})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
