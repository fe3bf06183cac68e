"""Sweep files, run identity and run state: what a sweep is, which of its runs are done, and a CLI over them.

A sweep file (``experiments/sweeps/<name>.yaml``) lists override sets for ``python -m experiments.run``; its
format and expansion are in ``experiments.sweeps.files``.

A run's identity is the runner's own: the ``run_id`` it would write to (``run_id=`` if given, else
``experiments.runs.default_run_id`` of the composed, validated config), under ``results_dir``. Its state is the
word in ``<results_dir>/<run_id>/status`` (running | completed | failed | diverged | preempted) or ``pending`` when
the run has not started. Completed runs are skipped by the sweeper (``hydra_plugins/hmt_sweeper``) and by the
runner unless ``force=true``.

Bad input — an unknown sweep name, a sweep file that is not YAML or not shaped as it should be, an override
naming an unknown key or a wrongly typed value — raises ``UserError`` naming the file, the run and the override;
the CLI prints it as one line ``error: ...`` and exits 2 (``HYDRA_FULL_ERROR=1`` shows the traceback). Every
command but ``count`` and ``overrides`` (the listing an array task reads on its node) composes and validates
each run first.

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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from experiments.errors import OneLineErrorParser, UserError, one_line_errors
from experiments.sweeps.files import (  # noqa: F401  (the sweep-file API stays importable from here)
    SWEEPS_DIR,
    expand_sweep,
    first_line,
    load_sweep,
    sweep_jobs,
    sweep_label,
)
from experiments.sweeps.overrides import merge_overrides, override_key  # noqa: F401  (likewise)
from experiments.sweeps.tuning import RunLookup

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "experiments" / "conf"
STATES = ("pending", "running", "completed", "failed", "diverged", "preempted")
# Overrides that never change what a run computes; dropped before composing a config only to learn its id.
NON_IDENTITY_KEYS = ("cluster", "hydra")
T = TypeVar("T")


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


def describe_config_error(error: BaseException) -> str:
    """Hydra's, OmegaConf's or the config schema's error in one line that names the key and the value."""
    text = str(error)
    message = first_line(error)
    if "Available options in" in text:  # an unknown group option: list the known ones
        options = []
        for line in text.split("Available options in", 1)[1].splitlines()[1:]:
            if not line.startswith("\t"):
                break
            options.append(line.strip())
        message += f" (available: {', '.join(options)})"
    if error.__cause__ is not None:
        message = f"{message.rstrip('.')}: {first_line(error.__cause__)}"
    hint = [line.strip() for line in text.splitlines()[1:] if line.strip().startswith("To append")]
    return message + (f"; {hint[0][0].lower()}{hint[0][1:]}" if hint else "")


def checked(where: str, make: Callable[[], T]) -> T:
    """``make()`` (composing and validating a run's config); a config error becomes ``UserError`` ending with
    ``(where)``."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return make()
    except UserError as e:
        raise UserError(f"{e} ({where})") from None
    except (HydraException, OmegaConfBaseException, ValueError, TypeError, FileNotFoundError) as e:
        raise UserError(f"{describe_config_error(e)} ({where})") from e


def validated_run_config(cfg: Any) -> Any:
    """The runner's frozen ``RunConfig`` of a composed Hydra config (with or without its ``hydra`` node)."""
    # The runner's modules (torch, transformers) are imported here and below, not at the top: `python -m
    # experiments.sweep list|array|status` and each Slurm array task's lookup run without importing torch.
    import dataclasses

    from omegaconf import OmegaConf

    from experiments.config import RunConfig, to_run_config
    from experiments.models import with_config_name

    if "hydra" in cfg:  # a job's config: its hydra node may hold values only set inside the job
        cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(str(key) for key in cfg if key not in known)
    if unknown:
        hint = ("; a sweep file is chosen with hydra.sweeper.file=<name> (experiments.run -m) or as the sweep "
                "argument (experiments.sweeps.sweep)") if "sweep" in unknown else ""
        raise UserError(f"unknown top-level config key(s) {', '.join(unknown)} (added with +key=...?); known: "
                        f"{', '.join(sorted(known))}{hint}")
    return with_config_name(to_run_config(cfg))


def run_ref_from_config(cfg: Any) -> RunRef:
    """The run a composed Hydra config would write, per the runner's rules (validating the config); a run
    recorded under an earlier id of the same configuration (``experiments.runs.recorded_under``) is that run."""
    from experiments.runs import default_run_id, recorded_under

    run = validated_run_config(cfg)
    results_dir = Path(run.results_dir).expanduser()
    run_id = run.run_id or default_run_id(run)
    if not run.run_id and not (results_dir / run_id).exists():
        run_id = recorded_under(results_dir, run_id) or run_id
    return RunRef(results_dir, run_id, bool(run.force))


def compose_run_config(overrides: Sequence[str]) -> Any:
    """Compose ``experiments/conf/run.yaml`` with ``overrides`` (Hydra's compose API; no job is run)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import experiments.execute  # noqa: F401  (registers the structured configs)

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
    """``pending`` (never started), or the word in ``status``: running | completed | failed | diverged | preempted."""
    try:
        word = (Path(run_dir) / "status").read_text().strip()
    except (FileNotFoundError, NotADirectoryError):  # never started (or results_dir is not even a folder)
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
def run_lookup(run_ref: Callable[[list[str]], RunRef] | None = None) -> RunLookup:
    """How a tuned sweep finds its finished runs: each run's folder by the runner's own identity rules."""
    import dataclasses

    from experiments.config import RunConfig

    make_ref = run_ref or run_ref_for
    default_dir = next(f.default for f in dataclasses.fields(RunConfig) if f.name == "results_dir")
    return RunLookup(run_path=lambda job: checked(' '.join(job), lambda: make_ref(job)).path,
                     default_results_dir=default_dir)


def _jobs(args: argparse.Namespace) -> list[list[str]]:
    extra = list(args.overrides)
    if getattr(args, "results_dir", None):
        extra.append(f"results_dir={args.results_dir}")
    return sweep_jobs(args.sweep, extra, lookup=run_lookup())


def checked_run_refs(jobs: Sequence[Sequence[str]], label: str) -> list[RunRef]:
    """The run of every job, each composed and validated; ``UserError`` naming the first bad run."""
    return [checked(f"run {index} of {label}: {' '.join(job)}", lambda job=job: run_ref_for(job))
            for index, job in enumerate(jobs)]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def status_rows(jobs: Sequence[Sequence[str]], refs: Sequence[RunRef] | None = None) -> list[dict]:
    refs = refs if refs is not None else [run_ref_for(job) for job in jobs]
    rows = []
    for index, (job, ref) in enumerate(zip(jobs, refs)):
        state = run_state(ref.path)
        error = ""
        if state in ("failed", "diverged") and (ref.path / "error.txt").exists():
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
    shown = {s: n for s, n in counts.items() if n or s not in ("diverged", "preempted")}  # these: only when some
    print(", ".join(f"{n} {s}" for s, n in shown.items()) + (f", {others} other" if others else "")
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
    parser = OneLineErrorParser(prog="python -m experiments.sweep", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
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
    return one_line_errors(lambda: run_command(args))


def run_command(args: argparse.Namespace) -> int:
    jobs = _jobs(args)
    label = sweep_label(args.sweep)
    if args.command == "count":
        print(len(jobs))
    elif args.command == "list":
        checked_run_refs(jobs, label)
        for index, job in enumerate(jobs):
            print(f"{index:>3}  {' '.join(job)}")
    elif args.command == "status":
        print_status(status_rows(jobs, checked_run_refs(jobs, label)))
    elif args.command == "array":
        todo = [i for i, ref in enumerate(checked_run_refs(jobs, label)) if run_state(ref.path) != "completed"]
        if not todo:
            print("every run of this sweep is completed", file=sys.stderr)
            return 1
        print(array_spec(todo))
    else:
        if not 0 <= args.index < len(jobs):
            raise UserError(f"--index {args.index} is out of range: {label} has {len(jobs)} runs (0-{len(jobs) - 1})")
        job = jobs[args.index]
        if args.command == "overrides":
            print("\n".join(job))
        else:
            where = f"run {args.index} of {label}: {' '.join(job)}"
            cfg = checked(where, lambda: compose_run_config(job))
            ref, config = checked(where, lambda: (run_ref_from_config(cfg), _plain_config(cfg)))
            return mark_failed(ref, args.reason, config)
    return 0


def mark_failed(ref: RunRef, reason: str, config: dict | None = None) -> int:
    """Record a run that died without writing its own final status (killed, OOM, crashed before starting);
    ``config`` (the run's resolved config) is written as its config.yaml when the run never got to write one."""
    from experiments.results import RunDir, atomic_write_text

    state = run_state(ref.path)
    if state in ("completed", "failed", "diverged", "preempted"):  # a final status the run wrote itself
        print(f"{ref.run_id}: already {state}; left as is", file=sys.stderr)
        return 0
    try:
        if config is not None and not (ref.path / "config.yaml").exists():
            atomic_write_text(ref.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        RunDir(ref.results_dir, ref.run_id).fail(reason.rstrip("\n") + "\n")
    except OSError as e:
        culprit = f" ({e.filename})" if e.filename and str(e.filename) != str(ref.path) else ""
        raise UserError(f"cannot mark {ref.path} failed: {e.strerror or e}{culprit}") from None
    print(f"{ref.run_id}: marked failed ({reason})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
