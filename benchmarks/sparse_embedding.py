"""Row-sparse embedding updates (``method.embedding_update``): the committed numbers of docs/embedding_memory.md from
run folders written by ``python -m experiments.run``.

    python -m benchmarks.sparse_embedding --dryrun-dir DIR --loss-dir DIR [--out results/embedding_memory]

``--dryrun-dir``: dry runs named ``<model>-<row>`` (rows ``base``, ``dense-bf16``, ``lazy``, ``sparse``; the commands
are in docs/embedding_memory.md); each row's peak and its categories at the peak. ``--loss-dir``: short training
runs named ``dense``, ``lazy_exact``, ``sparse_adam`` (same seed, data and settings); final train and validation loss
and each one's difference to ``dense``. Writes ``row_sparse_dryrun.json`` and ``row_sparse_loss.json`` under ``--out`` and prints both
Markdown tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 2**30
CATEGORIES = ("params", "grads", "optimizer", "activations", "temp")
ROWS = ("base", "dense-bf16", "lazy", "sparse")
VARIANTS = ("dense", "lazy_exact", "sparse_adam")


def dryrun_rows(folder: Path) -> list[dict]:
    out = []
    for summary in sorted(folder.glob("*/summary.json")):
        model, _, row = summary.parent.name.rpartition("-")
        if row == "bf16":  # "<model>-dense-bf16"
            model, row = model.rsplit("-", 1)[0], "dense-bf16"
        if row not in ROWS:
            continue
        memory = json.loads(summary.read_text())["memory"]
        out.append({"model": model, "row": row, "peak_bytes": memory["peak_bytes"],
                    **{f"{c}_bytes": memory["peak_by_category_bytes"][c] for c in CATEGORIES}})
    return sorted(out, key=lambda r: (r["model"], ROWS.index(r["row"])))


def loss_rows(folder: Path) -> list[dict]:
    out = []
    for variant in VARIANTS:
        path = folder / variant / "summary.json"
        if path.exists():
            s = json.loads(path.read_text())
            out.append({"embedding_update": variant, "train_loss": s["train_loss"], "val_loss": s["val_loss"],
                        "steps": s["steps"]})
    dense = next((r for r in out if r["embedding_update"] == "dense"), None)
    for r in out:
        if dense is not None:
            r["val_loss_minus_dense"] = r["val_loss"] - dense["val_loss"]
            r["train_loss_minus_dense"] = r["train_loss"] - dense["train_loss"]
    return out


def dryrun_table(rows: list[dict]) -> str:
    head = "| model | row | peak (GiB) | " + " | ".join(f"{c} (GiB)" for c in CATEGORIES) + " |"
    lines = [head, "|" + "---|" * 2 + "---:|" * (1 + len(CATEGORIES))]
    for r in rows:
        cells = [f"{r['peak_bytes'] / GIB:.2f}", *(f"{r[f'{c}_bytes'] / GIB:.2f}" for c in CATEGORIES)]
        lines.append(f"| {r['model']} | {r['row']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def loss_table(rows: list[dict]) -> str:
    lines = ["| method.embedding_update | steps | train loss | val loss | val loss − dense |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['embedding_update']} | {r['steps']} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | "
                     f"{r.get('val_loss_minus_dense', 0.0):+.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dryrun-dir", type=Path)
    parser.add_argument("--loss-dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("results/embedding_memory"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dryrun_dir is not None:
        rows = dryrun_rows(args.dryrun_dir)
        (args.out / "row_sparse_dryrun.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(dryrun_table(rows))
    if args.loss_dir is not None:
        rows = loss_rows(args.loss_dir)
        (args.out / "row_sparse_loss.json").write_text(json.dumps(rows, indent=1) + "\n")
        print(loss_table(rows))


if __name__ == "__main__":
    main()
