"""The value checks the run configuration's sections share (``experiments.config``): each raises a ``ValueError``
naming the offending key (``<section>.<name>``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def positive(section: str, obj: Any, *names: str) -> None:
    """Each of ``obj``'s fields ``names`` is set and > 0."""
    for name in names:
        value = getattr(obj, name)
        if value is None or not value > 0:
            raise ValueError(f"{section}.{name} must be > 0, got {value}")


def check_folder(key: str, folder: str) -> None:
    """``folder`` (``~`` expanded) must be a directory or creatable as one: no part of it may be a file."""
    path = Path(folder).expanduser()
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "is a file" if part == path else f"lies under {part}, which is a file"
                raise ValueError(f"{key}={folder} {what}, not a folder; point {key} at a folder (it is created "
                                 "if missing)")
            return


def one_of(section: str, name: str, value: Any, allowed: tuple) -> None:
    """``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{section}.{name} must be one of {list(allowed)}, got {value!r}")
