"""The embedding/head cost table: what HMT's embedding and LM-head memory savings cost in validation loss, each a
tuned campaign row (``experiments/sweeps/campaign_embedding.yaml``) against the campaign row it changes
(docs/campaign/findings.md).

Rows are found by configuration (``analysis.rows``): the savings among ``results/campaign-embedding``'s final
runs, the rows they are compared with (HMT default, the memory-minimal setting) among ``results/campaign``'s.
Δ is against that row, a difference counting only when the paired t-test over the seeds (they share the data
order) gives p < 0.05.

    python -m analysis.embedding_cost results/campaign-embedding results/campaign --out docs/campaign/tables
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.ablation import HMT
from analysis.load import load_results
from analysis.rows import Source, bracketed, loss_cells, mean_mib, row_runs, run_configs, tuned_rate
from analysis.tables import Table, write_table_files
from experiments.errors import OneLineErrorParser, one_line_errors
from experiments.sweeps.tuning import search_results_dir

EMBEDDING, CAMPAIGN = "embedding", "campaign"
DEFAULT = {**HMT, "method.embedding_dtype": "bf16", "method.embedding_update": "dense", "method.head_update": "dense"}
MINIMAL = {"model.name": "tiny", "method.name": "hmt", "method.mode": "B", "method.rank": 1,
           "method.state_dtype": "bf16", "train.max_grad_norm": 0.0,
           "method.head_update": "dense", "activation.residual": "keep"}


@dataclass(frozen=True, kw_only=True)
class Row:
    label: str
    adds: str
    source: str  # EMBEDDING | CAMPAIGN
    keys: Mapping[str, Any]
    against: str | None = None  # the label of the row it is compared with


ROWS = (
    Row(label="HMT default", adds="the campaign row", source=CAMPAIGN, keys=DEFAULT),
    Row(label="+ INT8 embedding and head", adds="input embedding and LM head as INT8 codes + block scales, updated "
        "by stochastic rounding (method.embedding_dtype=int8)", source=EMBEDDING,
        keys={**DEFAULT, "method.embedding_dtype": "int8"}, against="HMT default"),
    Row(label="+ embedding rows, lazy exact", adds="the embedding updated by its touched rows, dense AdamW caught up "
        "per row (method.embedding_update=lazy_exact)", source=EMBEDDING,
        keys={**DEFAULT, "method.embedding_update": "lazy_exact"}, against="HMT default"),
    Row(label="+ embedding rows, SparseAdam", adds="the embedding's touched rows by torch.optim.SparseAdam's rule "
        "(method.embedding_update=sparse_adam)", source=EMBEDDING,
        keys={**DEFAULT, "method.embedding_update": "sparse_adam"}, against="HMT default"),
    Row(label="memory-minimal", adds="the campaign row (Mode B rank 1 incl. LM head, bf16 state, full "
        "checkpointing, no clipping)", source=CAMPAIGN, keys=MINIMAL),
    Row(label="+ head in the loss", adds="the LM head updated by vocabulary block inside the fused loss's backward "
        "(method.head_update=in_loss)", source=EMBEDDING, keys={**MINIMAL, "method.head_update": "in_loss"},
        against="memory-minimal"),
    Row(label="+ INT8 layer inputs", adds="the checkpointed layer inputs stored as blockwise INT8 "
        "(activation.residual=int8)", source=EMBEDDING, keys={**MINIMAL, "activation.residual": "int8"},
        against="memory-minimal"),
    Row(label="+ INT4 outlier layer inputs", adds="the checkpointed layer inputs stored as outlier-aware INT4 "
        "(activation.residual=int4_outlier)", source=EMBEDDING,
        keys={**MINIMAL, "activation.residual": "int4_outlier"}, against="memory-minimal"),
)


def embedding_table(sources: Mapping[str, tuple[Source, Source | None]]) -> Table:
    found = {row.label: row_runs(row.label, row.keys, sources[row.source][0]) for row in ROWS}
    rows = []
    for row in ROWS:
        runs, (final, search) = found[row.label], sources[row.source]
        rows.append([row.label, row.adds, row.against or "—", tuned_rate(runs, final[1]),
                     bracketed(runs, row.keys, search), str(len(runs)),
                     *loss_cells(runs, found[row.against] if row.against else None),
                     mean_mib(runs, "optim_state_bytes"), mean_mib(runs, "peak_bytes")])
    return Table("embedding_cost", "What the embedding and LM-head savings cost in loss (tiny Llama, 300 steps; each "
                 "row at its tuned learning rate, validation loss mean ± std over seeds 1-3; Δ against the row "
                 "named, a difference counting only when the paired t-test over seeds gives p < 0.05)",
                 ["Row", "Adds", "Against", "Tuned lr", "Bracketed", "Seeds", "Val loss", "Δ", "Differs?",
                  "Optimizer state (MiB)", "Peak memory (MiB)"], rows,
                 ["l", "l", "l", "l", "r", "r", "r", "r", "r", "r", "r"])


def write_tables(embedding: Path, campaign: Path, out: Path) -> list[Path]:
    sources = {}
    for name, folder in ((EMBEDDING, embedding), (CAMPAIGN, campaign)):
        search = Path(search_results_dir(str(folder)))
        sources[name] = ((load_results(folder), run_configs(folder)),
                         (load_results(search), run_configs(search)) if search.is_dir() else None)
    table = embedding_table(sources)
    return write_table_files([table], out)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m analysis.embedding_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("embedding", type=Path, help="the embedding rows' results (results/campaign-embedding)")
    parser.add_argument("campaign", type=Path, help="the campaign's results (results/campaign)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the tables (docs/campaign/tables)")
    args = parser.parse_args(argv)
    written = one_line_errors(lambda: write_tables(args.embedding, args.campaign, args.out), OSError)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
