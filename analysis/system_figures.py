"""The report's systems figures (matplotlib, Agg), beside ``analysis.figures``' loss and memory figures: per-layer
ranks over training and their distribution, activation compression error by component, and host-device traffic and
checkpoint sizes. Each ``*_figure`` function returns ``{name: Figure}``, empty when the results hold no data for it.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from analysis.figures import methods_in, models_in, panel_subplots  # noqa: E402
from analysis.load import Results  # noqa: E402
from analysis.tables import GIB, groups, model_sort_key  # noqa: E402


def _rank_grid(ranks: pd.DataFrame) -> tuple[list[str], list[int], np.ndarray]:
    """Layers x steps of ranks; a layer keeps its last recorded rank until the next record."""
    layers = sorted(ranks["layer"].unique())
    steps = sorted(ranks["step"].unique())
    grid = ranks.pivot_table(index="layer", columns="step", values="rank", aggfunc="last")
    grid = grid.reindex(index=layers, columns=steps).ffill(axis=1)
    return layers, steps, grid.to_numpy(dtype=float)


def rank_figures(results: Results, colors: dict) -> dict[str, Figure]:
    if results.ranks.empty:
        return {}
    runs = results.completed()[["run_id", "method", "model", "seed", "steps"]]
    ranks = results.ranks.merge(runs, on="run_id")
    figures = {}
    for (method, model), g in groups(ranks):
        run_id = g.sort_values(["seed", "run_id"])["run_id"].iloc[0]
        seed = g[g["run_id"] == run_id]["seed"].iloc[0]
        layers, steps, grid = _rank_grid(g[g["run_id"] == run_id])
        fig, ax = plt.subplots(figsize=(7.5, max(2.5, 0.22 * len(layers) + 1.5)), layout="constrained")
        total = g[g["run_id"] == run_id]["steps"].iloc[0]  # the last record holds until training ends
        end = float(total) if pd.notna(total) and total > steps[-1] else steps[-1] + 1
        x_edges = np.array(list(steps) + [end], dtype=float)  # a rank holds from its record to the next
        image = ax.pcolormesh(x_edges, np.arange(len(layers) + 1) - 0.5, grid, cmap="viridis")
        ax.invert_yaxis()
        ax.set_yticks(range(len(layers)), layers if len(layers) <= 48 else [""] * len(layers), fontsize="x-small")
        ax.set(xlabel="optimizer step", ylabel="layer", title=f"{method} on {model}: rank per layer (seed {seed})")
        fig.colorbar(image, ax=ax, label="rank (dimensions)")
        figures[f"rank_heatmap_{method}_{model}"] = fig
    if not results.rank_hist.empty:
        hist = results.rank_hist.merge(runs, on="run_id")
        fig, ax = plt.subplots(figsize=(6.4, 4), layout="constrained")
        methods = methods_in(hist)
        all_ranks = sorted(hist["rank"].unique())
        width = 0.8 / max(len(methods), 1)
        for i, method in enumerate(methods):
            counts = hist[hist["method"] == method].groupby("rank")["count"].sum().reindex(all_ranks, fill_value=0)
            share = counts / counts.sum() if counts.sum() else counts
            ax.bar(np.arange(len(all_ranks)) + (i - (len(methods) - 1) / 2) * width, share.values, width,
                   color=colors[method], label=method)
        ax.set_xticks(range(len(all_ranks)), [str(r) for r in all_ranks])
        ax.set(xlabel="rank (dimensions)", ylabel="share of basis refreshes (all layers)",
               title="Rank distribution over training\n(every refresh of every run and seed, pooled)")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        figures["rank_distribution"] = fig
    return figures


def _grouped_bars(ax, frame: pd.DataFrame, category: str, value: str, colors: dict, scale: float = 1.0) -> None:
    categories = sorted(frame[category].unique(), key=model_sort_key if category == "model" else str)
    methods = methods_in(frame)
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        means = frame[frame["method"] == method].groupby(category)[value].mean().reindex(categories)
        ax.bar(np.arange(len(categories)) + (i - (len(methods) - 1) / 2) * width, means.values / scale, width,
               color=colors[method], label=method, edgecolor="black", lw=0.4)
    ax.set_xticks(range(len(categories)), [str(c) for c in categories])
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(axis="y", alpha=0.3)


def activation_error_figure(results: Results, colors: dict) -> dict[str, Figure]:
    acts = results.activations.dropna(subset=["rel_err"]) if len(results.activations) else results.activations
    if acts.empty:
        return {}
    acts = acts.merge(results.completed()[["run_id", "method", "model"]], on="run_id")
    models = models_in(acts)
    fig, axes = panel_subplots(len(models), width=6.0)
    for ax, model in zip(axes, models):
        frame = acts[acts["model"] == model].assign(rel_err=lambda f: f["rel_err"].astype(float))
        _grouped_bars(ax, frame, "component", "rel_err", colors)
        if (frame["rel_err"] > 0).all() and frame["rel_err"].max() / frame["rel_err"].min() > 100:
            ax.set_yscale("log")
        ax.set(title=f"model {model}", xlabel="activation component",
               ylabel="relative error ‖x̂−x‖/‖x‖ (dimensionless)")
    fig.suptitle("Activation compression error by component (mean over the runs' seeds; no error bars)")
    return {"activation_error": fig}


def transfer_figure(results: Results, colors: dict) -> dict[str, Figure]:
    runs = results.completed()
    panels = [(c, label) for c, label in (("host_device_bytes", "host↔device traffic (GiB)"),
                                          ("checkpoint_bytes", "checkpoint size (GiB)"))
              if c in runs and (pd.to_numeric(runs[c], errors="coerce").fillna(0) != 0).any()]  # all 0: nothing to draw
    if not panels:
        return {}
    fig, axes = panel_subplots(len(panels))
    for ax, (column, label) in zip(axes, panels):
        frame = runs.dropna(subset=[column]).assign(**{column: lambda f, c=column: f[c].astype(float)})
        _grouped_bars(ax, frame, "model", column, colors, scale=GIB)
        ax.set(xlabel="model", ylabel=label, title=label.split(" (")[0])
    fig.suptitle("Host-device traffic and checkpoint sizes (mean over the runs' seeds; no error bars)")
    return {"transfers_and_checkpoints": fig}
