"""Embedding / LM-head memory at 128k vocabularies: one dry-run training step (FakeTensorMode, ``dryrun.device=cuda``)
per (model, setting), itemized into params / grads / optimizer / activations / temp at the step's peak.

    python -m benchmarks.embedding_memory [--models llama3.1-8b,qwen2.5-7b,7b] [--settings min-int8,min-int8-emb]
                                          [--out results/embedding_memory] [--force]

Every setting is the memory-minimal HMT setting of ``benchmarks.dryrun_table`` (``MINIMAL`` + 8-bit dense moments +
INT8 projected weights, its row ``hmt-min-int8``) plus the overrides of one entry of ``SETTINGS``; another option
(row-sparse embedding gradients, say) is one more entry there. Each dry run is its own process writing
``<out>/runs/<model>-<setting>``; a completed one is read back unless ``--force``. Writes ``<out>/<model>.json``
(the rows, the exact overrides, how long each trace took) and prints a Markdown table and the total time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.arch_dryrun import CATEGORIES, gib, run_dryrun
from benchmarks.dryrun_table import MINIMAL, STEP

REPO = Path(__file__).resolve().parent.parent
BASE = [*MINIMAL, "method.dense_8bit=true", "method.weight_dtype=int8"]  # dryrun_table's hmt-min-int8
# name -> (label, overrides on top of BASE)
SETTINGS: dict[str, tuple[str, list[str]]] = {
    "min-int8": ("memory-minimal, INT8 projected weights (BF16 embedding and LM head)", []),
    "min-int8-emb": ("… + INT8 embedding and LM head (`method.embedding_dtype=int8`)",
                     ["method.embedding_dtype=int8"]),
    "min-int8-emb-head": ("… + the LM head updated by block in the fused loss (`method.head_update=in_loss`)",
                          ["method.embedding_dtype=int8", "method.head_update=in_loss"]),
    "min-int8-emb-head-lazy": ("… + the INT8 embedding updated by rows in backward, 8-bit row moments "
                               "(`method.embedding_update=lazy_exact`)",
                               ["method.embedding_dtype=int8", "method.head_update=in_loss",
                                "method.embedding_update=lazy_exact"]),
    "min-int8-emb-head-sparse": ("… the same with `method.embedding_update=sparse_adam`",
                                 ["method.embedding_dtype=int8", "method.head_update=in_loss",
                                  "method.embedding_update=sparse_adam"]),
    "min-int8-emb-head-lazy-ckpt8": ("… + the checkpointed layer inputs stored as blockwise INT8 "
                                     "(`activation.residual=int8`)",
                                     ["method.embedding_dtype=int8", "method.head_update=in_loss",
                                      "method.embedding_update=lazy_exact", "activation.residual=int8"]),
    "min-int8-emb-head-lazy-ckpt4": ("… the same with outlier-aware INT4 (`activation.residual=int4_outlier`)",
                                     ["method.embedding_dtype=int8", "method.head_update=in_loss",
                                      "method.embedding_update=lazy_exact", "activation.residual=int4_outlier"]),
}
MODELS = ("llama3.1-8b", "qwen2.5-7b", "7b")


def run_row(model: str, setting: str, out: Path, *, force: bool, timeout: int = 1800) -> dict:
    label, extra = SETTINGS[setting]
    overrides = [f"model={model}", *STEP, *BASE, *extra]
    row = run_dryrun(overrides, out / "runs", f"{model}-{setting}", timeout=timeout, force=force)
    return {"model": model, "setting": setting, "label": label, "overrides": overrides, **row}


def render(rows: list[dict]) -> str:
    """The itemized table: per model, each setting's peak and categories at it (GiB), and the peak's change from
    the model's previous row (the settings are cumulative: BF16 → INT8 → + in_loss → + row updates)."""
    lines = ["| model | setting | peak (GiB) | Δ peak (GiB) | " + " | ".join(f"{c} (GiB)" for c in CATEGORIES) + " |",
             "|---|---|---:|---:|" + "---:|" * len(CATEGORIES)]
    prev: dict[str, int] = {}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['setting']} | failed: {r['error']} | |" + " |" * len(CATEGORIES))
            continue
        cats = " | ".join(gib(r["by_category"].get(c)) for c in CATEGORIES)
        delta = "" if r["model"] not in prev else f"{(r['peak_bytes'] - prev[r['model']]) / 2**30:+.2f}"
        prev[r["model"]] = r["peak_bytes"]
        lines.append(f"| {r['model']} | {r['setting']} | {gib(r['peak_bytes'])} | {delta} | {cats} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", type=Path, default=REPO / "results" / "embedding_memory")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting {unknown[0]!r}; known: {', '.join(SETTINGS)}")
    start = time.perf_counter()
    rows = []
    for model in args.models.split(","):
        mine = [run_row(model, s, args.out, force=args.force) for s in settings]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{model}.json").write_text(json.dumps({"model": model, "rows": mine}, indent=1) + "\n")
        rows += mine
    print(render(rows))
    print(f"took {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
