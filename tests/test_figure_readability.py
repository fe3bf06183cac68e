"""The report's figures stay readable with many settings: nearby Pareto points share one number label
(``analysis.point_labels``), a model with searches beside its tuned rows draws only the tuned rows and the first
steps do not squash the y-axis (``analysis.figures.shown_settings``, ``clip_early``), and every figure with a band
or error bars says what they are and over how many seeds."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis import figures  # noqa: E402
from analysis.load import Results  # noqa: E402
from analysis.point_labels import clusters, number_points  # noqa: E402


def test_points_closer_than_the_threshold_on_both_axes_share_a_label() -> None:
    xy = np.array([[0.10, 0.10], [0.13, 0.12], [0.16, 0.15], [0.50, 0.10], [0.50, 0.50]])
    # 0 -> 1 -> 2 chain (each step 0.03 < 0.045 on both axes), 3 is 0.34 away in x, 4 is 0.40 away in y from 3
    assert clusters(xy, 0.045) == [[0, 1, 2], [3], [4]], clusters(xy, 0.045)
    fig, ax = plt.subplots()
    ax.set(xlim=(0, 10), ylim=(0, 10))
    ax.set_autoscale_on(False)
    labels = number_points(ax, [(1.0, 1.0, 7), (1.3, 1.2, 2), (5.0, 1.0, 3), (5.0, 5.0, 4)])
    assert labels == ["2, 7", "3", "4"], labels
    plt.close(fig)


def _metrics(runs: dict[str, tuple[str, str, float]], steps: int = 10) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One row per run (method, variant, final loss): loss 8 at step 0 falling linearly to the final loss."""
    meta = pd.DataFrame([{"run_id": r, "method": m, "model": "tiny", "variant": v, "status": "completed",
                          "mode": "train", "seed": i} for i, (r, (m, v, _)) in enumerate(runs.items())])
    rows = [{"run_id": r, "step": s, "loss/train": 8.0 - (8.0 - end) * s / steps,
             "loss/val": 8.0 - (8.0 - end) * s / steps} for r, (_, _, end) in runs.items() for s in range(steps + 1)]
    return meta, pd.DataFrame(rows)


def test_many_settings_draw_the_most_seeded_ones() -> None:
    runs = {f"search-{i}": ("hmt", f"lr={i}", 5.0 + i / 10) for i in range(12)}
    runs |= {f"tuned-s{s}": ("hmt", "lr=3", 5.3) for s in range(1, 4)}  # with search-3 (seed 0): 4 runs
    runs |= {f"adamw-s{s}": ("adamw", "lr=1", 5.5) for s in range(4)}
    meta, metrics = _metrics(runs)
    data = metrics.merge(meta[["run_id", "method", "model", "variant"]], on="run_id")
    shown, total = figures.shown_settings(data)
    keys = [key for key, _ in shown]
    assert total == 13 and keys == [("adamw", "lr=1"), ("hmt", "lr=3")], (total, keys)


def test_the_start_is_clipped_only_when_it_squashes_the_rest() -> None:
    fig, ax = plt.subplots()
    steep = pd.DataFrame({"mean": [8.0, 5.2, 5.1, 5.0]}, index=[0, 10, 50, 100])
    # after 10 % of training the curve spans 5.0-5.2 (0.2); the start at 8.0 is 2.8 above: clipped to the late span
    assert figures.clip_early(ax, [steep], 100)
    low, high = ax.get_ylim()
    assert abs(low - (5.0 - 0.05 * 0.2)) < 1e-12 and abs(high - (5.2 + 0.08 * 0.2)) < 1e-12, (low, high)
    fig2, ax2 = plt.subplots()
    gentle = pd.DataFrame({"mean": [6.0, 5.5, 5.0]}, index=[0, 10, 100])  # 6.0 is within one late span (0.5) of 5.5
    assert not figures.clip_early(ax2, [gentle], 100)
    plt.close(fig)
    plt.close(fig2)


def test_loss_and_pareto_figures_state_their_bars_and_seed_counts() -> None:
    meta, metrics = _metrics({f"r{s}": ("hmt", "", 5.0 + s / 100) for s in range(3)})
    meta = meta.assign(val_loss=[5.0, 5.01, 5.02], optim_state_bytes=2**20, peak_bytes=2**30, tokens_per_s=10.0)
    empty = pd.DataFrame()
    results = Results(runs=meta, metrics=metrics, ranks=empty, rank_hist=empty, activations=empty)
    colors = figures.method_colors(["hmt"])
    curves = figures.loss_curves_figure(results, colors)["loss_curves"]
    assert "±1 sample std" in curves._suptitle.get_text() and "3 seed(s)" in curves.axes[0].get_title()
    memory = figures.loss_memory_figure(results, colors)["pareto_val_loss_vs_memory"]
    assert "error bars ±1 sample std" in memory._suptitle.get_text(), memory._suptitle.get_text()
    legend = [t.get_text() for t in memory.axes[-1].get_legend().get_texts()]
    assert any("3 seed(s)" in t for t in legend), legend
    speed = figures.pareto_figure(results, colors)["pareto_tokens_per_s_vs_peak_memory"]
    assert "no error bars" in speed.axes[0].get_title(), speed.axes[0].get_title()
    assert any("3 seed(s)" in t.get_text() for t in speed.legends[0].get_texts())
    for fig in (curves, memory, speed):
        plt.close(fig)
