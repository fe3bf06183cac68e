"""``python -m analysis.wsd_bracket <trunks dir> <bracket dir> --out <dir> [--branches DIR] [--name NAME]
[--row-name ROW=NAME ...]``:
whether each row of a warmup-stable-decay table (``analysis.wsd``) ran at its best learning rate on the trunk.

``<bracket dir>`` holds runs of the same rows at other rates (e.g. ``campaign_wsd_tiny_bracket``: 1/3 and 3× the
rate, one seed); the run of the same row, seed and horizon among the table's trunks and branches (``<trunks
dir>-branches`` unless ``--branches``) is the rate the table used. Per row,
seed and horizon: the validation loss at each rate, the best rate by the tuner's own rule
(``experiments.sweeps.tuning.select_lr``: the lowest loss, ties to the smaller rate; bracketed when it is neither
the smallest nor the largest rate run) and Δ = loss at the best rate − loss at the used rate (0 when the used rate
wins; negative: the table's row was not at its best on this schedule). One run per cell: no spread; compare Δ with
the seed-to-seed std of the table at that horizon. Rows are labelled across both folders as ``analysis.wsd`` labels
them. Writes ``<out>/tables/<name>.md`` and ``.tex``; bad input is one ``error:`` line, exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from analysis.tables import Table
from analysis.wsd import REFERENCE, branches_folder, check_row_names, labelled_runs, row_name, row_order, write_table
from experiments.errors import OneLineErrorParser, UserError, one_line_errors
from experiments.sweeps.tuning import select_lr

KEYS = ["row", "seed", "horizon"]


def bracket_runs(used: list[Path], bracket: Path, names: dict[str, str] | None = None) -> pd.DataFrame:
    """The bracket folder's runs and the ``used`` folders' (the table's trunks and branches) runs of the same (row,
    seed, horizon), ``used`` True for the latter; a ``names`` row no folder holds, or a (row, seed, horizon)
    without its used run, or with two, is one ``UserError``."""
    runs = labelled_runs([("used", folder) for folder in used] + [("bracket", bracket)], names)
    check_row_names(names or {}, runs)
    runs = runs.assign(used=runs["kind"] == "used", reference=runs["method"] == REFERENCE)  # AdamW rows first
    wanted = set(map(tuple, runs.loc[~runs["used"], KEYS].itertuples(index=False)))
    runs = runs[[tuple(k) in wanted for k in runs[KEYS].itertuples(index=False)]]
    for key, g in runs.groupby(KEYS, sort=True):
        if int(g["used"].sum()) != 1 or g["lr"].duplicated().any():
            raise UserError(f"{used[0]}: row {key[0]!r} seed {key[1]} at {key[2]} steps needs one run at the used rate "
                            f"and one per other rate (found lr {sorted(g['lr'])}, {int(g['used'].sum())} used)")
    return runs


def bracket_table(runs: pd.DataFrame, name: str) -> Table:
    """Per row, seed and horizon: each rate's validation loss, the used and the best rate, Δ and bracketed."""
    rows = []
    for row in row_order(runs):
        for (seed, horizon), g in runs[runs["row"] == row].groupby(["seed", "horizon"], sort=True):
            losses = {float(lr): float(v) for lr, v in zip(g["lr"], g["val_loss"])}
            used = float(g.loc[g["used"], "lr"].iloc[0])
            best, bracketed = select_lr(losses)
            cells = ", ".join(f"{lr:g}{'*' if lr == used else ''}: {losses[lr]:.3f}" for lr in sorted(losses))
            rows.append([row, f"{horizon:,}", f"{seed:g}", cells, f"{used:g}", f"{best:g}",
                         f"{losses[best] - losses[used]:+.3f}", "yes" if bracketed else "no"])
    title = ("Is each row's rate its best on the warmup-stable-decay trunk? Validation loss at each learning rate "
             "(* the rate the horizon table used), one run each; Δ = loss at the best rate − loss at the used rate")
    return Table(name, title, ["Row", "Horizon (steps)", "Seed", "lr: val loss", "Used lr", "Best lr",
                               "Δ best − used", "Bracketed"], rows, ["l", "r", "r", "l", "r", "r", "r", "l"])


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m analysis.wsd_bracket", description=__doc__.split("\n")[0])
    parser.add_argument("trunks", type=Path, help="folder of the wsd trunks the horizon table used")
    parser.add_argument("bracket", type=Path, help="folder of the same rows' runs at other rates")
    parser.add_argument("--branches", type=Path, default=None, help="folder of the trunks' branches (default "
                        "<trunks>-branches, if it exists)")
    parser.add_argument("--out", type=Path, required=True, help="writes <out>/tables/<name>.md and .tex")
    parser.add_argument("--name", default="wsd_rate_bracket", help="file name of the table")
    parser.add_argument("--row-name", action="append", default=[], metavar="ROW=NAME",
                        help="show row ROW (as analysis.wsd labels it, e.g. adamw) as NAME; repeatable")
    args = parser.parse_args(argv)

    def go() -> int:
        names = dict(row_name(item) for item in args.row_name)
        for folder in (args.trunks, args.bracket):
            if not folder.is_dir():
                raise UserError(f"{folder}: no such folder")
        branches = branches_folder(args.trunks, args.branches)
        runs = bracket_runs([args.trunks] + ([branches] if branches else []), args.bracket, names)
        if runs.empty:
            raise UserError(f"{args.bracket}: no completed training run")
        written = write_table(bracket_table(runs, args.name), args.out)
        print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
        return 0

    return one_line_errors(go, OSError)


if __name__ == "__main__":
    sys.exit(main())
