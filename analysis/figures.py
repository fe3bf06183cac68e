"""The report's figures (matplotlib, Agg), each saved as PNG and PDF.

Every figure labels its axes with units and has a legend, outside the data; a method has one colour in every
figure (``method_colors``) and each of its other settings (their ``variant``, ``analysis.settings``, by its short
name, ``analysis.labels``) a colour, marker and line style of its own (``analysis.styles``).
Each ``*_figure`` function returns ``{name: Figure}`` (empty when the results hold no data for it, e.g. no run
recorded rank histories), so the report can say what it skipped.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from analysis.load import CATEGORIES, Results  # noqa: E402
from analysis.point_labels import number_points  # noqa: E402
from analysis.styles import setting_label, setting_styles  # noqa: E402
from analysis.tables import GIB, groups, method_sort_key, model_sort_key  # noqa: E402

# Okabe-Ito colour-blind-safe palette: fixed colours for the paper's methods, the rest for any other method.
FIXED_COLORS = {"adamw": "#0072B2", "qlora": "#E69F00", "galore": "#009E73", "apollo": "#CC79A7", "hmt": "#D55E00"}
SPARE_COLORS = ("#56B4E9", "#F0E442", "#000000", "#999999", "#8C564B", "#17BECF")
MODEL_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
CATEGORY_COLORS = dict(zip(CATEGORIES, ("#4D4D4D", "#8C8C8C", "#B3B3B3", "#6BAED6", "#C6DBEF", "#E5E5E5")))


LEGEND_ROW_IN = 0.2  # inches per legend line (x-small type, with the spacing between entries)
LEGEND_COLUMN_IN = 3.4  # inches per legend column beside a panel
LEGEND_MAX_LINES = 36  # legend lines per column: a longer legend (a whole results tree) takes more columns


def method_colors(methods) -> dict[str, str]:
    others = sorted({m for m in methods if m not in FIXED_COLORS}, key=method_sort_key)
    spare = {m: SPARE_COLORS[i % len(SPARE_COLORS)] for i, m in enumerate(others)}
    return {**FIXED_COLORS, **spare}


def models_in(frame: pd.DataFrame) -> list[str]:
    return sorted(frame["model"].dropna().unique(), key=model_sort_key)


def methods_in(frame: pd.DataFrame) -> list[str]:
    return sorted(frame["method"].dropna().unique(), key=method_sort_key)


def legend_columns(lines: int) -> tuple[int, int]:
    """(columns, lines per column) of a legend of ``lines`` lines, at most ``LEGEND_MAX_LINES`` lines a column,
    so that a figure holding every setting of a results tree stays a page tall."""
    columns = max(1, math.ceil(lines / LEGEND_MAX_LINES))
    return columns, math.ceil(lines / columns)


def panel_subplots(n: int, width: float = 5.0, height: float = 3.8) -> tuple[Figure, list]:
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False, layout="constrained")
    return fig, list(axes[0])


def _variant_column(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with a ``variant`` column of strings ("" for the only setting of a method and model)."""
    return frame.assign(variant=frame["variant"].fillna("") if "variant" in frame else "")


def seed_band(rows: pd.DataFrame, key: str) -> pd.DataFrame:
    """Per logged step: ``mean``, ``std`` (sample, ddof 1; NaN with one seed) and ``n`` of ``key`` over the runs
    (seeds) in ``rows``, at the steps where every run logged it."""
    wide = rows.dropna(subset=[key]).pivot_table(index="step", columns="run_id", values=key, aggfunc="last")
    wide = wide.dropna().astype(float)
    return pd.DataFrame({"mean": wide.mean(axis=1), "std": wide.std(axis=1, ddof=1), "n": wide.shape[1]})


MAX_CURVES = 12  # a model with more settings (a whole tree: searches beside seeds) draws each method's tuned one
EARLY = 0.1  # the y-axis is fitted to the curves after this share of training when the start would squash them


def shown_settings(data: pd.DataFrame) -> tuple[list[tuple[tuple, pd.DataFrame]], int]:
    """(the (method, variant) groups to draw, how many there were). Up to ``MAX_CURVES`` all; past that (a
    tree holding learning-rate searches beside the tuned rows' seeds), the settings with the most runs: the tuned
    rows, each searched at seed 0 and run with its seeds; when those are still too many, each method's with the
    lowest final validation loss among them."""
    found = groups(data, ("method", "variant"))
    if len(found) <= MAX_CURVES:
        return found, len(found)
    most = max(g["run_id"].nunique() for _, g in found)
    tuned = [(key, g) for key, g in found if g["run_id"].nunique() == most]
    if len(tuned) <= MAX_CURVES:
        return tuned, len(found)

    def final(rows: pd.DataFrame) -> float:
        last = rows.dropna(subset=["loss/val"]).sort_values("step").groupby("run_id")["loss/val"].last() \
            if "loss/val" in rows else pd.Series(dtype=float)
        return float(last.mean()) if len(last) else math.inf

    best: dict = {}
    for key, g in tuned:
        if key[0] not in best or final(g) < final(best[key[0]][1]):
            best[key[0]] = (key, g)
    return [kg for kg in tuned if best[kg[0][0]][0] == kg[0]], len(found)  # by key: best holds new tuples


def clip_early(ax, curves: list[pd.DataFrame], last_step: float) -> bool:
    """Fits the y-axis to the plotted means after ``EARLY`` of training when the first steps (a loss of ~8 nats
    at initialisation, an early spike) reach more than a whole later range above it; whether it clipped."""
    late = [c.loc[c.index >= EARLY * last_step, "mean"] for c in curves if len(c)]
    late = pd.concat(late) if late else pd.Series(dtype=float)
    whole = pd.concat([c["mean"] for c in curves if len(c)]) if curves else pd.Series(dtype=float)
    if late.empty or not np.isfinite(late).any():
        return False
    low, high = float(late.min()), float(late.max())
    span = max(high - low, 1e-3)
    if float(whole.max()) <= high + span:
        return False
    ax.set_ylim(low - 0.05 * span, high + 0.08 * span)
    return True


def _draw_setting(ax, rows: pd.DataFrame, style, label: str) -> list[pd.DataFrame]:
    """One setting's train mean (light) and validation mean with its ±1 sample-std band; the curves drawn."""
    train = seed_band(rows, "loss/train")
    ax.plot(train.index, train["mean"], color=style.color, lw=0.8, ls=style.linestyle, alpha=0.3)
    val = seed_band(rows, "loss/val") if "loss/val" in rows else pd.DataFrame()
    if len(val):
        ax.plot(val.index, val["mean"], color=style.color, lw=1.6, ls=style.linestyle, marker=style.marker, ms=4,
                label=label)
        band = val.dropna(subset=["std"])
        if len(band):
            ax.fill_between(band.index, band["mean"] - band["std"], band["mean"] + band["std"], color=style.color,
                            alpha=0.15, lw=0)
    return [train, val]


def loss_curves_figure(results: Results, colors: dict) -> dict[str, Figure]:
    """One panel per model: per method and setting, the validation loss's mean over seeds with a shaded ±1 std
    band (sample std over seeds, where there are two or more) and the training loss's mean as a lighter line.
    A model with more than ``MAX_CURVES`` settings draws each method's tuned one (``shown_settings``); the
    y-axis leaves out the first steps when they would squash the rest (``clip_early``); the title says both."""
    runs = _variant_column(results.completed())
    runs = runs[runs["mode"] == "train"][["run_id", "method", "model", "variant"]]
    if runs.empty or results.metrics.empty or "loss/train" not in results.metrics:
        return {}
    data = results.metrics.merge(runs, on="run_id")
    if data.empty:
        return {}
    models = models_in(data)
    styles = setting_styles(runs, colors)
    shown = {m: shown_settings(data[data["model"] == m]) for m in models}
    lines = max(sum(len(textwrap.wrap(setting_label(*key), 34)) or 1 for key, _ in shown[m][0]) for m in models)
    columns, per_column = legend_columns(lines + 2)
    fig, axes = panel_subplots(len(models), width=4.1 + LEGEND_COLUMN_IN * columns,
                               height=max(4.6, LEGEND_ROW_IN * per_column + 1.0))
    for ax, model in zip(axes, models):
        settings, total = shown[model]
        curves = [c for (method, variant), rows in settings for c in _draw_setting(
            ax, rows, styles[(method, variant)], textwrap.fill(setting_label(method, variant), 34))]
        seeds = sorted({g["run_id"].nunique() for _, g in settings})
        seeds_text = str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]}"
        notes = [f"{seeds_text} seed(s) per setting"]
        notes += [f"the {len(settings)} most-seeded (tuned) of {total} settings"] if len(settings) < total else []
        notes += [f"y-axis from {EARLY:.0%} of training"] if clip_early(ax, curves, data["step"].max()) else []
        ax.set(title=textwrap.fill(f"model {model} ({'; '.join(notes)})", 60), xlabel="optimizer step",
               ylabel="loss (cross-entropy, nats/token)")
        ax.grid(alpha=0.3)
        handles, _ = ax.get_legend_handles_labels()
        kinds = [Line2D([], [], color="black", lw=1.6, label="validation (mean, ±1 sample std band)"),
                 Line2D([], [], color="black", lw=0.8, alpha=0.3, label="train (mean)")]
        ax.legend(handles=handles + kinds, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  borderaxespad=0, ncols=columns)
    fig.suptitle("Loss curves (mean over seeds, band ±1 sample std over seeds)")
    return {"loss_curves": fig}


def pareto_front_min(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated by another with less or equal memory and less or equal loss (ascending memory)."""
    front, best = [], np.inf
    for mem, loss in sorted(points):
        if loss < best:
            front.append((mem, loss))
            best = loss
    return front


def _loss_memory_label(number: int, setting: tuple[str, str], runs: pd.DataFrame) -> str:
    return textwrap.fill(f"{number}: {setting_label(*setting)}, {runs['seed'].nunique()} seed(s)", 40)


LOSS_MEMORY_AXES = (("optim_state_bytes", "optimizer state (MiB)", 2**20), ("peak_bytes", "peak memory (GiB)", GIB))


def loss_memory_figure(results: Results, colors: dict) -> dict[str, Figure]:
    """Rows: models; columns: optimizer state (``method_summary['optim/state_bytes']``) and peak memory. Each
    method and setting is one point at its seed means, with ±1 std (sample, over seeds) error bars in validation
    loss, numbered (the legend gives the settings); the dotted line joins the points no other point beats in
    both memory and loss (``pareto_front_min``) within the model."""
    runs = _variant_column(results.completed())
    runs = runs[runs["mode"] == "train"].dropna(subset=["val_loss"])
    panels = [(c, label, scale) for c, label, scale in LOSS_MEMORY_AXES if c in runs and runs[c].notna().any()]
    if runs.empty or not panels:
        return {}
    models = models_in(runs)
    styles = setting_styles(runs, colors)
    most = max(sum(len(_loss_memory_label(0, key, g).splitlines()) for key, g in groups(
        runs[runs["model"] == m], ("method", "variant"))) for m in models)  # legend lines beside a row
    columns, per_column = legend_columns(most + 1)
    row_height = max(3.9, LEGEND_ROW_IN * per_column + 1.0)  # room for a legend of every setting beside the row
    fig, grid = plt.subplots(len(models), len(panels), squeeze=False, layout="constrained",
                             figsize=(5.2 * len(panels) + LEGEND_COLUMN_IN * columns, row_height * len(models)))
    for axes, model in zip(grid, models):
        settings = groups(runs[runs["model"] == model], ("method", "variant"))
        handles = []
        for ax, (column, label, scale) in zip(axes, panels):
            points, numbered = [], []
            for number, ((method, variant), g) in enumerate(settings, start=1):
                mem = g[column].astype(float).mean() / scale
                loss, std = g["val_loss"].astype(float).mean(), g["val_loss"].astype(float).std(ddof=1)
                if not np.isfinite(mem):
                    continue
                points.append((mem, loss))
                style = styles[(method, variant)]
                ax.errorbar([mem], [loss], yerr=[std] if np.isfinite(std) else None, color=style.color,
                            marker=style.marker, ms=6, mec="black", mew=0.5, capsize=3, ls="", zorder=3)
                numbered.append((mem, loss, number))
                if column == panels[0][0]:
                    handles.append(Line2D([], [], color=style.color, marker=style.marker, ls="", mec="black",
                                          mew=0.5, label=_loss_memory_label(number, (method, variant), g)))
            front = pareto_front_min(points)
            ax.plot([p[0] for p in front], [p[1] for p in front], color="grey", ls=":", lw=1.2, zorder=2)
            xs = [p[0] for p in points]
            if xs and min(xs) > 0 and max(xs) / min(xs) > 20:
                ax.set_xscale("log")
            number_points(ax, numbered)
            ax.set(xlabel=label, ylabel="validation loss (nats/token), mean ± std", title=f"model {model}")
            ax.grid(alpha=0.3)
        handles.append(Line2D([], [], color="grey", ls=":", label="Pareto front (lower memory and loss)"))
        axes[-1].legend(handles=handles, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0),
                        ncols=columns)
    fig.suptitle("Validation loss vs memory: each point the mean over its seeds, error bars ±1 sample std over "
                 "them\n(seed count per setting in the legend; nearby points share one number label)")
    return {"pareto_val_loss_vs_memory": fig}


def _pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated by one with less (or equal) memory and more throughput."""
    return [(mem, -negated) for mem, negated in pareto_front_min([(mem, -tps) for mem, tps in points])]


def pareto_figure(results: Results, colors: dict) -> dict[str, Figure]:
    """Throughput vs peak memory, one panel per model: each method and setting a numbered point at its seed
    means (the legend, outside the panels, names the numbers); the dotted line joins the points no other beats
    with less memory and more throughput."""
    runs = _variant_column(results.completed())
    runs = runs[(runs["mode"] == "train")].dropna(subset=["peak_bytes", "tokens_per_s"])
    if runs.empty:
        return {}
    styles = setting_styles(runs, colors)
    models = models_in(runs)
    labels = {(model, number): textwrap.fill(f"{model} {number}: {setting_label(method, variant)}, "
                                             f"{g['seed'].nunique()} seed(s)", 40)
              for model in models for number, ((method, variant), g) in enumerate(
                  groups(runs[runs["model"] == model], ("method", "variant")), start=1)}
    columns, per_column = legend_columns(sum(len(label.splitlines()) for label in labels.values()) + 1)
    fig, axes = panel_subplots(len(models), width=5.0, height=max(4.4, LEGEND_ROW_IN * per_column + 1.0))
    fig.set_size_inches(5.0 * len(models) + LEGEND_COLUMN_IN * columns, fig.get_size_inches()[1])
    handles = {}
    for ax, model in zip(axes, models):
        points, numbered = [], []
        for number, ((method, variant), g) in enumerate(groups(runs[runs["model"] == model], ("method", "variant")),
                                                        start=1):
            mem, tps = g["peak_bytes"].astype(float).mean() / GIB, g["tokens_per_s"].astype(float).mean()
            points.append((mem, tps))
            style = styles[(method, variant)]
            ax.scatter([mem], [tps], color=style.color, marker=style.marker, s=55, edgecolor="black", lw=0.5,
                       zorder=3)
            numbered.append((mem, tps, number))
            handles[(model, number)] = Line2D([], [], color=style.color, marker=style.marker, ls="", mec="black",
                                              mew=0.5, label=labels[(model, number)])
        front = _pareto_front(points)
        ax.plot([p[0] for p in front], [p[1] for p in front], color="grey", ls=":", lw=1, zorder=2)
        ax.margins(0.12)
        number_points(ax, numbered)
        ax.set(xlabel="peak memory (GiB)", ylabel="throughput (tokens/s)",
               title=f"Throughput vs peak memory, model {model}\n(means over seeds, no error bars; seeds in "
                     "the legend)")
        ax.grid(alpha=0.3)
    front_handle = [Line2D([], [], color="grey", ls=":", label="Pareto front (less memory, more tokens/s)")]
    fig.legend(handles=list(handles.values()) + front_handle, fontsize="x-small", loc="outside right upper",
               ncols=columns)
    return {"pareto_tokens_per_s_vs_peak_memory": fig}


def _tick(method: str, mode: str, variant: str) -> str:
    """A bar's label: the method, then its setting and mode, wrapped to the bar's width."""
    return "\n".join([method] + textwrap.wrap(variant + ("" if mode == "train" else f" ({mode})"), 10,
                                               break_long_words=False))


def memory_category_figure(results: Results, colors: dict) -> dict[str, Figure]:
    runs = _variant_column(results.completed())
    columns = [f"peak_{c}_bytes" for c in CATEGORIES]
    runs = runs.dropna(subset=columns, how="all")
    if runs.empty:
        return {}
    models = models_in(runs)
    counts = [len(groups(runs[runs["model"] == model], ("method", "mode", "variant"))) for model in models]
    lines = max(len(_tick(m, mode, v).splitlines()) for m, mode, v in zip(runs["method"].astype(str),
                                                                          runs["mode"].astype(str), runs["variant"]))
    # horizontal, wrapped tick labels (rotated ones moved the layout by float rounding between processes)
    fig, grid = plt.subplots(1, len(models), figsize=(0.9 * sum(counts) + 1.4 * len(models) + 1.6,
                                                      4.8 + 0.17 * lines),
                             squeeze=False, layout="constrained", gridspec_kw={"width_ratios": counts})
    for ax, model in zip(grid[0], models):
        keys = ("method", "mode", "variant")
        bars = [(_tick(method, mode, variant), g)
                for (method, mode, variant), g in groups(runs[runs["model"] == model], keys)]
        bottom = np.zeros(len(bars))
        for category, column in zip(CATEGORIES, columns):
            heights = np.array([np.nan_to_num(g[column].astype(float).mean()) / GIB for _, g in bars])
            ax.bar(range(len(bars)), heights, bottom=bottom, color=CATEGORY_COLORS[category], edgecolor="black",
                   lw=0.4, label=category)
            bottom += heights
        ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize="small")
        for tick, (_, g) in zip(ax.get_xticklabels(), bars):
            tick.set_color(colors[g["method"].iloc[0]])
        ax.set(title=f"model {model}", ylabel="memory at peak step (GiB)", xlabel="method: setting")
    handles, labels = grid[0][0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], title="category", fontsize="small", loc="outside right center")
    fig.suptitle("Peak memory by category (each bar the mean over its runs' seeds; no error bars)")
    return {"memory_by_category": fig}


MAX_MODEL_PANELS = 3  # a figure with a panel (or row) per model draws more models one figure per model
MAX_SETTINGS = 40  # a model with more settings (a whole results tree's searches) gets no such figure: unreadable


def one_model(results: Results, model: str) -> Results:
    """``results`` restricted to ``model``'s runs (every table keyed by ``run_id``)."""
    ids = set(results.runs.loc[results.runs["model"] == model, "run_id"])
    tables = {name: getattr(results, name) for name in ("metrics", "ranks", "rank_hist", "activations")}
    return Results(runs=results.runs[results.runs["run_id"].isin(ids)], warnings=results.warnings,
                   **{name: t[t["run_id"].isin(ids)] if "run_id" in t else t for name, t in tables.items()})


def _settings(results: Results, model: str) -> int:
    runs = _variant_column(results.completed())
    return len(groups(runs[runs["model"] == model], ("method", "variant")))


FigureMaker = Callable[[Results, dict], dict[str, Figure | str]]  # name -> figure, or why it was not drawn


def per_model(make: FigureMaker) -> FigureMaker:
    """``make`` as is for at most ``MAX_MODEL_PANELS`` models; for more (a whole results tree), once per model,
    each figure named ``<name>_<model>``, so that no figure grows wider or taller than a page or two. A model with
    more than ``MAX_SETTINGS`` settings is not drawn: the reason takes the figure's place."""

    def made(results: Results, colors: dict) -> dict[str, Figure | str]:
        models = models_in(results.runs) if len(results.runs) else []
        crowded = {m: n for m in models if (n := _settings(results, m)) > MAX_SETTINGS}
        if len(models) <= MAX_MODEL_PANELS and not crowded:
            return make(results, colors)
        name = make.__name__.removesuffix("_figure")
        out: dict[str, Figure | str] = {}
        for model in models:
            if model in crowded:
                out[f"{name}_{model}"] = (f"{crowded[model]} settings of model {model}, more than a legend can name "
                                          f"({MAX_SETTINGS}): report one campaign's folder at a time")
            else:
                out.update({f"{key}_{model}": fig for key, fig in make(one_model(results, model), colors).items()})
        return out

    made.__name__ = make.__name__
    return made


def save(fig: Figure, out_dir: Path, name: str) -> list[Path]:
    """``<name>.png`` and ``<name>.pdf``, without timestamps in their metadata."""
    out_dir.mkdir(parents=True, exist_ok=True)
    png, pdf = out_dir / f"{name}.png", out_dir / f"{name}.pdf"
    fig.savefig(png, dpi=150, metadata={"Software": None})
    fig.savefig(pdf, metadata={"CreationDate": None, "ModDate": None})
    plt.close(fig)
    return [png, pdf]
