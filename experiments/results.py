"""Results store: ``<results_dir>/<run_id>/{config.yaml, metrics.jsonl, summary.json, status[, error.txt]}``;
``status`` is running | completed | failed | diverged (stopped by the divergence check, ``experiments.step_tally``) |
preempted (stopped after a checkpoint; the same command resumes).

Every file is written atomically (temp file in the same directory, fsync, ``os.replace``), so a reader — or a
crash — never sees a half-written file, and a failed run leaves every earlier file intact. ``metrics.jsonl`` is
rewritten whole at each flush for the same reason (it holds one line per logged step, so this stays small).

One process at a time owns a run folder: ``RunLock`` holds an exclusive ``flock`` on ``<run_id>/.lock`` (which
records the owner's pid) for the whole run, so a second run started with the same ``run_id`` is refused instead
of interleaving its files with the first's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from experiments.errors import UserError

# preempted: stopped after a checkpoint, resumable; diverged: a failure the divergence check stopped
STATUSES = ("running", "completed", "failed", "diverged", "preempted")


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


def recorded(config: dict) -> dict:
    """``config`` as ``config.yaml`` records it (tuples as lists, non-finite floats as null)."""
    return yaml.safe_load(yaml.safe_dump(_jsonable(config), sort_keys=False))


def read_recorded_config(run_dir: Path) -> dict | None:
    """The run's ``config.yaml``, or None when it is missing or unreadable."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


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

    def fail(self, message: str, *, status: str = "failed") -> None:
        """Failed (``status``: ``failed``, or ``diverged``), ``message`` (a traceback) in ``error.txt``."""
        if self._metric_lines:
            self.flush()
        atomic_write_text(self.path / "error.txt", message)
        self.set_status(status)


class RunInUse(UserError):
    """Another live process holds the run folder's lock."""


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``<run_dir>/.lock``, held from before the run folder is read until
    the run ends; the kernel drops it when the holder dies, so a crash leaves no stale lock.

    ``fcntl.flock`` directly rather than ``filelock``: the file must say who holds it (the refusal names the pid)
    and must go on release, so that a run refused before writing anything leaves no trace (filelock keeps the file
    and records no pid). Removing a lock file is safe because an acquirer checks, after locking, that the path
    still names the inode it locked, and retries otherwise.
    """

    NAME = ".lock"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / self.NAME
        self._fd: int | None = None
        self._made_dir = False

    def __enter__(self) -> RunLock:
        self._made_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunInUse(f"run_id={self.run_dir.name} is in use by another process (pid {holder}), "
                                   f"which holds {self.path}; wait for it to end, or choose another run_id") from None
                if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                self.path.unlink(missing_ok=True)
                print(f"warning: cannot lock {self.path} ({e.strerror}: this filesystem has no flock); a second "
                      f"run with run_id={self.run_dir.name} would not be detected", file=sys.stderr)
                return self
            if _same_file(fd, self.path):
                self._fd = fd
            else:  # the previous holder removed the file between our open and flock: lock the new one
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # while still holding the lock (see the class docstring)
            os.close(self._fd)
            self._fd = None
        if self._made_dir:  # refused or failed before writing anything: leave no empty folder behind
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)
