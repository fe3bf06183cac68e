"""The batch campaign's table and figure: does the pretraining ranking hold at 8, 32 and 64 sequences per step at
equal tokens, each row retuned at each batch (docs/campaign/findings.md)?

Rows are found by configuration (``analysis.rows``): at batch 8 among the campaign's final runs
(``results/campaign``; AdamW split from the controls, ``results/campaign-controls``), at 32 and 64 among the batch
campaign's (``results/campaign-batch``, ``experiments/sweeps/campaign_batch_*.yaml``); each row's tuned rate is
checked against its own search (``<folder>-lr-search``). Δ is against AdamW split at the same batch, a difference
counting only when the paired t-test over the seeds (they share the data order) gives p < 0.05.

    python -m analysis.batch results/campaign-batch results/campaign results/campaign-controls \
        --out docs/campaign
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from analysis.ablation import HMT, PRETRAIN  # noqa: E402
from analysis.figures import FIXED_COLORS, save  # noqa: E402
from analysis.load import Results  # noqa: E402
from analysis.rows import Source, bracketed, loss_cells, row_runs, search_cells, tuned_rate, with_search  # noqa: E402
from analysis.tables import Table, lr_search_table, write_table_files  # noqa: E402
from experiments.errors import OneLineErrorParser, one_line_errors  # noqa: E402

BATCH, CAMPAIGN, CONTROLS = "batch", "campaign", "controls"
BATCHES = (8, 32, 64)  # sequences of 128 tokens per step; 8 is the campaign's own


@dataclass(frozen=True, kw_only=True)
class Method:
    label: str
    color: str
    keys: Mapping[str, Any]  # without the batch size
    source8: str  # where its batch-8 runs are: CAMPAIGN | CONTROLS


METHODS = (
    Method(label="AdamW split (×64 dense)", color=FIXED_COLORS["adamw"], source8=CONTROLS,
           keys={"model.name": "tiny", "method.name": "adamw", "method.dense_lr_scale": 64.0}),
    Method(label="GaLore rank 64", color=FIXED_COLORS["galore"], source8=CAMPAIGN,
           keys={**PRETRAIN, "method.name": "galore", "method.rank": 64}),
    Method(label="APOLLO", color=FIXED_COLORS["apollo"], source8=CAMPAIGN,
           keys={"model.name": "tiny", "method.name": "apollo", "method.variant": "apollo"}),
    Method(label="HMT default", color=FIXED_COLORS["hmt"], source8=CAMPAIGN,
           keys={**HMT, "method.embedding_dtype": "bf16", "method.embedding_update": "dense"}),
)


def _sources(batch: Path, campaign: Path, controls: Path) -> dict[str, tuple[Source, Source | None]]:
    """name -> ((final runs, configs), (search runs, configs) or None)."""
    return {name: with_search(folder, may_be_empty=name == BATCH)
            for name, folder in ((BATCH, batch), (CAMPAIGN, campaign), (CONTROLS, controls))}


def batch_runs(sources: Mapping[str, tuple[Source, Source | None]]) -> dict[tuple[str, int], tuple]:
    """(method label, batch) -> (final runs, keys, its (final, search) sources)."""
    out = {}
    for method in METHODS:
        for batch in BATCHES:
            keys = {**method.keys, "train.batch_size": batch}
            source = sources[method.source8 if batch == BATCHES[0] else BATCH]
            out[(method.label, batch)] = (row_runs(f"{method.label}, batch {batch}", keys, source[0]), keys, source)
    return out


def batch_table(found: Mapping[tuple[str, int], tuple]) -> Table:
    """One section per batch size, one row per method; Δ and the paired t-test's verdict against AdamW split there."""
    rows, sections = [], []
    for batch in BATCHES:
        sections.append((f"{batch} sequences × 128 tokens per step", len(rows)))
        reference = found[(METHODS[0].label, batch)][0]
        for method in METHODS:
            runs, keys, (final, search) = found[(method.label, batch)]
            steps = str(int(runs["steps"].iloc[0])) if len(runs) else "—"
            rows.append([method.label, str(batch), steps, *search_cells(keys, search), tuned_rate(runs, final[1]),
                         bracketed(runs, keys, search), str(len(runs)),
                         *loss_cells(runs, None if method is METHODS[0] else reference)])
    return Table("batch", "Batch size at equal tokens (tiny Llama, 307,200 training tokens; each row retuned at each "
                 "batch: learning rate searched at seed 0, the best search point shown, \"(edge)\" where it is an end "
                 "of its grid; validation loss mean ± std over seeds 1-3 at the tuned rate; Δ against AdamW split at "
                 "the same batch, a difference counting only when the paired t-test over seeds gives p < 0.05)",
                 ["Method", "Batch", "Steps", "Search: best lr", "Search: loss (seed 0)", "Tuned lr", "Bracketed",
                  "Seeds", "Val loss", "Δ vs AdamW split", "Differs?"], rows,
                 ["l", "r", "r", "l", "r", "l", "r", "r", "r", "r", "r"], sections=sections)


def batch_figure(found: Mapping[tuple[str, int], tuple]) -> Figure:
    """Validation loss (mean ± 1 sample std over seeds: error bars; the legend gives the seed count) against
    sequences per step, one line per method."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for i, method in enumerate(METHODS):
        points = [(batch, pd.to_numeric(found[(method.label, batch)][0]["val_loss"], errors="coerce"))
                  for batch in BATCHES]
        seeds = sorted({len(v) for _, v in points if len(v)})
        points = [(b, v.mean(), v.std(ddof=1) if len(v) > 1 else 0.0) for b, v in points if len(v)]
        if points:
            shift = 1 + 0.02 * (i - 1.5)  # methods side by side at each batch, so the error bars do not overlap
            ax.errorbar([b * shift for b, _, _ in points], [m for _, m, _ in points], yerr=[s for _, _, s in points],
                        color=method.color, marker="o", capsize=3,
                        label=f"{method.label} ({seeds[0]}{'' if len(seeds) == 1 else f'–{seeds[-1]}'} seeds)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
    ax.minorticks_off()
    ax.set_xlabel("sequences of 128 tokens per step\n(≈307 k training tokens in every run)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.set_title("Validation loss: mean over seeds, error bars ±1 sample std over them", fontsize="medium")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False)
    fig.tight_layout()
    return fig


def with_batch_labels(source: Source) -> Results:
    """The search runs, each row's setting naming its batch size also where a method ran at one batch only (the
    setting lists only what differs among a method's runs, so such a row's was empty)."""
    results, configs = source
    runs = results.runs.copy()
    empty = runs["variant_sans_lr"].fillna("") == ""
    runs.loc[empty, "variant_sans_lr"] = [f"train.batch_size={configs[r]['train.batch_size']}"
                                          for r in runs.loc[empty, "run_id"]]
    return dataclasses.replace(results, runs=runs)


def write_outputs(batch: Path, campaign: Path, controls: Path, out: Path) -> list[Path]:
    """tables/batch.{md,tex}, tables/batch_lr_search.{md,tex} and figures/batch.{png,pdf} under ``out``."""
    sources = _sources(batch, campaign, controls)
    found = batch_runs(sources)
    tables = [batch_table(found)]
    if sources[BATCH][1] is not None:
        tables.append(dataclasses.replace(lr_search_table(with_batch_labels(sources[BATCH][1])), name="batch_lr_search",
                                          title="Learning-rate search of the batch campaign: validation loss per "
                                                "rate (seed 0; the batch size is in the setting)"))
    written = write_table_files(tables, out / "tables")
    fig = batch_figure(found)
    written += save(fig, out / "figures", "batch")
    plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m analysis.batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("batch", type=Path, help="the batch campaign's results (results/campaign-batch)")
    parser.add_argument("campaign", type=Path, help="the campaign's results (results/campaign): batch 8")
    parser.add_argument("controls", type=Path, help="the controls' results (results/campaign-controls): AdamW "
                        "split at batch 8")
    parser.add_argument("--out", type=Path, required=True, help="folder for tables/ and figures/ (docs/campaign)")
    args = parser.parse_args(argv)
    written = one_line_errors(lambda: write_outputs(args.batch, args.campaign, args.controls, args.out), OSError)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
