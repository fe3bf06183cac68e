"""Errors that are the user's input, not the harness's bug.

Raise ``UserError`` (or a subclass) with a message that names the culprit — the file, the config key and the
value — and the entry points (``experiments.run``, ``experiments.sweep``, ``experiments.plan``,
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


def exit_with_error(message: str, code: int = 2) -> None:
    """Print ``error: <message>`` on one line to stderr and exit with ``code``."""
    line = f"error: {' '.join(str(message).split())}"
    print(line, file=sys.stderr)
    raise ErrorExit(line, code)


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
