"""The validation's outputs: ``gpu_validate.json`` (structured, one record per check), ``gpu_validate.md`` (the same
as tables) and the side-by-side method table printed at the end.

The files are named ``gpu_validate.*``, not ``summary.json``: ``analysis.rundirs`` takes a folder holding a
``summary.json`` for a run directory, so the session folder stays out of ``analysis.report``'s run tables while the
runs under its ``runs/`` (ordinary run directories) are read like any other. Both files are written atomically
(``experiments.results.atomic_write_text``) after every check, with ``"complete": false`` until the end.

``gpu_validate.json`` (schema ``hmt-gpu-validate/1``)::

    {schema, complete, exit_code, date, started_at, wall_s, git_sha, session_dir,
     device: {name, slug, peak_bf16_tflops, peak_note, ...backend.device_info()},
     options: {methods, models, quick, seq_len, batch_size, steps, budget_s, runner, results_dir},
     counts: {verdict: n},
     method_table: [{method, model, tracker(GiB), allocated(GiB), reserved(GiB), nvml(GiB), dryrun(GiB),
                     tracker/allocated, dryrun/allocated, tokens/s, mfu, step_time/adamw, verdict}],
     checks: [{name, kind, method, model, verdict, measured{key(unit): value}, target{...}|null, note, wall_s,
               run_dir}]}
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu_validate import checks as C
from experiments.results import atomic_write_text, dumps

SCHEMA = "hmt-gpu-validate/1"
JSON_NAME, MARKDOWN_NAME = "gpu_validate.json", "gpu_validate.md"
TABLE_COLUMNS = (  # (key in method_table rows, printed header)
    ("method", "method"), ("model", "model"), ("tracker(GiB)", "tracker GiB"), ("allocated(GiB)", "allocated GiB"),
    ("reserved(GiB)", "reserved GiB"), ("nvml(GiB)", "NVML GiB"), ("dryrun(GiB)", "dry-run GiB"),
    ("tracker/allocated", "tracker/alloc"), ("dryrun/allocated", "dry/alloc"), ("tokens/s", "tokens/s"),
    ("mfu", "MFU"), ("step_time/adamw", "step ratio vs adamw"), ("verdict", "verdict"))


def method_table(records: list[C.CheckRecord]) -> list[dict]:
    """One row per (method, model) that has a ``run/...`` record, in the order the runs were made."""
    by_name = {r.name: r for r in records}
    rows = []
    for run in (r for r in records if r.kind == "run"):
        key = f"{run.method}/{run.model}"
        tracker, dry = by_name.get(f"tracker_vs_allocated/{key}"), by_name.get(f"dryrun_vs_allocated/{key}")
        m = run.measured
        rows.append({
            "method": run.method, "model": run.model,
            "tracker(GiB)": C.gib(m.get("tracker_peak(bytes)")),
            "allocated(GiB)": C.gib(m.get("cuda_max_allocated(bytes)")),
            "reserved(GiB)": C.gib(m.get("cuda_max_reserved(bytes)")), "nvml(GiB)": C.gib(m.get("nvml_used(bytes)")),
            "dryrun(GiB)": C.gib(dry.measured.get("dryrun_peak(bytes)")) if dry else None,
            "tracker/allocated": tracker.measured.get("ratio") if tracker else None,
            "dryrun/allocated": dry.measured.get("ratio") if dry else None,
            "tokens/s": m.get("tokens_per_s(tok/s)"), "mfu": m.get("mfu"), "step_time/adamw": m.get("step_time/adamw"),
            "verdict": C.worst([r.verdict for r in (run, tracker, dry) if r is not None]),
        })
    return rows


def _cell(key: str, value) -> str:
    if value is None:
        return "—"
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if key == "tokens/s":
        return f"{value:,.0f}"
    if key.endswith("(GiB)") or "/" in key:
        return f"{value:.3f}"
    return str(value)


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table whose columns are padded, so it reads as a table on a console too."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def method_table_text(rows: list[dict]) -> str:
    return text_table([h for _, h in TABLE_COLUMNS], [[_cell(k, row[k]) for k, _ in TABLE_COLUMNS] for row in rows])


def _measured_text(measured: dict) -> str:
    parts = []
    for key, value in measured.items():
        if value is None or isinstance(value, (list, dict)):
            continue
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return ", ".join(parts)


def checks_table_text(records: list[C.CheckRecord]) -> str:
    rows = [[r.name, r.verdict, _measured_text(r.measured),
             ", ".join(f"{k} {v}" for k, v in (r.target or {}).items()), (r.note or "").replace("|", "/")]
            for r in records if r.kind not in ("run", "tracker_vs_allocated", "dryrun_vs_allocated")]
    return text_table(["check", "verdict", "measured", "target", "note"], rows)


def exit_code(records: list[C.CheckRecord]) -> int:
    """1 when something crashed (an ERROR record), else 0 — a MISS is a finding, not a failure of the command."""
    return 1 if any(r.verdict == C.ERROR for r in records) else 0


def build_document(*, device: dict, options: dict, records: list[C.CheckRecord], day: str, started_at: str,
                   wall_s: float, git_sha: str | None, session_dir: Path, complete: bool) -> dict:
    counts = {v: sum(r.verdict == v for r in records) for v in C.VERDICTS}
    return {"schema": SCHEMA, "complete": complete, "exit_code": exit_code(records), "date": day,
            "started_at": started_at,
            "wall_s": wall_s, "git_sha": git_sha, "session_dir": str(session_dir), "device": device,
            "options": options, "counts": counts, "method_table": method_table(records),
            "checks": [r.to_dict() for r in records]}


def markdown(document: dict, records: list[C.CheckRecord]) -> str:
    d, o = document["device"], document["options"]
    state = "complete" if document["complete"] else "INCOMPLETE (still running, or stopped early)"
    counts = ", ".join(f"{v} {n}" for v, n in document["counts"].items() if n)
    lines = [f"# GPU validation: {d.get('name')} ({document['date']})", "",
             f"- state: {state}; {counts}; wall {document['wall_s']:.0f} s of a {o['budget_s']:.0f} s budget",
             f"- device: {d.get('name')}; peak: {d.get('peak_note')}",
             f"- settings: models {', '.join(o['models'])}, seq {o['seq_len']}, batch {o['batch_size']}, "
             f"{o['steps']} steps (3 metered, the rest timed), runner {o['runner']}"
             + (", --quick" if o["quick"] else ""),
             f"- git {document['git_sha']}; run directories under `runs/`, console logs under `logs/`",
             f"- targets: tracker/alloc 1 ± {C.TRACKER_TOLERANCE:g}, dry/alloc 1 ± {C.DRYRUN_TOLERANCE:g}, "
             f"activation=hmt step time ≤ {C.ACTIVATION_TIME_TARGET:g}× full_ckpt; MFU = 6·N·tokens/s / peak",
             "", "## Methods", "", method_table_text(document["method_table"]), "",
             "## Other checks", "", checks_table_text(records), ""]
    problems = [r for r in records if r.verdict in (C.ERROR, C.MISS, C.SKIPPED) and r.kind in
                ("run", "tracker_vs_allocated", "dryrun_vs_allocated")]
    if problems:
        lines += ["## Method checks that missed, crashed or were skipped", ""]
        lines += [f"- {r.verdict} {r.name}: {r.note or _measured_text(r.measured)}" for r in problems] + [""]
    return "\n".join(lines)


def write_outputs(session_dir: Path, document: dict, records: list[C.CheckRecord]) -> tuple[Path, Path]:
    """Write ``gpu_validate.json`` and ``gpu_validate.md`` atomically (NaN written as null)."""
    json_path, md_path = session_dir / JSON_NAME, session_dir / MARKDOWN_NAME
    atomic_write_text(json_path, json.dumps(json.loads(dumps(document)), indent=2, sort_keys=True) + "\n")
    atomic_write_text(md_path, markdown(document, records))
    return json_path, md_path
