"""One ``warning:`` line per cause: the damaged-run warnings of a report (``analysis.rundirs``,
``analysis.load``) grouped by what is wrong rather than listed once per run folder.

A warning reads ``<path>: <what is wrong>``. Two warnings have the same cause when they name the same file name
(``config.yaml``, ``metrics.jsonl``, or a run folder) and say the same thing once the paths, run ids and numbers
in them are masked (``cause_of``). A cause seen once is printed as it is; a cause seen n times prints the first
in full, the count and where they are (the folders just below the paths' common folder, with counts).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import PurePath

_MASKS = ((re.compile(r"run_id \S+"), "run_id …"), (re.compile(r"\S*/\S*"), "…"), (re.compile(r"\d+"), "N"))


def split_warning(line: str) -> tuple[str, str]:
    """(path, message) of ``<path>: <message>``; ("", line) when it names no path."""
    path, sep, message = line.partition(": ")
    return (path, message) if sep and "/" in path else ("", line)


def cause_of(line: str) -> tuple[str, str]:
    """(file name or "", message with paths, run ids and numbers masked)."""
    path, message = split_warning(line)
    name = PurePath(path).name if PurePath(path).suffix else ""
    for pattern, mask in _MASKS:
        message = pattern.sub(mask, message)
    return name, message


def _where(paths: list[str]) -> str:
    """``a: 40, b: 13``: how many of the paths sit under each folder just below their common folder."""
    try:
        common = os.path.commonpath(paths)
    except ValueError:  # absolute and relative mixed
        return ""
    below = Counter(PurePath(os.path.relpath(p, common)).parts[0] if p != common else "." for p in paths)
    top = ", ".join(f"{os.path.join(common, folder)}: {n}" for folder, n in sorted(below.items())[:4])
    return top + (", ..." if len(below) > 4 else "")


def summarize_warnings(lines: list[str]) -> list[str]:
    """The warnings, one line per cause, in the order each cause was first seen."""
    by_cause: dict[tuple[str, str], list[str]] = {}
    for line in lines:
        by_cause.setdefault(cause_of(line), []).append(line)
    out = []
    for found in by_cause.values():
        if len(found) == 1:
            out.append(found[0])
            continue
        paths = [split_warning(line)[0] for line in found]
        where = _where(paths) if all(paths) else ""
        out.append(f"{len(found)}× {found[0]} (and {len(found) - 1} more like it"
                   + (f"; {where}" if where else "") + ")")
    return out
