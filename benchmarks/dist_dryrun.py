"""Per-rank memory at world sizes 1, 8, 64 from the fake-process-group dry run (``mode=dryrun dist=...
dist.world_size=W``), one subprocess per case; each case's summary goes to ``results/dist_dryrun/<case>.json`` and
the table is printed from those files (``--table`` prints it without running anything).

    python benchmarks/dist_dryrun.py --models 7b 13b --worlds 1 8 64
    python benchmarks/dist_dryrun.py --table

Rows: adamw under FSDP2 (params, grads and AdamW state sharded 1/W), hmt under FSDP2 (per-layer updates on row
shards, ``hmt_core.optim.sharded``) with no activation policy and with ``activation=full_ckpt`` (every decoder layer
recomputed from its input; Korthikanti et al. 2022, Sec. 4: only the 2·s·b·h layer inputs kept), hmt and galore
under DDP (replicated: the per-rank figure does not depend on W, so they run at W=8 only unless ``--ddp-worlds``
says otherwise), galore and apollo under FSDP2 (galore-torch's and apollo-torch's optimizers on the DTensor shards,
``experiments.checkpoint.dtensor_state``). Seq 2048, per-rank batch 1 (``train.batch_size=W``, the global batch).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "results" / "dist_dryrun"
GIB = 2**30
SETUPS = {  # name -> (dist, method overrides)
    "adamw-fsdp2": ("fsdp2", ["method=adamw"]),
    "hmt-fsdp2": ("fsdp2", ["method=hmt"]),
    "hmt-fsdp2-ckpt": ("fsdp2", ["method=hmt", "activation=full_ckpt"]),
    "hmt-fsdp2-sketch": ("fsdp2", ["method=hmt", "dist.refresh=sketch"]),
    "hmt-mini-fsdp2-ckpt": ("fsdp2", ["method=hmt", "method.mode=B", "method.rank=1", "method.scaling=tensor",
                                      "method.scale=128", "activation=full_ckpt"]),
    "adamw-fsdp2-ckpt": ("fsdp2", ["method=adamw", "activation=full_ckpt"]),
    "galore-fsdp2": ("fsdp2", ["method=galore"]),
    "galore-fsdp2-ckpt": ("fsdp2", ["method=galore", "activation=full_ckpt"]),
    "apollo-fsdp2": ("fsdp2", ["method=apollo"]),
    "hmt-ddp": ("ddp", ["method=hmt"]),
    "galore-ddp": ("ddp", ["method=galore"]),
}
CATS = ("params", "grads", "optimizer", "activations", "temp")
NOTES = ("galore-fsdp2 / apollo-fsdp2: galore-torch's and apollo-torch's optimizers stepping FSDP2's DTensor shards "
         "after backward (`experiments.checkpoint.dtensor_state`); their defaults (galore rank 128, apollo rank d/4) with "
         "galore-torch's SVD on the all-gathered gradient in the traced step (step 0 refreshes).",
         "hmt-fsdp2-sketch: `dist.refresh=sketch` (no gathered gradient at a refresh); the same peak, which is set at "
         "the start of backward, not in a refresh hook (one refresh's own memory: `benchmarks/refresh_memory.py`).",
         "hmt-mini-fsdp2-ckpt: Mode B rank 1 with tensor scaling (APOLLO-Mini's update) and `activation=full_ckpt`.",
         "*-ckpt: `activation=full_ckpt`; the single-process activation probe is skipped under dist "
         "(`experiments.dist.checks.probe_skipped`).")


def run_case(model: str, setup: str, world: int, seq: int, timeout_s: float) -> dict:
    mode, overrides = SETUPS[setup]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "experiments.run", "mode=dryrun", f"model={model}", f"dist={mode}",
               f"dist.world_size={world}", f"train.batch_size={world}", f"train.seq_len={seq}", *overrides,
               f"results_dir={tmp}", "run_id=case", "wandb.mode=disabled"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - start
        if proc.returncode:
            return {"model": model, "setup": setup, "world_size": world, "error": proc.stderr.strip()[-500:]}
        summary = json.loads((Path(tmp) / "case" / "summary.json").read_text())
    mem = summary["memory"]
    return {"model": model, "setup": setup, "dist": mode, "world_size": world, "seq_len": seq, "rank_batch_size": 1,
            "peak_bytes": mem["peak_bytes"], "peak_by_category_bytes": mem["peak_by_category_bytes"],
            "trace_wall_s": summary["dryrun"]["wall_s"], "subprocess_wall_s": wall, "command": " ".join(cmd[1:-3]),
            "dist_summary": summary["dist"]}


def pivot(rows: list[dict]) -> str:
    """Per-rank peak (GiB) with one row per setup and one column per (model, W): the question "what fits" at a
    glance; '—' where a case did not run or failed."""
    order = {"7b": 0, "13b": 1, "70b": 2}
    cols = sorted({(r["model"], r["world_size"]) for r in rows}, key=lambda c: (order.get(c[0], 9), c[1]))
    peak = {(r["setup"], r["model"], r["world_size"]): r.get("peak_bytes") for r in rows}
    head = "| setup | " + " | ".join(f"{m.upper()} W={w}" for m, w in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for setup in [s for s in SETUPS if any(r["setup"] == s for r in rows)]:
        cells = [peak.get((setup, m, w)) for m, w in cols]
        lines.append(f"| {setup} | " + " | ".join("—" if b is None else f"{b / GIB:.2f}" for b in cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = "| model | setup | W | per-rank peak (GiB) | " + " | ".join(f"{c} (GiB)" for c in CATS) + " | traced (s) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    order = {"7b": 0, "13b": 1, "70b": 2}
    for r in sorted(rows, key=lambda r: (order.get(r["model"], 9), r["setup"], r["world_size"])):
        if "error" in r:
            lines.append(f"| {r['model']} | {r['setup']} | {r['world_size']} | error: {r['error'][-80:]} |")
            continue
        cats = " | ".join(f"{r['peak_by_category_bytes'][c] / GIB:.2f}" for c in CATS)
        lines.append(f"| {r['model']} | {r['setup']} | {r['world_size']} | {r['peak_bytes'] / GIB:.2f} | {cats} | "
                     f"{r['trace_wall_s']:.0f} |")
    return "\n".join(lines + [""] + [f"- {n}" for n in NOTES])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["7b", "13b"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--ddp-worlds", nargs="+", type=int, default=[8])
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--table", action="store_true", help="print the table from results/dist_dryrun/ only")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.table:
        for model in args.models:
            for setup in args.setups:
                for world in args.worlds if SETUPS[setup][0] == "fsdp2" else args.ddp_worlds:
                    row = run_case(model, setup, world, args.seq, args.timeout_s)
                    (OUT / f"{model}-{setup}-w{world}.json").write_text(json.dumps(row, indent=2) + "\n")
                    print(f"{model} {setup} W={world}: "
                          + (f"{row['peak_bytes'] / GIB:.2f} GiB in {row['trace_wall_s']:.0f} s" if "error" not in row
                             else "error: " + row["error"][-200:]), flush=True)
    rows = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))]
    print("Per-rank peak (GiB):\n\n" + pivot(rows) + "\n\nBy category:\n\n" + table(rows))


if __name__ == "__main__":
    main()
