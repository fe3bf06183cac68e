"""The campaign's ablation table: from AdamW with a split learning rate to HMT default, one difference at a time,
each row at its own tuned learning rate (``experiments.sweeps.tuning``), mean ± std over the final seeds; and the
single-difference controls beside it (docs/campaign/findings.md).

Rows are found by what their configuration holds (``ROWS``: the results folder they come from and the values of
a few dotted config keys, a key absent from a run's config reading as its default), among the final runs of
``results/campaign-controls`` (the controls, ``benchmarks/campaign_controls.sh``) and ``results/campaign`` (the
campaign's own rows). A row none of whose runs has finished reads "not run"; two settings matching one row are
an error, so a row never averages over two configurations.

    python -m analysis.ablation results/campaign-controls results/campaign --out docs/campaign/tables
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.load import Results, load_results
from analysis.rows import loss_cells, mean_mib, row_runs as _row_runs, run_configs, tuned_rate
from analysis.tables import Table, lr_search_table, write_table_files
from experiments.errors import OneLineErrorParser, one_line_errors
from experiments.sweeps.tuning import search_results_dir

CONTROLS, CAMPAIGN = "controls", "campaign"
PRETRAIN = {"model.name": "tiny", "method.eight_bit": False}
HMT = {"model.name": "tiny", "method.name": "hmt", "method.mode": "A", "method.weight_dtype": "bf16",
       "method.state_dtype": "fp32", "train.max_grad_norm": 1.0, "activation.attn_out": "keep",
       "method.sides": "one_sided", "method.basis": "rsvd", "method.rank": None, "method.norm_limiter": True,
       "method.eps": 1e-8}


@dataclass(frozen=True, kw_only=True)
class Row:
    label: str
    adds: str  # what this row adds to the one above (the caption's words)
    source: str  # CONTROLS | CAMPAIGN
    keys: Mapping[str, Any]
    chain: bool = True  # a step of the chain (else a single-difference control)


ROWS = (
    Row(label="AdamW", adds="the campaign's AdamW row: one learning rate for every parameter", source=CAMPAIGN,
        keys={**PRETRAIN, "method.name": "adamw", "method.dense_lr_scale": 1.0}),
    Row(label="AdamW split", adds="a second rate for embeddings, head and norms (2-D search)", source=CONTROLS,
        keys={"model.name": "tiny", "method.name": "adamw"}),
    Row(label="+ projection", adds="one-sided projection at fixed rank 128 from an exact SVD (GaLore's rule, in "
        "HMT; α = 0.25, no limiter)", source=CONTROLS,
        keys={**HMT, "method.basis": "svd", "method.rank": 128, "method.norm_limiter": False}),
    Row(label="+ randomized basis", adds="the basis from a randomized SVD", source=CONTROLS,
        keys={**HMT, "method.rank": 128, "method.norm_limiter": False}),
    Row(label="+ energy rank", adds="rank by spectral energy under the state budget (GaLore's rank-128 state)",
        source=CONTROLS, keys={**HMT, "method.norm_limiter": False}),
    Row(label="+ limiter = HMT default", adds="the norm-growth limiter: HMT default (ε 1e-8)", source=CAMPAIGN,
        keys=HMT),
    Row(label="HMT identity", adds="HMT default without projection (full rank; split rate and limiter kept)",
        source=CONTROLS, keys={**HMT, "method.sides": "identity"}, chain=False),
    Row(label="HMT, GaLore's ε", adds="HMT default with ε = 1e-6", source=CONTROLS,
        keys={**HMT, "method.eps": 1e-6}, chain=False),
    Row(label="GaLore rank 64", adds="galore-torch at the campaign's rank", source=CAMPAIGN,
        keys={**PRETRAIN, "method.name": "galore", "method.rank": 64}, chain=False),
    Row(label="GaLore rank 128", adds="galore-torch at HMT default's state budget", source=CONTROLS,
        keys={**PRETRAIN, "method.name": "galore", "method.rank": 128}, chain=False),
)


def row_runs(row: Row, results: Results, configs: Mapping[str, dict]) -> pd.DataFrame:
    """The completed runs of ``row``'s one setting (empty if none); two matching settings are a ``UserError``."""
    return _row_runs(row.label, row.keys, (results, configs))


def ablation_table(sources: Mapping[str, tuple[Results, dict[str, dict]]]) -> Table:
    """The chain's rows, then the controls'; Δ and the paired t-test's verdict against the chain row above (controls:
    against HMT default)."""
    found = {row.label: row_runs(row, *sources[row.source]) for row in ROWS}
    default = next(row.label for row in ROWS if row.source == CAMPAIGN and row.keys == HMT)
    rows, previous = [], None
    for row in ROWS:
        runs = found[row.label]
        ref = found[previous] if row.chain and previous else found[default] if not row.chain else None
        rows.append([row.label, row.adds, tuned_rate(runs, sources[row.source][1]), str(len(runs)),
                     *loss_cells(runs, ref), mean_mib(runs, "optim_state_bytes")])
        previous = row.label if row.chain else previous
    n_chain = sum(row.chain for row in ROWS)
    return Table("ablation", "From AdamW to HMT default, one difference at a time (tiny Llama, 300 steps; each row "
                 "at its tuned learning rate, validation loss mean ± std over seeds 1-3; Δ against the row above, "
                 "a difference counting only when the paired t-test over seeds gives p < 0.05), and "
                 "single-difference controls (Δ against HMT default)",
                 ["Row", "Adds", "Tuned lr", "Seeds", "Val loss", "Δ", "Differs?", "Optimizer state (MiB)"],
                 rows, ["l", "l", "l", "r", "r", "r", "r", "r"],
                 sections=[("Chain: each row adds one difference to the row above", 0),
                           ("Controls: one difference from HMT default", n_chain)])


def write_tables(controls: Path, campaign: Path, out: Path) -> list[Path]:
    """ablation.{md,tex} and, from the controls' learning-rate searches, controls_lr_search.{md,tex}."""
    sources = {name: (load_results(d), run_configs(d)) for name, d in ((CONTROLS, controls), (CAMPAIGN, campaign))}
    made = [ablation_table(sources)]
    search = Path(search_results_dir(str(controls)))
    if search.is_dir():
        made.append(dataclasses.replace(lr_search_table(load_results(search)), name="controls_lr_search",
                                        title="Learning-rate search of the controls: validation loss per rate "
                                              "(seed 0; AdamW split: one row per dense-rate multiplier)"))
    return write_table_files(made, out)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m analysis.ablation", description=__doc__.split("\n\n")[0])
    parser.add_argument("controls", type=Path, help="the controls' results (results/campaign-controls)")
    parser.add_argument("campaign", type=Path, help="the campaign's results (results/campaign)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the tables (docs/campaign/tables)")
    args = parser.parse_args(argv)
    written = one_line_errors(lambda: write_tables(args.controls, args.campaign, args.out), OSError)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
