"""Read ``results/<run_id>/`` directories into pandas tables, and compact them to parquet.

Tables (every row keyed by ``run_id``; rows sorted so the same results give the same bytes):

* ``runs``: one row per run directory: ``status`` (pending | running | completed | failed), the summary's
  scalars, memory flattened to ``peak_bytes``, ``avg_bytes``, ``peak_<category>_bytes``,
  ``avg_<category>_bytes``, ``peak_phase_<phase>_bytes``, ``memory_source``. Absent keys are NaN/None.
* ``metrics``: one row per logged step, one column per key of ``metrics.jsonl``.
* ``ranks``: ``run_id, layer, step, rank`` from ``method_summary`` ``rank/history`` (or ``rank_history``).
* ``rank_hist``: ``run_id, rank, count`` from ``rank/histogram_all_refreshes`` (or ``rank_histogram``).
* ``activations``: ``run_id, component, saved_bytes, rel_err, grad_cos`` from ``activation_summary`` (when a
  summary has none, the mean of the run's ``act/<component>/rel_err`` metrics, with ``saved_bytes`` unknown).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

CATEGORIES = ("params", "grads", "optimizer", "activations", "temp", "other")
SCALARS = ("method", "model", "mode", "device", "seed", "params_total", "params_trainable", "steps", "tokens",
           "tokens_per_s", "step_time_s", "train_loss", "val_loss", "cpu_rss_peak_bytes", "host_device_bytes",
           "checkpoint_bytes", "git_sha")
TABLES = ("runs", "metrics", "ranks", "rank_hist", "activations")


@dataclass
class Results:
    runs: pd.DataFrame
    metrics: pd.DataFrame
    ranks: pd.DataFrame
    rank_hist: pd.DataFrame
    activations: pd.DataFrame

    def completed(self) -> pd.DataFrame:
        return self.runs[self.runs["status"] == "completed"]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _status(run_dir: Path) -> str:
    try:
        return (run_dir / "status").read_text().strip() or "pending"
    except FileNotFoundError:
        return "pending"


def run_row(run_dir: Path) -> dict:
    summary = _read_json(run_dir / "summary.json")
    config = {}
    if not summary and (run_dir / "config.yaml").exists():  # failed/running: identify it from its config
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    row: dict = {"run_id": summary.get("run_id", run_dir.name), "status": _status(run_dir)}
    for key in SCALARS:
        row[key] = summary.get(key)
    if config:
        row["method"] = (config.get("method") or {}).get("name")
        row["model"] = (config.get("model") or {}).get("name")
        row["mode"], row["seed"] = config.get("mode"), config.get("seed")
    memory = summary.get("memory") or {}
    row["peak_bytes"], row["avg_bytes"] = memory.get("peak_bytes"), memory.get("avg_bytes")
    row["memory_source"] = memory.get("source")
    for kind in ("peak", "avg"):
        by_category = memory.get(f"{kind}_by_category_bytes") or {}
        for category in CATEGORIES:
            row[f"{kind}_{category}_bytes"] = by_category.get(category)
    for phase, value in sorted((memory.get("peak_by_phase_bytes") or {}).items()):
        row[f"peak_phase_{phase}_bytes"] = value
    if (run_dir / "error.txt").exists():
        lines = [line for line in (run_dir / "error.txt").read_text().splitlines() if line.strip()]
        row["error"] = lines[-1] if lines else ""
    return row


def _metrics_rows(run_dir: Path, run_id: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [{"run_id": run_id, **json.loads(line)} for line in path.read_text().splitlines() if line.strip()]


def _activations_from_metrics(run_id: str, metrics: list[dict]) -> list[dict]:
    """Fallback when summary.json has no activation_summary: mean ``act/<component>/rel_err`` over the steps."""
    values: dict[str, list[float]] = {}
    for line in metrics:
        for key, value in line.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "act" and parts[2] == "rel_err" and value is not None:
                values.setdefault(parts[1], []).append(float(value))
    return [{"run_id": run_id, "component": c, "saved_bytes": None, "rel_err": sum(v) / len(v), "grad_cos": None}
            for c, v in sorted(values.items())]


def _first(mapping: dict, *keys: str) -> dict:
    for key in keys:
        if mapping.get(key):
            return mapping[key]
    return {}


def _activation_rows(run_id: str, activation_summary: dict) -> list[dict]:
    """Either ``{component: {saved_bytes, rel_err}}`` or the runner's ``{policy, probe: {act/<c>/rel_err,
    act/<c>/grad_cos, ...}, saved_bytes: {component: bytes}}``."""
    if "probe" in activation_summary or "policy" in activation_summary:
        probe = activation_summary.get("probe") or {}
        saved = activation_summary.get("saved_bytes") or {}
        components = set(saved) | {k.split("/")[1] for k in probe if k.startswith("act/") and k.count("/") == 2}
        components.discard("total")
        return [{"run_id": run_id, "component": c, "saved_bytes": saved.get(c, probe.get(f"act/{c}/saved(bytes)")),
                 "rel_err": probe.get(f"act/{c}/rel_err"), "grad_cos": probe.get(f"act/{c}/grad_cos")}
                for c in sorted(components)]
    return [{"run_id": run_id, "component": c, "saved_bytes": (e or {}).get("saved_bytes"),
             "rel_err": (e or {}).get("rel_err"), "grad_cos": (e or {}).get("grad_cos")}
            for c, e in sorted(activation_summary.items())]


def _method_rows(run_id: str, summary: dict) -> tuple[list, list, list]:
    """Rank history/histogram under ``rank_history``/``rank_histogram`` or the runner's ``rank/history`` and
    ``rank/histogram_all_refreshes`` (else ``rank/histogram_current``); activation rows (``_activation_rows``)."""
    method_summary = summary.get("method_summary") or {}
    history = _first(method_summary, "rank_history", "rank/history")
    ranks = [{"run_id": run_id, "layer": layer, "step": int(step), "rank": float(rank)}
             for layer, records in sorted(history.items()) for step, rank in records]
    histogram = _first(method_summary, "rank_histogram", "rank/histogram_all_refreshes", "rank/histogram_current")
    hist = [{"run_id": run_id, "rank": int(rank), "count": int(count)}
            for rank, count in sorted(histogram.items(), key=lambda kv: int(kv[0]))]
    return ranks, hist, _activation_rows(run_id, summary.get("activation_summary") or {})


def _frame(rows: list[dict], columns: tuple[str, ...], sort: list[str]) -> pd.DataFrame:
    frame = pd.DataFrame(rows) if rows else pd.DataFrame(columns=list(columns))
    return frame.sort_values(sort, kind="stable").reset_index(drop=True) if len(frame) else frame


def load_results(results_dir: str | Path) -> Results:
    """Every run directory under ``results_dir`` (a directory holding a ``status`` or ``summary.json``)."""
    root = Path(results_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"results directory not found: {root}")
    runs, metrics, ranks, hist, acts = [], [], [], [], []
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not ((run_dir / "status").exists() or (run_dir / "summary.json").exists()):
            continue
        row = run_row(run_dir)
        runs.append(row)
        run_metrics = _metrics_rows(run_dir, row["run_id"])
        metrics.extend(run_metrics)
        summary = _read_json(run_dir / "summary.json")
        r, h, a = _method_rows(row["run_id"], summary)
        if summary and not summary.get("activation_summary"):
            a = _activations_from_metrics(row["run_id"], run_metrics)
        ranks += r
        hist += h
        acts += a
    metric_frame = _frame(metrics, ("run_id", "step"), ["run_id", "step"])
    if len(metric_frame):  # fixed column order: run_id, step, then metric keys sorted
        metric_frame = metric_frame[["run_id", "step"] + sorted(c for c in metric_frame if c not in ("run_id", "step"))]
    return Results(
        runs=_frame(runs, ("run_id", "status", *SCALARS), ["run_id"]),
        metrics=metric_frame,
        ranks=_frame(ranks, ("run_id", "layer", "step", "rank"), ["run_id", "layer", "step"]),
        rank_hist=_frame(hist, ("run_id", "rank", "count"), ["run_id", "rank"]),
        activations=_frame(acts, ("run_id", "component", "saved_bytes", "rel_err", "grad_cos"),
                           ["run_id", "component"]),
    )


def write_parquet(results: Results, out_dir: str | Path) -> list[Path]:
    """``<out_dir>/<table>.parquet`` for every table; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in TABLES:
        frame = getattr(results, name)
        path = out / f"{name}.parquet"
        frame.to_parquet(path, index=False)
        paths.append(path)
    return paths


def read_parquet(in_dir: str | Path) -> Results:
    return Results(**{name: pd.read_parquet(Path(in_dir) / f"{name}.parquet") for name in TABLES})
