"""Whole optimizer state of default HMT vs GaLore (galore-torch at its default rank 128), side by side in one run.

    python benchmarks/state_vs_galore.py [--models tiny small 125m] [--dryrun-models 7b] [--out results/state_vs_galore]

Each model of ``--models`` trains 3 steps (``python -m experiments.run ... train.steps=3``; one basis refresh at step
0, on this CPU) with ``method=galore``, default ``method=hmt``, and HMT with its dense moments in fp32
(``method.dense_state_dtype=fp32``, the default before it followed the weight's dtype); each of
``--dryrun-models`` is traced under ``mode=dryrun`` (seq 2048, batch 1; FakeTensorMode). Bytes are the methods' own
``optim/state_bytes`` (every optimizer-state tensor, storages counted once), read from each run's
``summary.json``. Target: default HMT ≤ GaLore on tiny, small and 125m. Writes ``<out>/state_vs_galore.json`` and
prints the table (markdown).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = {  # label -> overrides
    "galore (rank 128)": ["method=galore"],
    "hmt (defaults)": ["method=hmt"],
    "hmt, dense moments fp32": ["method=hmt", "method.dense_state_dtype=fp32"],
}


def measure(model: str, overrides: list[str], dryrun: bool, results: Path, run_id: str) -> dict:
    mode = ["mode=dryrun", "train.seq_len=2048", "train.batch_size=1"] if dryrun else \
        ["train.steps=3", "train.eval_every=3", "train.eval_batches=1"]
    cmd = [sys.executable, "-m", "experiments.run", f"model={model}", *mode, *overrides, "train.progress=false",
           f"results_dir={results}", f"run_id={run_id}", "force=true"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"error: {' '.join(cmd[3:])} failed: {tail}")
    summary = json.loads((results / run_id / "summary.json").read_text())
    ms = summary["method_summary"]
    return {"state_bytes": int(ms["optim/state_bytes"]), "projected_bytes": ms.get("optim/projected_state_bytes"),
            "peak_bytes": summary["memory"]["peak_bytes"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="*", default=["tiny", "small", "125m"])
    p.add_argument("--dryrun-models", nargs="*", default=["7b"])
    p.add_argument("--out", default=str(REPO / "results" / "state_vs_galore"))
    a = p.parse_args(argv)
    table: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model, dry in [(m, False) for m in a.models] + [(m, True) for m in a.dryrun_models]:
            label = f"{model} (dry run, seq 2048)" if dry else f"{model} (3 steps)"
            table[label] = {row: measure(model, ov, dry, Path(tmp), f"{model}-{i}") for i, (row, ov) in
                            enumerate(ROWS.items())}
            print(f"measured {label}", file=sys.stderr)
    lines = ["| model | " + " | ".join(ROWS) + " | hmt / galore |", "| :--- |" + " ---: |" * (len(ROWS) + 1)]
    for label, rows in table.items():
        cells = [f"{rows[r]['state_bytes'] / 1e6:,.1f} MB" for r in ROWS]
        ratio = rows["hmt (defaults)"]["state_bytes"] / rows["galore (rank 128)"]["state_bytes"]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    print("\n".join(lines))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "state_vs_galore.json").write_text(json.dumps({"rows": list(ROWS), "table": table}, indent=1) + "\n")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    met = all(rows["hmt (defaults)"]["state_bytes"] <= rows["galore (rank 128)"]["state_bytes"]
              for rows in table.values())
    print(f"default hmt <= galore everywhere: {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
