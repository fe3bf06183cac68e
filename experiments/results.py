"""Results store: ``<results_dir>/<run_id>/{config.yaml, metrics.jsonl, summary.json, status[, error.txt]}``;
``status`` is running | completed | failed | preempted (stopped after a checkpoint; the same command resumes).

Every file is written atomically (temp file in the same directory, fsync, ``os.replace``), so a reader — or a
crash — never sees a half-written file, and a failed run leaves every earlier file intact. ``metrics.jsonl`` is
rewritten whole at each flush for the same reason (it holds one line per logged step, so this stays small).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

STATUSES = ("running", "completed", "failed", "preempted")  # preempted: stopped after a checkpoint, resumable


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/Inf; null marks a non-finite value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _jsonable(value.item())
    return value


def dumps(value: Any) -> str:
    return json.dumps(_jsonable(value), sort_keys=True, allow_nan=False)


def check_writable(results_dir: str | Path) -> Path:
    """Create ``results_dir`` if needed and prove a file can be written there; raise a one-line error if not."""
    root = Path(results_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"results_dir={str(results_dir)!r} is not writable: {e.strerror or e}") from None
    return root


def read_status(run_dir: Path) -> str | None:
    try:
        return (run_dir / "status").read_text().strip() or None
    except FileNotFoundError:
        return None


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunDir:
    def __init__(self, root: Path, run_id: str) -> None:
        self.path = Path(root) / run_id
        self.run_id = run_id
        self._metric_lines: list[str] = []

    def start(self, config: dict, *, keep_metrics_before: int | None = None) -> None:
        """Begin (or, with ``keep_metrics_before=k``, resume at step k: metrics rows of steps < k are kept)."""
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in ("summary.json", "error.txt"):
            (self.path / stale).unlink(missing_ok=True)
        atomic_write_text(self.path / "config.yaml", yaml.safe_dump(_jsonable(config), sort_keys=False))
        if keep_metrics_before is None:
            self._metric_lines = []
        else:
            self._metric_lines = [dumps(r) for r in read_metrics(self.path) if r.get("step", 0) < keep_metrics_before]
        self.flush()
        self.set_status("running")

    def set_status(self, status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        atomic_write_text(self.path / "status", status + "\n")

    def log(self, metrics: dict) -> None:
        self._metric_lines.append(dumps(metrics))

    def flush(self) -> None:
        atomic_write_text(self.path / "metrics.jsonl", "".join(line + "\n" for line in self._metric_lines))

    def finish(self, summary: dict) -> None:
        self.flush()
        atomic_write_text(self.path / "summary.json", json.dumps(_jsonable(summary), indent=2, sort_keys=True,
                                                                  allow_nan=False) + "\n")
        self.set_status("completed")

    def preempt(self) -> None:
        """Stopped by a preemption signal or Ctrl-C after writing a checkpoint: the same command resumes it."""
        self.flush()
        self.set_status("preempted")

    def fail(self, message: str) -> None:
        if self._metric_lines:
            self.flush()
        atomic_write_text(self.path / "error.txt", message)
        self.set_status("failed")
