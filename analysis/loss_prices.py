"""The loss price of each lossy choice the memory planner can make: the tuned campaign's validation-loss difference
between the row that makes the choice and the row it changes (tiny Llama, 300 steps, each row at its tuned rate,
seeds 1-3 paired by seed; docs/campaign/findings.md), written as the file the planner reads
(``results/loss_prices/loss_prices.json``, ``experiments.planner.prices``).

Rows are found by configuration (``analysis.rows``), as the campaign tables find them: the main comparison's HMT
rows (``analysis.ablation.HMT``) and AdamW rows among ``results/campaign``, the embedding and LM-head savings among
``results/campaign-embedding`` (``analysis.embedding_cost.ROWS``). Each price keeps its mean difference, the paired
t-test's p (``analysis.stats``), the seeds, and the two rows' names, so a plan can say where its number came from.

    python -m analysis.loss_prices results/campaign results/campaign-embedding --out results/loss_prices
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from analysis import stats
from analysis.ablation import HMT
from analysis.embedding_cost import MINIMAL, ROWS as EMBEDDING_ROWS
from analysis.rows import Source, load_source, loss_by_seed, row_runs
from experiments.errors import OneLineErrorParser, one_line_errors
from experiments.results import atomic_write_text

SCHEMA = "hmt-loss-prices/1"
ADAMW = {"model.name": "tiny", "method.name": "adamw", "method.dense_lr_scale": 1.0}
MODE_B = {**HMT, "method.mode": "B", "method.basis": "random", "method.rank": 1}
_EMBEDDING = {row.label: row for row in EMBEDDING_ROWS}
# price name -> (row label, its keys, source, against label, against keys, against source); "main" is
# results/campaign, "embedding" results/campaign-embedding. The names are the planner's (experiments.planner.prices).
PRICES: dict[str, tuple[str, Mapping[str, Any], str, str, Mapping[str, Any], str]] = {
    "mode_b": ("Mode B rank 1", MODE_B, "main", "HMT default", HMT, "main"),
    "bf16_state": ("BF16 state", {**HMT, "method.state_dtype": "bf16"}, "main", "HMT default", HMT, "main"),
    "int8_weights": ("INT8 weights", {**HMT, "method.weight_dtype": "int8"}, "main", "HMT default", HMT, "main"),
    "act:int8": ("INT8 activations", {**HMT, "activation.attn_out": "int8"}, "main", "HMT default", HMT, "main"),
    "dense_8bit": ("AdamW 8-bit", {**ADAMW, "method.eight_bit": True}, "main", "AdamW",
                   {**ADAMW, "method.eight_bit": False}, "main"),
    **{name: (label, _EMBEDDING[label].keys, "embedding", _EMBEDDING[label].against,
              _EMBEDDING[_EMBEDDING[label].against].keys, "main")
       for name, label in (("int8_tables", "+ INT8 embedding and head"), ("lazy_exact", "+ embedding rows, lazy exact"),
                           ("sparse_adam", "+ embedding rows, SparseAdam"), ("in_loss", "+ head in the loss"),
                           ("layer_inputs:int8", "+ INT8 layer inputs"),
                           ("layer_inputs:int4_outlier", "+ INT4 outlier layer inputs"))},
}


def price(name: str, sources: Mapping[str, Source]) -> dict:
    """One price: the mean paired difference (nats/token) of the row over the row it changes, and its evidence."""
    label, keys, source, against, against_keys, against_source = PRICES[name]
    mine = loss_by_seed(row_runs(label, keys, sources[source]))
    theirs = loss_by_seed(row_runs(against, against_keys, sources[against_source]))
    pairs = stats.paired(mine, theirs)
    if not pairs:
        return {"row": label, "against": against, "seeds": 0, "delta_nats": None, "p": None}
    delta = sum(a - b for a, b in pairs) / len(pairs)
    p = stats.paired_p(mine, theirs)
    return {"row": label, "against": against, "seeds": len(pairs), "delta_nats": round(delta, 6),
            "p": None if math.isnan(p) else round(p, 6), "differs": bool(p < stats.ALPHA) if not math.isnan(p) else None}


def loss_prices(main: Path, embedding: Path) -> dict:
    sources = {"main": load_source(main), "embedding": load_source(embedding)}
    return {"schema": SCHEMA, "model": "tiny", "steps": 300, "test": stats.TEST_NAME,
            "sources": {"main": main.as_posix(), "embedding": embedding.as_posix()},
            "prices": {name: price(name, sources) for name in PRICES}}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m analysis.loss_prices", description=__doc__.split("\n\n")[0])
    parser.add_argument("campaign", type=Path, help="the campaign's results (results/campaign)")
    parser.add_argument("embedding", type=Path, help="the embedding rows' results (results/campaign-embedding)")
    parser.add_argument("--out", type=Path, required=True, help="folder for loss_prices.json (results/loss_prices)")
    args = parser.parse_args(argv)
    doc = one_line_errors(lambda: loss_prices(args.campaign, args.embedding), OSError)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "loss_prices.json"
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
