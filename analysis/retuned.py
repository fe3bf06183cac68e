"""The horizon and statistics campaigns' tables and figure (docs/campaign/findings.md): the main pretraining rows
retuned in a campaign of their own, compared with AdamW split seed by seed.

- **Horizon** (``results/campaign-horizon``, ``experiments/sweeps/campaign_horizon_*.yaml``): AdamW split, HMT
  default, GaLore rank 64 and APOLLO at 1,200 steps (4× the campaign's tokens), each retuned there on 5 rates,
  seeds 1-3, every evaluation on the whole validation split.
- **Statistics** (``results/campaign-stats``, ``experiments/sweeps/campaign_stats_*.yaml``): the same rows and
  single-rate AdamW at the campaign's 300 steps, each retuned on a grid 1.5× apart around its campaign winner,
  seeds 1-5, whole-split evaluation.
- **Larger model** (``results/campaign-30m``, ``experiments/sweeps/campaign_30m.yaml``, ``--larger``): the statistics
  rows on ``model=30m`` (29.5 M parameters against tiny's 5.3 M), each searched on 5 rates 2× apart, seeds 1-5.

A row is found by configuration (``analysis.rows``); its tuned rate is checked against its own search
(``<folder>-lr-search``). Δ and p are against AdamW split: the paired t-test over the seeds both ran (a seed fixes
the data order and initialisation for every row; ``analysis.stats``). "Last quarter" is the relative fall of the
row's seed-mean validation curve over the last quarter of training, (L(0.75T) − L(T)) / L(T), as in
``analysis.main_table.flattening_table``.

    python -m analysis.retuned results/campaign-horizon results/campaign-stats --out docs/campaign \
        --larger results/campaign-30m
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from analysis import stats  # noqa: E402
from analysis.ablation import PRETRAIN  # noqa: E402
from analysis.batch import METHODS, Method  # noqa: E402
from analysis.figures import save, seed_band  # noqa: E402
from analysis.main_table import relative_change, val_curve  # noqa: E402
from analysis.load import Results  # noqa: E402
from analysis.rows import (Source, bracketed, loss_by_seed, loss_cells, matches, row_runs, search_cells,  # noqa: E402
                           tuned_rate, with_search)
from analysis.tables import Table, fmt, fmt_p, lr_search_table, write_table_files  # noqa: E402
from experiments.errors import OneLineErrorParser, one_line_errors  # noqa: E402

ADAMW = Method(label="AdamW (one rate)", color="#7F7F7F", source8="campaign",
               keys={**PRETRAIN, "method.name": "adamw", "method.dense_lr_scale": 1.0})
HORIZON_ROWS = METHODS  # AdamW split first: the reference of every Δ
STATISTICS_ROWS = (*METHODS, ADAMW)
LARGER_MODEL = "30m"
TOKENS_PER_STEP = 8 * 128


def at_model(rows: Sequence[Method], model: str) -> tuple[Method, ...]:
    """The same rows on another model (``model.name``)."""
    return tuple(dataclasses.replace(row, keys={**row.keys, "model.name": model}) for row in rows)


LARGER_ROWS = at_model(STATISTICS_ROWS, LARGER_MODEL)


def found_rows(rows: Sequence[Method], source: tuple[Source, Source | None]) -> dict[str, pd.DataFrame]:
    """label -> the row's final runs (empty where it has not run)."""
    return {row.label: row_runs(row.label, row.keys, source[0]) for row in rows}


def retuned_table(name: str, title: str, rows: Sequence[Method], source: tuple[Source, Source | None]) -> Table:
    """One line per row: its search, tuned rate, seeds, validation loss, Δ and paired p against the first row, and
    the last quarter's fall of its validation curve."""
    (final, search), found = source, found_rows(rows, source)
    reference = found[rows[0].label]
    lines = []
    for row in rows:
        runs = found[row.label]
        p = stats.paired_p(loss_by_seed(runs), loss_by_seed(reference)) if row is not rows[0] else None
        last = relative_change(val_curve(final[0], runs["run_id"]), 0.75, 1.0) if len(runs) else None
        loss, delta, verdict = loss_cells(runs, None if row is rows[0] else reference)
        last_pct = None if last is None else 100 * last
        lines.append([row.label, *search_cells(row.keys, search), tuned_rate(runs, final[1]),
                      bracketed(runs, row.keys, search), str(len(runs)), loss, delta, fmt_p(p), verdict,
                      fmt(last_pct, "+.2f")])
    return Table(name, title, ["Method", "Search: best lr", "Search: loss (seed 0)", "Tuned lr", "Bracketed", "Seeds",
                               "Val loss", f"Δ vs {rows[0].label}", "p (paired)", "Differs?", "Last quarter (%)"],
                 lines, ["l", "l", "r", "l", "r", "r", "r", "r", "r", "r", "r"])


def with_row_labels(search: Source, rows: Sequence[Method]) -> Results:
    """The search runs, each setting named by its row's label (the search table would otherwise call AdamW split
    plain "adamw": the setting names only what differs among one method's runs)."""
    results, configs = search
    label = {r: next((row.label for row in rows if matches(configs.get(r, {}), row.keys)), "")
             for r in results.runs["run_id"]}
    return dataclasses.replace(results, runs=results.runs.assign(variant_sans_lr=results.runs["run_id"].map(label)))


def curves_figure(rows: Sequence[Method], source: tuple[Source, Source | None], title: str) -> Figure:
    """Validation loss (seed mean, ±1 std band) against training tokens, one line per row: the whole run, and its
    second half on its own scale (where the rows' differences are a few hundredths of a nat)."""
    results = source[0][0]
    found = found_rows(rows, source)
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 4.0), layout="constrained")
    for row in rows:
        metrics = results.metrics
        if not len(found[row.label]) or "loss/val" not in metrics:
            continue
        band = seed_band(metrics[metrics["run_id"].isin(found[row.label]["run_id"])], "loss/val")
        tokens = (band.index.to_numpy() + 1) * TOKENS_PER_STEP / 1e6
        low, high = band["mean"] - band["std"].fillna(0), band["mean"] + band["std"].fillna(0)
        half, seeds = tokens >= tokens[-1] / 2, int(band["n"].iloc[0])
        for ax, keep in zip(axes, (tokens > 0, half)):
            ax.plot(tokens[keep], band["mean"][keep], color=row.color, marker="o", ms=3, lw=1.4,
                    label=f"{row.label} ({seeds} seed{'' if seeds == 1 else 's'})")
            ax.fill_between(tokens[keep], low[keep], high[keep], color=row.color, alpha=0.15, lw=0)
    for ax, which in zip(axes, ("whole run", "second half")):
        ax.set(xlabel="training tokens (millions)", ylabel="validation loss, whole split (nats/token)", title=which)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}\n(line: mean over seeds; band: ±1 sample std over them; seed count in the legend)")
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False)
    return fig


HORIZON_TITLE = ("Horizon: 1,200 steps of 8 × 128 tokens (1.23 M tokens, 4× the campaign's; tiny Llama), each row "
                 "retuned at this horizon (5 rates at seed 0, \"(edge)\" where the best is an end of its grid), "
                 "validation loss on the whole validation split (74,496 tokens), mean ± std over seeds 1-3; Δ and p "
                 "against AdamW split, paired by seed; last quarter: the seed-mean curve's fall over steps 900-1,200")
STATISTICS_TITLE = ("Statistics: the campaign's 300 steps (tiny Llama), each row retuned on a grid 1.5× apart "
                    "around its campaign winner (5 rates at seed 0), validation loss on the whole validation split "
                    "(74,496 tokens), mean ± std over seeds 1-5; Δ and p against AdamW split, paired by seed")


LARGER_TITLE = ("Larger model: the statistics campaign's 300 steps of 8 × 128 tokens on a 29.5 M-parameter Llama "
                "(model=30m: hidden 512, 8 layers), each row searched on 5 rates 2× apart at seed 0, validation loss "
                "on the whole validation split (74,496 tokens), mean ± std over seeds 1-5; Δ and p against AdamW "
                "split, paired by seed")


FIGURE_TITLES = {"horizon": "Validation loss over 1,200 steps, each row at its tuned rate",
                 "larger_model": "Validation loss over 300 steps of the 29.5 M-parameter model, each row at its "
                                 "tuned rate"}


def write_outputs(horizon: Path, statistics: Path, out: Path, larger: Path | None = None) -> list[Path]:
    """tables/{horizon,statistics,larger_model}{,_lr_search}.{md,tex} and figures/{horizon,larger_model}.{png,pdf}
    under ``out`` (larger_model only with ``larger``, its figure once a row has final runs)."""
    tables, written = [], []
    campaigns = [("horizon", horizon, HORIZON_ROWS, HORIZON_TITLE),
                 ("statistics", statistics, STATISTICS_ROWS, STATISTICS_TITLE)]
    if larger is not None:
        campaigns.append(("larger_model", larger, LARGER_ROWS, LARGER_TITLE))
    for name, folder, rows, title in campaigns:
        source = with_search(folder, may_be_empty=True)
        tables.append(retuned_table(name, title, rows, source))
        if source[1] is not None and len(source[1][0].runs):
            tables.append(dataclasses.replace(lr_search_table(with_row_labels(source[1], rows)),
                                              name=f"{name}_lr_search",
                                              title=f"Learning-rate search of the {name.replace('_', ' ')} "
                                                    "campaign: validation loss per rate (seed 0)"))
        if name in FIGURE_TITLES and any(len(runs) for runs in found_rows(rows, source).values()):
            written += save(curves_figure(rows, source, FIGURE_TITLES[name]), out / "figures", name)
    return write_table_files(tables, out / "tables") + written


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m analysis.retuned", description=__doc__.split("\n\n")[0])
    parser.add_argument("horizon", type=Path, help="the horizon campaign's results (results/campaign-horizon)")
    parser.add_argument("statistics", type=Path, help="the statistics campaign's results (results/campaign-stats)")
    parser.add_argument("--out", type=Path, required=True, help="folder for tables/ and figures/ (docs/campaign)")
    parser.add_argument("--larger", type=Path, help="the larger model's results (results/campaign-30m)")
    args = parser.parse_args(argv)
    written = one_line_errors(lambda: write_outputs(args.horizon, args.statistics, args.out, args.larger), OSError)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

