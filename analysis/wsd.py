"""``python -m analysis.wsd <trunks dir> --out <dir> [--branches DIR] [--extra DIR ...] [--reference ROW]
[--horizon STEPS ...] [--name NAME] [--row-name ROW=NAME ...]``: the loss at each horizon of warmup-stable-decay
trunks and their cool-down branches (``experiments.sweeps.branches``; Hägele et al. 2024, "Scaling Laws and
Compute-Optimal Training Beyond Fixed Training Durations").

Each trunk (a run of ``<trunks dir>``) and each branch (``<trunks dir>-branches`` unless ``--branches``) ends at
its horizon, ``train.steps``, after its own linear cool-down: its final validation loss is the row's loss at that
horizon; an ``--extra`` folder adds runs of the same rows trained to a horizon directly (a branch is that same run),
e.g. at another rate. A row is a method and setting less its learning rate and horizon (each row's rate is tuned on
the trunk), labelled ``method`` or ``method: variant`` (the overrides telling it apart from the other completed
runs of that method in all the folders together: ``row_labels``), and ``label (lr <rate>)`` where one label ran
at several rates; ``--row-name adamw="AdamW split (×64 dense)"`` shows it under a name instead. Its seeds are
compared with AdamW split's (``method=adamw``: the only AdamW row, or the one ``--reference`` names) seed by seed
(paired t-test, ``analysis.stats``; a seed fixes data order and initialisation for every row).

Writes ``<out>/tables/<name>.md`` and ``.tex`` (per horizon: each row's mean ± sample std over seeds, Δ against
AdamW split and its paired p) and ``<out>/figures/<name>.png`` and ``.pdf`` (validation loss against training
tokens at each horizon, seed mean with ±1 sample-std error bars, and beside it each row's seed-paired gap to AdamW
split with ±1 sample std of the differences; the seed counts in the legends). Bad input is one ``error:`` line,
exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from analysis import stats  # noqa: E402
from analysis.figures import SPARE_COLORS, method_colors, save  # noqa: E402
from analysis.labels import short_labels  # noqa: E402
from analysis.load import load_results  # noqa: E402
from analysis.rows import run_configs  # noqa: E402
from analysis.rundirs import find_run_dirs, read_run  # noqa: E402
from analysis.settings import compact_labels, setting_of  # noqa: E402
from analysis.tables import DASH, Table, by_seed, fmt_mean_std, fmt_p, to_latex, to_markdown  # noqa: E402
from experiments.errors import OneLineErrorParser, UserError, one_line_errors  # noqa: E402
from experiments.results import atomic_write_text  # noqa: E402

REFERENCE = "adamw"  # AdamW split: the method of the reference row


def horizon_runs(trunks: Path, branches: Path | None, names: dict[str, str] | None = None, *,
                 extra: tuple[Path, ...] = (), reference: str | None = None) -> pd.DataFrame:
    """Completed training runs of the trunks, branches and ``extra`` folders: ``row`` (method: setting less lr and
    horizon, or its name in ``names``; ``label``: the former always), ``horizon`` (steps), ``seed``, ``val_loss``,
    ``lr``, ``kind`` (trunk | branch | extra), ``reference`` (the AdamW split row the others are paired with: the
    one labelled ``reference``, or the only AdamW row). A row's label is told apart among the completed runs of all
    folders together, so a trunk and its branches share it whatever else either folder holds."""
    folders = [(kind, folder) for kind, folder in (("trunk", trunks), ("branch", branches)) if folder is not None]
    runs = labelled_runs(folders + [("extra", folder) for folder in extra], names, split_rates=True)
    candidates = sorted(set(runs.loc[runs["method"] == REFERENCE, "label"]))
    if reference is not None and reference not in candidates:
        raise UserError(f"--reference {reference!r}: no such AdamW row (AdamW rows: {', '.join(candidates) or 'none'})")
    if reference is None and len(candidates) > 1:
        raise UserError(f"several AdamW rows ({', '.join(candidates)}): name the reference with --reference")
    return runs.assign(reference=runs["label"] == (reference or (candidates or [None])[0]))


def labelled_runs(folders: list[tuple[str, Path]], names: dict[str, str] | None = None, *,
                  split_rates: bool = False) -> pd.DataFrame:
    """Each (kind, folder)'s completed training runs, ``kind`` its name, the rows labelled across all the folders
    together (``row_labels``); with ``split_rates`` a label run at more than one learning rate becomes one row per
    rate, ``label (lr <rate>)``."""
    labels = row_labels([folder for _, folder in folders])
    frames = []
    for kind, folder in folders:
        runs = load_results(folder).completed()
        runs = runs[runs["mode"] == "train"]
        runs = runs.assign(label=runs["run_id"].map(labels), kind=kind,
                           horizon=pd.to_numeric(runs["steps"]).astype(int))
        frames.append(runs[["run_id", "label", "method", "horizon", "seed", "val_loss", "lr", "kind"]])
    runs = pd.concat(frames, ignore_index=True)
    if split_rates:  # one label at two rates: two rows, each named with its rate
        several = runs["label"].map(runs.groupby("label")["lr"].nunique()) > 1
        runs["label"] = runs["label"].where(~several, runs["label"] + runs["lr"].map(lambda lr: f" (lr {lr:g})"))
    runs.insert(1, "row", runs["label"].map(lambda row: (names or {}).get(row, row)))
    return runs.sort_values(["horizon", "row", "seed"], kind="stable")


def row_labels(folders: list[Path]) -> dict[str, str]:
    """{run id: ``method`` or ``method: variant``} of the completed runs under ``folders``: the variant names what
    tells the run's setting, less its learning rate and ``train.steps``, apart from the other settings of its
    method, model and mode there (``analysis.settings.compact_labels``), by its short name where it has one
    (``analysis.labels``: ``default``, ``memory-minimal``)."""
    settings, groups, methods = {}, {}, {}
    for folder in folders:
        for path in find_run_dirs(folder):
            run = read_run(path, lambda _: None)
            if run is None or run.status != "completed" or not run.config:
                continue
            run_id = str(run.summary.get("run_id") or path.name)
            settings[run_id] = {k: v for k, v in setting_of(run.config).items()
                                if k not in ("method.lr", "train.steps")}
            methods[run_id] = str(run.summary.get("method") or settings[run_id].get("method.name"))
            groups[run_id] = (methods[run_id], str(run.summary.get("model")), str(run.summary.get("mode")))
    raw = compact_labels(settings, groups)
    short = {g: short_labels([raw[r] for r in raw if groups[r] == g]) for g in set(groups.values())}
    variants = {r: short[groups[r]][raw[r]] for r in raw}
    return {r: methods[r] + (f": {variants[r]}" if variants[r] else "") for r in settings}


def paired_deltas(runs: pd.DataFrame) -> pd.DataFrame:
    """Per horizon and row (AdamW split's own left out): the seed-paired differences to AdamW split — ``delta``
    (their mean), ``std`` (their sample std; NaN with one pair), ``pairs`` and ``p`` (paired t-test; NaN with one)."""
    out = []
    for horizon, at in runs.groupby("horizon", sort=True):
        reference = at[at["reference"]]
        ref_seeds, ref_rows = by_seed(reference), set(reference["row"])
        for row, g in at.groupby("row", sort=True):
            seeds = by_seed(g)
            diffs = pd.Series([a - b for a, b in stats.paired(seeds, ref_seeds)], dtype=float)
            if row in ref_rows or diffs.empty:
                continue
            out.append({"horizon": horizon, "row": row, "method": g["method"].iloc[0], "delta": diffs.mean(),
                        "std": diffs.std(), "pairs": len(diffs), "p": stats.paired_p(seeds, ref_seeds)})
    return pd.DataFrame(out, columns=["horizon", "row", "method", "delta", "std", "pairs", "p"])


def horizon_table(runs: pd.DataFrame, name: str, tokens_per_step: int) -> Table:
    """Per horizon and row: seeds, validation loss mean ± std, Δ against AdamW split and the paired p."""
    deltas = paired_deltas(runs).set_index(["horizon", "row"])
    rows, sections = [], []
    for horizon, at in runs.groupby("horizon", sort=True):
        sections.append((f"{horizon:,} steps ({horizon * tokens_per_step / 1e6:.2f} M tokens)", len(rows)))
        present = set(at["row"])
        for row in [r for r in row_order(runs) if r in present]:
            g = at[at["row"] == row]
            d = deltas.loc[(horizon, row)] if (horizon, row) in deltas.index else None
            delta = DASH if d is None else f"{d['delta']:+.3f}"
            p = DASH if d is None or d["pairs"] < 2 else fmt_p(d["p"])
            rows.append([row, f"{horizon:,}", ", ".join(f"{s:g}" for s in sorted(g["lr"].dropna().unique())),
                         str(g["seed"].nunique()), fmt_mean_std(g["val_loss"], ".3f"), delta, p])
    title = ("Loss at each horizon of warmup-stable-decay trunks and their cool-down branches: validation loss, "
             "mean ± sample std over seeds; Δ against AdamW split, paired by seed, and the paired t-test's p "
             "(a difference counts only when p < 0.05)")
    return Table(name, title, ["Row", "Horizon (steps)", "lr", "Seeds", "Val loss", "Δ vs AdamW split", "p"], rows,
                 ["l", "r", "r", "r", "r", "r", "r"], sections=sections)


def row_order(runs: pd.DataFrame) -> list[str]:
    """The rows, the reference first, then any other AdamW row (AdamW split at another rate), the rest by name."""
    reference, adamw = set(runs.loc[runs["reference"], "row"]), set(runs.loc[runs["method"] == REFERENCE, "row"])
    return sorted(runs["row"].unique(), key=lambda row: (row not in reference, row not in adamw, row))


def row_colors(runs: pd.DataFrame) -> dict[str, str]:
    """{row: color}: a method's first row in its campaign color, a further row of the same method (the leanest HMT
    setting beside HMT default) in a spare one."""
    fixed, spare = method_colors(runs["method"].unique()), iter(SPARE_COLORS)
    used: set[str] = set()
    colors = {}
    for row in row_order(runs):
        color = fixed[runs.loc[runs["row"] == row, "method"].iloc[0]]
        colors[row] = color if color not in used else next(spare)
        used.add(colors[row])
    return colors


def _seed_label(counts) -> str:
    seeds = sorted(set(counts))
    return f"{seeds[0]}{'' if len(seeds) == 1 else f'–{seeds[-1]}'} seed{'' if seeds == [1] else 's'}"


def horizon_figure(runs: pd.DataFrame, tokens_per_step: int) -> Figure:
    """Left: validation loss at each horizon against its training tokens (log scale), one line per row: seed mean,
    error bars ±1 sample std over seeds (none with one seed). Right: each row's seed-paired difference to AdamW
    split at each horizon, mean ± 1 sample std of the differences (none with one pair)."""
    fig, (ax, ax_delta) = plt.subplots(1, 2, figsize=(11.5, 4.4), layout="constrained")
    colors, rows = row_colors(runs), row_order(runs)
    deltas = paired_deltas(runs)
    for i, row in enumerate(rows):
        g = runs[runs["row"] == row]
        points = g.groupby("horizon")["val_loss"].agg(["mean", "std", "count"]).sort_index()
        shift = 1 + 0.012 * (i - (len(rows) - 1) / 2)  # rows side by side at each horizon: error bars apart
        style = {"color": colors[row], "marker": "o", "ms": 4, "capsize": 3, "lw": 1.2, "ls": "-" if i % 2 == 0
                 else "--"}
        ax.errorbar(points.index * tokens_per_step / 1e6 * shift, points["mean"], yerr=points["std"].fillna(0),
                    label=f"{row} ({_seed_label(points['count'])})", **style)
        d = deltas[deltas["row"] == row].sort_values("horizon")
        if not d.empty:
            ax_delta.errorbar(d["horizon"] * tokens_per_step / 1e6 * shift, d["delta"], yerr=d["std"].fillna(0),
                              label=f"{row} ({_seed_label(d['pairs'])} paired)", **style)
    ax_delta.axhline(0, color="k", lw=0.8)
    ax.set(ylabel="validation loss, whole split (nats/token)",
           title="Loss at each horizon after its cool-down\n(seed mean; error bars ±1 sample std over seeds)")
    ax_delta.set(ylabel="Δ validation loss vs AdamW split (nats/token)",
                 title="Gap to AdamW split, paired by seed\n(mean; error bars ±1 sample std of the differences)")
    ticks = sorted(runs["horizon"].unique() * tokens_per_step / 1e6)
    for a in (ax, ax_delta):
        a.set_xscale("log")
        a.set_xticks(ticks, [f"{t:.2f}" for t in ticks])
        a.minorticks_off()
        a.set_xlabel("training tokens at the horizon (millions; log scale)")
        a.grid(alpha=0.3)
    ax.legend(fontsize="small", frameon=False)
    ax_delta.legend(fontsize="small", frameon=False)
    return fig


def tokens_per_step(trunks: Path) -> int:
    """Tokens per optimizer step of the trunks (train.seq_len × batch_size × grad_accum, from their configs); runs
    that differ in it are one ``UserError``."""
    found = {int(c["train.seq_len"]) * int(c["train.batch_size"]) * int(c.get("train.grad_accum", 1))
             for c in run_configs(trunks).values() if "train.seq_len" in c}
    if len(found) != 1:
        raise UserError(f"{trunks}: the trunks' tokens per step are {sorted(found) or 'unknown'}; one value needed")
    return found.pop()


def row_name(item: str) -> tuple[str, str]:
    """``ROW=NAME`` of ``--row-name`` as (row, name); anything else is one ``UserError``."""
    row, sep, name = item.partition("=")
    if not sep or not row.strip() or not name.strip():
        raise UserError(f"--row-name {item!r}: write ROW=NAME, e.g. adamw=\"AdamW split\"")
    return row.strip(), name.strip()


def branches_folder(trunks: Path, branches: Path | None) -> Path | None:
    """The trunks' branches folder: ``branches`` (one ``UserError`` when it is not a folder), else
    ``<trunks>-branches`` where it exists, else None."""
    if branches is not None and not branches.is_dir():
        raise UserError(f"--branches {branches}: no such folder")
    default = Path(str(trunks).rstrip("/") + "-branches")
    return branches or (default if default.is_dir() else None)


def check_row_names(names: dict[str, str], runs: pd.DataFrame) -> None:
    """One ``UserError`` naming a ``--row-name`` row that ``runs`` does not hold."""
    unknown = sorted(set(names) - set(runs["label"]))
    if unknown:
        raise UserError(f"--row-name {unknown[0]}=...: no such row (rows: {', '.join(sorted(set(runs['label'])))})")


def write_table(table: Table, out: Path) -> list[Path]:
    """``<out>/tables/<table.name>.md`` (its title in bold above it) and ``.tex``, each written atomically."""
    (out / "tables").mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, render in ((".md", to_markdown), (".tex", to_latex)):
        path = out / "tables" / f"{table.name}{suffix}"
        atomic_write_text(path, (f"**{table.title}**\n\n" if suffix == ".md" else "") + render(table))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="python -m analysis.wsd", description=__doc__.split("\n")[0])
    parser.add_argument("trunks", type=Path, help="folder of the wsd trunk runs (a sweep's results_dir)")
    parser.add_argument("--branches", type=Path, default=None, help="folder of their branches (default "
                        "<trunks>-branches)")
    parser.add_argument("--extra", type=Path, action="append", default=[], metavar="DIR",
                        help="a further folder of the same rows' runs (e.g. at another rate); repeatable")
    parser.add_argument("--reference", default=None, metavar="ROW", help="the AdamW split row the others are "
                        "paired with, where there are several (e.g. 'adamw (lr 0.0003)')")
    parser.add_argument("--horizon", type=int, action="append", default=[], metavar="STEPS",
                        help="only this horizon (train.steps); repeatable; default every horizon run")
    parser.add_argument("--out", type=Path, required=True, help="writes <out>/tables/<name>.* and figures/<name>.*")
    parser.add_argument("--name", default="wsd_horizons", help="file name of the table and figure")
    parser.add_argument("--row-name", action="append", default=[], metavar="ROW=NAME",
                        help="show row ROW (as the table would label it, e.g. adamw) as NAME; repeatable")
    args = parser.parse_args(argv)

    def go() -> int:
        names = dict(row_name(item) for item in args.row_name)
        branches = branches_folder(args.trunks, args.branches)
        for folder in args.extra:
            if not folder.is_dir():
                raise UserError(f"--extra {folder}: no such folder")
        runs = horizon_runs(args.trunks, branches, names, extra=tuple(args.extra), reference=args.reference)
        missing = sorted(set(args.horizon) - set(runs["horizon"]))
        if missing:
            raise UserError(f"--horizon {missing[0]}: no completed run of that many steps")
        runs = runs[runs["horizon"].isin(args.horizon)] if args.horizon else runs
        if runs.empty:
            raise UserError(f"{args.trunks}: no completed training run")
        check_row_names(names, runs)
        tokens = tokens_per_step(args.trunks)
        written = write_table(horizon_table(runs, args.name, tokens), args.out)
        written += save(horizon_figure(runs, tokens), args.out / "figures", args.name)
        print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
        return 0

    return one_line_errors(go, OSError)


if __name__ == "__main__":
    sys.exit(main())
