"""Read the run directories under a results tree into pandas tables, and compact them to parquet.

Run directories are found at any depth (``analysis.rundirs``: ``results/<run_id>/``,
``results/reference/<run_id>/``, ...); a damaged run is skipped with a warning (``Results.warnings``) and bad
input — no results folder, no usable run in it — raises ``UserError`` naming the folder.

Folders a committed tree holds by design are read without a warning, each kind counted in one line of
``Results.notes``: dry runs with summary.json alone (``analysis.rundirs``); copies of a run kept beside a second
campaign (same run_id, identical summary.json: read once); and different runs under one run_id (a run id names the
configuration, so a setting rerun in a second campaign or GPU lease repeats it; the planner names every plan's
verification run ``verify``): the later ones by path are read under their folder's path relative to the results
folder.

Tables (every row keyed by ``run_id``; rows sorted so the same results give the same bytes):

* ``runs``: one row per run directory: ``status`` (pending | running | completed | failed | diverged), the summary's
  scalars, memory flattened to ``peak_bytes``, ``avg_bytes``, ``peak_<category>_bytes``,
  ``avg_<category>_bytes``, ``peak_phase_<phase>_bytes``, ``memory_source`` (all of them the training device's),
  ``host_peak_bytes``/``host_avg_bytes`` (storages on other devices, i.e. host copies; absent in results from
  before the meter told them apart); ``optim_state_bytes`` (the device's) and ``optim_state_host_bytes``; ``setting`` (the id of the run's
  configuration less its seed, ``analysis.settings``) and ``variant`` (the label telling apart the settings of
  one method, model and mode; empty when there is only one); ``lr`` (``method.lr``), ``setting_sans_lr`` and
  ``variant_sans_lr`` (the same, ignoring the learning rate: a learning-rate search's groups). Absent keys are
  NaN/None.
* ``metrics``: one row per logged step, one column per key of ``metrics.jsonl``.
* ``ranks``: ``run_id, layer, step, rank`` from ``method_summary`` ``rank/history`` (or ``rank_history``).
* ``rank_hist``: ``run_id, rank, count`` from ``rank/histogram_all_refreshes`` (or ``rank_histogram``).
* ``activations``: ``run_id, component, saved_bytes, rel_err, grad_cos`` from ``activation_summary`` (when a
  summary has none, the mean of the run's ``act/<component>/rel_err`` metrics, with ``saved_bytes`` unknown).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from analysis.rundirs import RunFiles, find_run_dirs, read_run
from analysis.settings import compact_labels, setting_id, setting_of
from analysis.timing import speed_setting
from experiments.errors import UserError

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
    warnings: list[str] = field(default_factory=list)  # one line per damaged file that was skipped or cut
    notes: list[str] = field(default_factory=list)  # one line per kind of expected folder (module docstring)

    def completed(self) -> pd.DataFrame:
        return self.runs[self.runs["status"] == "completed"]


def run_row(run: RunFiles) -> dict:
    summary, config = run.summary, run.config
    row: dict = {"run_id": str(summary.get("run_id") or run.path.name), "status": run.status}
    for key in SCALARS:
        row[key] = summary.get(key)
    if not summary and config:  # failed/running: identify it from its config
        row["method"] = _mapping(config.get("method")).get("name")
        row["model"] = _mapping(config.get("model")).get("name")
        row["mode"], row["seed"] = config.get("mode"), config.get("seed")
    memory = _mapping(summary.get("memory"))
    row["peak_bytes"], row["avg_bytes"] = memory.get("peak_bytes"), memory.get("avg_bytes")
    row["memory_source"] = memory.get("source")
    row["host_peak_bytes"], row["host_avg_bytes"] = memory.get("host_peak_bytes"), memory.get("host_avg_bytes")
    for kind in ("peak", "avg"):
        by_category = _mapping(memory.get(f"{kind}_by_category_bytes"))
        for category in CATEGORIES:
            row[f"{kind}_{category}_bytes"] = by_category.get(category)
    method_summary = _mapping(summary.get("method_summary"))
    row["optim_state_bytes"] = method_summary.get("optim/state_bytes")
    row["optim_state_host_bytes"] = method_summary.get("optim/state_host_bytes")
    row["rank_fixed"] = method_summary.get("rank/fixed")
    source = summary.get("model_source")  # "weights": from_pretrained; "config"/"phase": random init
    finetuned = (source == "weights" if source else
                 bool(_mapping(config.get("model")).get("path")) or str(row["model"] or "").endswith("-ft"))
    row["task"] = "fine-tuning" if finetuned else "pretraining"
    for phase, value in sorted(_mapping(memory.get("peak_by_phase_bytes")).items()):
        row[f"peak_phase_{phase}_bytes"] = value
    if (run.path / "error.txt").exists():
        text = (run.path / "error.txt").read_text(encoding="utf-8", errors="replace")
        lines = [line for line in text.splitlines() if line.strip()]
        row["error"] = lines[-1] if lines else ""
    return row


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


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
            return _mapping(mapping[key])
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
    method_summary = _mapping(summary.get("method_summary"))
    history = _first(method_summary, "rank_history", "rank/history")
    ranks = [{"run_id": run_id, "layer": layer, "step": int(step), "rank": float(rank)}
             for layer, records in sorted(history.items()) for step, rank in records]
    histogram = _first(method_summary, "rank_histogram", "rank/histogram_all_refreshes", "rank/histogram_current")
    hist = [{"run_id": run_id, "rank": int(rank), "count": int(count)}
            for rank, count in sorted(histogram.items(), key=lambda kv: int(kv[0]))]
    return ranks, hist, _activation_rows(run_id, _mapping(summary.get("activation_summary")))


def _frame(rows: list[dict], columns: tuple[str, ...], sort: list[str]) -> pd.DataFrame:
    frame = pd.DataFrame(rows) if rows else pd.DataFrame(columns=list(columns))
    return frame.sort_values(sort, kind="stable").reset_index(drop=True) if len(frame) else frame


def _add_settings(runs: list[dict], configs: dict[str, dict]) -> None:
    """``setting`` and ``variant`` of every run; variants (``compact_labels``) are told apart among the completed
    runs of one method, model and mode (the runs a table row may average)."""
    settings = {row["run_id"]: setting_of(configs[row["run_id"]]) for row in runs}
    completed = {row["run_id"]: (str(row["method"]), str(row["model"]), str(row["mode"]))
                 for row in runs if row["status"] == "completed"}
    labels = compact_labels({r: settings[r] for r in completed}, completed)
    # A learning-rate search (experiments.sweeps.tuning) groups runs whose settings differ only in the learning rate;
    # failed runs belong to it too (a diverged rate is a result).
    sans_lr = {r: {k: v for k, v in s.items() if k != "method.lr"} for r, s in settings.items()}
    search_labels = compact_labels(sans_lr, {row["run_id"]: (str(row["method"]), str(row["model"]), str(row["mode"]))
                                             for row in runs})
    for row in runs:
        row["setting"], row["variant"] = setting_id(settings[row["run_id"]]), labels.get(row["run_id"], "")
        row["lr"] = settings[row["run_id"]].get("method.lr")
        row["setting_sans_lr"] = setting_id(sans_lr[row["run_id"]])
        row["speed_setting"] = speed_setting(settings[row["run_id"]])
        row["variant_sans_lr"] = search_labels[row["run_id"]]


def load_results(results_dir: str | Path, warn: Callable[[str], None] | None = None) -> Results:
    """Every run directory at any depth under ``results_dir`` (``analysis.rundirs``). Damaged runs are skipped
    with a warning in ``Results.warnings`` (each also passed to ``warn`` as it is found); ``UserError`` when the
    folder is missing or has no usable finished run (one with a readable summary.json)."""
    root = Path(results_dir)
    if not root.exists():
        raise UserError(f"results directory not found: {root}")
    if not root.is_dir():
        raise UserError(f"{root} is not a directory (give the folder that holds the run directories)")
    warnings: list[str] = []

    def note(warning: str) -> None:
        warnings.append(warning)
        if warn is not None:
            warn(warning)

    runs, metrics, ranks, hist, acts = [], [], [], [], []
    configs: dict[str, dict] = {}
    where: dict[str, Path] = {}
    summaries: dict[str, dict] = {}
    expected: dict[str, list[str]] = {"alone": [], "copies": [], "shared": []}
    finished: set[str] = set()  # runs with a summary.json
    skipped = 0
    for run_dir in find_run_dirs(root):
        run = read_run(run_dir, note)
        if run is None:
            skipped += 1
            continue
        try:
            row = run_row(run)
            if row["run_id"] in where:
                first = where[row["run_id"]]
                if run.summary == summaries[row["run_id"]]:
                    expected["copies"].append(f"{run_dir} = {first}")
                    continue
                expected["shared"].append(f"{run_dir} (run_id {row['run_id']} also {first})")
                row["run_id"] = run_dir.relative_to(root).as_posix()
            r, h, a = _method_rows(row["run_id"], run.summary)
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            note(f"{run_dir / 'summary.json'}: unexpected content ({type(e).__name__}: {e}); run skipped")
            skipped += 1
            continue
        if run.alone:
            expected["alone"].append(f"{run_dir} ({', '.join(run.alone)})")
        where[row["run_id"]], summaries[row["run_id"]] = run_dir, run.summary
        if run.summary:
            finished.add(row["run_id"])
        configs[row["run_id"]] = run.config
        runs.append(row)
        run_metrics = [{"run_id": row["run_id"], **line} for line in run.metrics]
        metrics.extend(run_metrics)
        if run.summary and not run.summary.get("activation_summary"):
            a = _activations_from_metrics(row["run_id"], run_metrics)
        ranks += r
        hist += h
        acts += a
    if not any(row["status"] == "completed" and row["run_id"] in finished for row in runs):
        damaged = f" ({skipped} damaged run(s) skipped: see the warnings above)" if skipped else ""
        raise UserError(f"no runs with summary.json under {root}{damaged}")
    _add_settings(runs, configs)
    return dataclasses.replace(_results(runs, metrics, ranks, hist, acts, warnings), notes=expected_notes(expected))


EXPECTED = {
    "alone": "dry run(s) (mode=dryrun) hold summary.json without config.yaml or metrics.jsonl, as the dry-run "
             "tables write them; a dry run has no loss curve, and without its config it is grouped by method and "
             "model",
    "copies": "folder(s) copy a run read elsewhere (same run_id, identical summary.json), kept beside a second "
              "campaign; each such run is read once",
    "shared": "run(s) share a run_id with a different run: a run id names the configuration, so a setting run "
              "again in a second campaign or GPU lease repeats it, and the planner names every plan's verification "
              "run 'verify'; each later one by path is read under its folder's path",
}


def expected_notes(found: dict[str, list[str]]) -> list[str]:
    """One line per kind of expected folder (``EXPECTED``): the count, why, and the first example."""
    return [f"{len(items)} {EXPECTED[kind]} (e.g. {items[0]})" for kind, items in found.items() if items]


def _results(runs: list[dict], metrics: list[dict], ranks: list[dict], hist: list[dict], acts: list[dict],
             warnings: list[str]) -> Results:
    """The loaded rows as frames, in a fixed row and column order."""
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
        warnings=warnings,
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
