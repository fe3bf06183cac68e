"""Weight streaming's plans against resident ones (docs/memory_savings.md): the planner's answers for the cards the
streaming design targets, each with its predicted peaks (verified by a full-size dry run where marked) and the
modeled micro-batch time (``experiments.planner.streaming.micro_batch_time``: roofline compute, PCIe copies).

    python -m benchmarks.streaming_plans [--out-dir results/streaming_plans] [--cases name,...]

Each case runs ``python -m experiments.plan model=<card> train.seq_len=2048 budget_gib=<g> <keys>`` in one work
folder (``--work-dir``: the cases share its cost cache) and keeps its plan record as ``<out-dir>/<case>.json`` (atomically; a case already there is skipped)
with the command and the wall time. ``python -m analysis.streaming_plans`` renders them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.results import atomic_write_text

REPO = Path(__file__).resolve().parent.parent
STREAM = "weight_offloads=[none,host]"
# case -> (card, budget GiB, planner keys)
CASES = {"llama3.1-8b-12gib": ("llama3.1-8b", 12, [STREAM, "verify=true"]),
         "llama3.1-8b-12gib-mode-a": ("llama3.1-8b", 12, [STREAM, "modes=[A]", "verify=true"]),
         "llama3.1-8b-12gib-mode-a-bf16": ("llama3.1-8b", 12, [STREAM, "modes=[A]", "weight_dtypes=[bf16]",
                                                               "verify=true"]),
         "llama3.1-8b-16gib-resident": ("llama3.1-8b", 16, []),
         "7b-8gib": ("7b", 8, [STREAM, "verify=true"]),
         "7b-8gib-mode-a": ("7b", 8, [STREAM, "modes=[A]", "verify=true"]),
         "7b-16gib-resident": ("7b", 16, []),
         "70b-80gib": ("70b", 80, [STREAM]),
         "70b-80gib-resident": ("70b", 80, [])}


def run_case(name: str, out_dir: Path, work: Path) -> None:
    """One case, planned in ``work`` (its ``plan_costs`` cache shared by the cases: a card's costs are traced once)."""
    card, budget, keys = CASES[name]
    plan = name.replace("-", "_").replace(".", "_")
    cmd = [sys.executable, "-m", "experiments.plan", f"model={card}", "train.seq_len=2048", f"budget_gib={budget}",
           f"results_dir={work}", f"name={plan}", *keys]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = round(time.perf_counter() - start, 1)
    record = work / "plans" / f"{plan}.json"
    doc = {"case": name, "card": card, "budget_gib": budget, "keys": keys, "wall_s": wall,
           "returncode": proc.returncode}
    if proc.returncode == 0 and record.exists():
        doc["record"] = json.loads(record.read_text())
    else:
        doc["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    atomic_write_text(out_dir / f"{name}.json", json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{name}: rc {proc.returncode} in {wall} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(REPO / "results" / "streaming_plans"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "hmt-streaming-plans"),
                    help="where the planner writes (its cost cache is reused across cases and reruns)")
    args = ap.parse_args(argv)
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"error: --cases: unknown {unknown[0]} (known: {', '.join(CASES)})", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        if not (out_dir / f"{name}.json").exists():
            run_case(name, out_dir, Path(args.work_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
