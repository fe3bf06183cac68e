"""Find the run directories under a results tree and read their files, turning a damaged run into a warning.

A run directory holds ``summary.json`` (a finished run), or ``status`` and ``config.yaml`` (a run that is running,
failed, or was marked failed). Runs may sit at any depth below the root (``results/reference/<run_id>``); the
search does not descend into a run directory, nor into ``.multirun``, ``checkpoints``, ``wandb``, ``model`` or any
hidden folder.

One crashed or truncated run must not sink a report over many: ``read_run`` returns ``None`` for a run it cannot
use and calls ``warn`` with one line naming the file and what is wrong with it. Damage it recovers from is warned
about too: a torn last line of ``metrics.jsonl`` (a run killed mid-write) is dropped, a finished run without
usable metrics keeps its summary's numbers but has no loss curve. A summary.json holding ``{}`` (a run killed
between opening and writing it) is treated like a truncated one: warned about, run skipped.

A dry run (``mode: dryrun``: a traced step, no training) whose folder holds summary.json alone is not damaged: the
dry-run tables (``benchmarks.dryrun_table``, the architecture and embedding-memory tables) keep only the summary,
and a dry run has no loss curve. ``RunFiles.alone`` marks it; the report counts such folders in one note.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SKIPPED_DIR_NAMES = frozenset({".multirun", "checkpoints", "wandb", "model"})


@dataclass
class RunFiles:
    """The parsed files of one run directory (empty mappings for the files it does not have)."""

    path: Path
    status: str
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)
    alone: tuple[str, ...] = ()  # a dry run's files it was written without (config.yaml, metrics.jsonl): expected


def is_run_dir(names: set[str] | list[str]) -> bool:
    """Whether a folder with these file names is a run directory."""
    return "summary.json" in names or ("status" in names and "config.yaml" in names)


def find_run_dirs(root: Path) -> list[Path]:
    """Every run directory at or below ``root``, sorted by path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if is_run_dir(filenames):
            found.append(Path(dirpath))
            dirnames[:] = []  # runs do not nest; a run's own folders (checkpoints, model) are not runs
            continue
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIR_NAMES and not d.startswith("."))
    return sorted(found)


class DamagedFileError(Exception):
    """A run's file that cannot be used; the message says what is wrong with it (the caller names the file)."""


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; ``DamagedFileError`` naming the problem when it is unreadable or not text."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DamagedFileError(f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise DamagedFileError(f"unreadable ({e.strerror or e})") from None


def _read_json_object(path: Path) -> dict:
    text = _read_text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DamagedFileError(f"not valid JSON ({e.msg}: line {e.lineno} column {e.colno}; cut short?)") from None
    if not isinstance(value, dict):
        raise DamagedFileError(f"holds a JSON {type(value).__name__}, not an object")
    return value


def _read_yaml_mapping(path: Path) -> dict:
    try:
        value = yaml.safe_load(_read_text(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        raise DamagedFileError(f"not valid YAML ({getattr(e, 'problem', None) or 'syntax error'}{where})") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DamagedFileError(f"holds a YAML {type(value).__name__}, not a mapping")
    return value


def _metric_line(text: str) -> dict:
    row = json.loads(text)
    if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
        raise DamagedFileError("not an object with an integer 'step'")
    return row


def read_metrics(path: Path, warn: Callable[[str], None]) -> list[dict]:
    """The rows of ``metrics.jsonl``. A torn last line (no newline at the end, not JSON) is dropped with a warning;
    any other bad line makes the whole file unusable (warning, no rows)."""
    try:
        text = _read_text(path)
    except DamagedFileError as e:
        warn(f"{path}: {e}; the run's metrics are left out")
        return []
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(_metric_line(line))
        except (json.JSONDecodeError, DamagedFileError) as e:
            if number == len(lines) and not text.endswith("\n"):
                warn(f"{path}: line {number} is cut short (the run was killed while writing it?); line ignored")
                continue
            reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            warn(f"{path}: line {number} is not a metrics record ({reason}); the run's metrics are left out")
            return []
    return rows


def read_status(run_dir: Path) -> str:
    """``pending`` (no status file, or an empty one), else the word in ``status``."""
    try:
        return (run_dir / "status").read_text(encoding="utf-8", errors="replace").strip() or "pending"
    except OSError:
        return "pending"


def read_run(run_dir: Path, warn: Callable[[str], None]) -> RunFiles | None:
    """The run's parsed files, or ``None`` (after a warning naming the file) when the run cannot be used."""
    run = RunFiles(run_dir, read_status(run_dir))
    summary_path, config_path, metrics_path = (run_dir / n for n in ("summary.json", "config.yaml", "metrics.jsonl"))
    for path, reader, attribute in ((summary_path, _read_json_object, "summary"),
                                    (config_path, _read_yaml_mapping, "config")):
        if not path.exists():
            continue
        try:
            setattr(run, attribute, reader(path))
        except DamagedFileError as e:
            warn(f"{path}: {e}; run skipped")
            return None
    if summary_path.exists() and not run.summary:
        warn(f"{summary_path}: holds an empty JSON object (the run was killed while writing it?); run skipped")
        return None
    if run.status == "completed" and not summary_path.exists():
        warn(f"{summary_path}: missing although {run_dir / 'status'} says completed; run skipped")
        return None
    dry = run.summary.get("mode") == "dryrun"
    run.alone = tuple(p.name for p in (config_path, metrics_path) if dry and not p.exists())
    if summary_path.exists() and not config_path.exists() and not dry:
        warn(f"{config_path}: missing; the run is grouped by method and model only")
    if metrics_path.exists():
        run.metrics = read_metrics(metrics_path, warn)
    elif summary_path.exists() and not dry:
        warn(f"{metrics_path}: missing; the run's table numbers come from summary.json, it has no loss curve")
    return run
