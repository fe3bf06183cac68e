"""Errors that are the user's input, not the harness's bug.

Raise ``UserError`` (or a subclass) with a message that names the culprit — the file, the config key and the
value — and the entry points (``experiments.run``, ``experiments.sweeps.sweep``, ``experiments.planner.plan``,
``analysis.report``) print it as one line ``error: <message>`` and exit non-zero, with no traceback (set
``HYDRA_FULL_ERROR=1`` to see one). Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class UserError(ValueError):
    """Bad input (a file, a key, a value) that the user can fix; the message names it."""


class ErrorExit(SystemExit):
    """Exit ``code`` after an ``error:`` line; ``str()`` is that line (what ``pytest.raises(match=...)`` sees)."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(code)
        self.line = line

    def __str__(self) -> str:
        return self.line


def exit_with_error(message: str, code: int = 2, *, every_rank: bool = False) -> None:
    """Print ``error: <message>`` on one line to stderr and exit with ``code``. Under torchrun only rank 0
    prints (``says_errors``): bad input is refused alike on every rank, so it is said once; ``every_rank``: what
    this rank alone knows (another rank died under it)."""
    line = f"error: {' '.join(str(message).split())}"
    if every_rank or says_errors():
        print(line, file=sys.stderr)
    raise ErrorExit(line, code)


def says_errors() -> bool:
    """Whether this process prints errors: one process, or rank 0 of a torchrun/Slurm job (``RANK``)."""
    return os.environ.get("RANK", "0") in ("", "0")


def one_line_errors(fn: Callable[[], T], *extra: type[BaseException]) -> T:
    """Run ``fn``; a ``UserError`` (or one of ``extra``) becomes ``error: ...`` + exit 2 unless HYDRA_FULL_ERROR=1."""
    try:
        return fn()
    except (UserError, *extra) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        exit_with_error(str(e))
    raise AssertionError("unreachable")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose usage errors end, like every other error here, in one ``error: ...`` line (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        exit_with_error(f"{self.prog}: {message}")
