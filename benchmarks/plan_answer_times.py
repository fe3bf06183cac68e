"""How long the planner takes to answer, as a new user's fresh clone runs it: every named model × budget × sequence
length, each answer in its own process and a new, empty results folder (no user cache: only the committed cost table
in ``results/plan/costs/``), one at a time.

    python -m benchmarks.plan_answer_times [--models qwen2.5-0.5b,7b] [--seq 2048,8192,32768]
                                           [--budgets 16,24,48,80] [--out results/plan/answer_times/NAME.json]

Each answer runs ``python -m experiments.plan model=<m> train.seq_len=<s> budget_gib=<g> results_dir=<new folder>``
and is read back from the plan record it writes (``<folder>/plans/*.json``: micro-batch, predicted GiB, the
planner's own ``elapsed_s`` counted from its process start, samples traced / from the table); a refused answer is
its one ``error:`` line. Beside them: the wall time of the process and the 1-minute load average when it started.
A length past a model's positions (Gemma 2: 8,192; the Llama-2 shapes: 4,096) is one such refusal. The results
file is written after every answer (atomically), so an interrupted run keeps what it measured; the README's
target is ≤ 60 s an answer (docs/planner.md, "Measurements").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.model_cards import card_names
from experiments.model_config import MODEL_PHASES
from experiments.results import atomic_write_text

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "hmt-plan-answer-times/1"
LLAMA2_SHAPES = ("1b", "7b", "13b")  # the MODEL_PHASES shapes with committed cost tables (default --models)
TARGET_S = 60  # a fresh clone's answer, wall (docs/planner.md)


def answer(model: str, seq_len: int, budget_gib: float, scratch: Path) -> dict:
    """One fresh answer: the plan record's figures, or the planner's ``error:`` line."""
    results_dir = scratch / f"{model}-s{seq_len}-{budget_gib:g}gib"
    cmd = [sys.executable, "-m", "experiments.plan", f"model={model}", f"train.seq_len={seq_len}",
           f"budget_gib={budget_gib:g}", f"results_dir={results_dir}"]
    load_1min = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    row = {"model": model, "seq_len": seq_len, "budget_gib": budget_gib, "wall_s": round(wall_s, 2),
           "load_1min": round(load_1min, 2), "returncode": proc.returncode}
    records = sorted((results_dir / "plans").glob("*.json")) if results_dir.exists() else []
    if proc.returncode != 0 or not records:
        errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
        return {**row, "error": errors[-1] if errors else (proc.stderr.strip().splitlines() or ["(no output)"])[-1]}
    rec = json.loads(records[-1].read_text())
    choice = rec["choice"]
    return {**row, "micro_batch": choice["batch_size"], "tokens_per_micro_batch": choice["tokens_per_micro_batch"],
            "predicted_peak_gib": round(max(rec["predicted_gib"].values()), 3), "verified": rec["verified"],
            "elapsed_s": round(rec["elapsed_s"], 2), "traced": rec["traces"], "from_table": rec["cached_samples"]}


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"


def render(rows: list[dict]) -> str:
    lines = ["| model | seq | budget | answer (sequences × tokens, peak) | planned in | traced | wall | load |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        what = r.get("error") or (f"{r['micro_batch']} × {r['tokens_per_micro_batch'] // r['micro_batch']} "
                                  f"({r['predicted_peak_gib']:.2f} GiB)")
        planned = f"{r['elapsed_s']:.1f} s" if "elapsed_s" in r else "—"
        lines.append(f"| {r['model']} | {r['seq_len']} | {r['budget_gib']:g} GiB | {what} | {planned} | "
                     f"{r.get('traced', 0)} | {r['wall_s']:.1f} s | {r['load_1min']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join((*card_names(), *LLAMA2_SHAPES)))
    ap.add_argument("--seq", default="2048,8192,32768")
    ap.add_argument("--budgets", default="16,24,48,80")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: results/plan/answer_times/"
                                                                "<commit>.json)")
    args = ap.parse_args(argv)
    try:
        seqs = [int(s) for s in args.seq.split(",")]
        budgets = [float(b) for b in args.budgets.split(",")]
    except ValueError as e:
        print(f"error: --seq / --budgets: {e}", file=sys.stderr)
        return 2
    known = set(card_names()) | set(MODEL_PHASES)
    models = args.models.split(",")
    if unknown := [m for m in models if m not in known]:
        print(f"error: --models: unknown {', '.join(unknown)} (known: {', '.join(sorted(known))})", file=sys.stderr)
        return 2
    label = commit()
    out = args.out or REPO / "results" / "plan" / "answer_times" / f"{label}.json"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="plan-answers-") as scratch:
        for seq in seqs:
            for model in models:
                for budget in budgets:
                    rows.append(answer(model, seq, budget, Path(scratch)))
                    print(render(rows[-1:]).splitlines()[-1], flush=True)
                    atomic_write_text(out, json.dumps({"schema": SCHEMA, "commit": label, "cpus": os.cpu_count(),
                                                       "rows": rows}, indent=1) + "\n")
    walls = [r["wall_s"] for r in rows]
    slow = [r for r in rows if r["wall_s"] > TARGET_S]
    print(f"{len(rows)} answers, wall {min(walls):.1f}–{max(walls):.1f} s, {len(slow)} over the {TARGET_S} s target; "
          f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
