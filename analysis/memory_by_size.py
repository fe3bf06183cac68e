"""``tables/memory_by_size``: the traced memory of each method and setting across model sizes, from committed dry
runs (``python -m analysis.report ... --memory-results DIR``, repeatable).

Rows are a method and its setting less the model (``analysis.settings.setting_of`` without the ``model.*`` keys,
labelled by ``compact_labels`` among the method's settings); columns are the model sizes present (125m, 350m, 1b,
3b, 7b, 13b, ... in size order). A cell is the traced peak of the completed ``mode=dryrun`` runs of that row and
size (GiB, ``summary.memory.peak_bytes``; the mean when several runs match) and, in parentheses, the optimizer's
whole state (GiB, ``method_summary['optim/state_bytes']``) when the run reports it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd

from analysis.rundirs import find_run_dirs, read_run
from analysis.settings import compact_labels, setting_id, setting_of
from analysis.tables import DASH, GIB, Table, method_sort_key, model_sort_key, variant_sort_key
from experiments.errors import UserError


def dryrun_rows(dirs: list[Path], warn: Callable[[str], None]) -> pd.DataFrame:
    """One row per completed dry run under ``dirs``: method, model, label, peak_bytes, state_bytes.
    ``UserError`` naming a folder that is missing or holds no completed dry run."""
    rows, settings = [], {}
    for root in dirs:
        if not root.is_dir():
            raise UserError(f"--memory-results {root}: {'no such folder' if not root.exists() else 'not a folder'}")
        found = 0
        for run_dir in find_run_dirs(root):
            run = read_run(run_dir, warn)
            if run is None or run.status != "completed" or run.summary.get("mode") != "dryrun":
                continue
            memory = run.summary.get("memory") or {}
            method_summary = run.summary.get("method_summary") or {}
            key = f"{root}/{run_dir.relative_to(root)}"
            settings[key] = {k: v for k, v in setting_of(run.config).items() if not k.startswith("model.")}
            rows.append({"key": key, "method": str(run.summary.get("method")),
                         "model": str(run.summary.get("model")), "peak_bytes": memory.get("peak_bytes"),
                         "state_bytes": method_summary.get("optim/state_bytes")})
            found += 1
        if not found:
            raise UserError(f"--memory-results {root}: no completed dry run (mode=dryrun with summary.json) in it")
    labels = compact_labels(settings, {r["key"]: r["method"] for r in rows})
    frame = pd.DataFrame(rows)
    frame["label"] = frame["key"].map(labels)
    frame["setting"] = frame["key"].map(lambda k: setting_id(settings[k]))
    return frame


def _gib(values: pd.Series) -> float | None:
    values = pd.to_numeric(values, errors="coerce").dropna()
    return float(values.mean()) / GIB if len(values) else None


def memory_by_size_table(frame: pd.DataFrame) -> Table:
    sizes = sorted(frame["model"].unique(), key=model_sort_key)
    rows = []
    keyed = sorted(frame.groupby(["method", "setting"], sort=False),
                   key=lambda kg: (method_sort_key(kg[0][0]), variant_sort_key(kg[1]["label"].iloc[0])))
    with_label = bool((frame["label"] != "").any())
    for (method, _), g in keyed:
        cells = []
        for size in sizes:
            at = g[g["model"] == size]
            peak, state = _gib(at["peak_bytes"]), _gib(at["state_bytes"])
            cells.append(DASH if peak is None else f"{peak:.2f}" + ("" if state is None else f" ({state:.2f})"))
        rows.append([method] + ([g["label"].iloc[0]] if with_label else []) + cells)
    lead = ["Method"] + (["Setting"] if with_label else [])
    return Table("memory_by_size", "Traced peak memory by model size, GiB (optimizer state, GiB), from dry runs",
                 lead + [str(s) for s in sizes], rows, ["l"] * len(lead) + ["r"] * len(sizes))
