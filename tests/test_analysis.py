"""analysis.report on a synthetic results/ tree written in the runner's schema (no training needed).

What is proven: every table (Markdown + LaTeX) and figure (PNG + PDF) is produced, the numbers in the main table
are the seed means of what the runs wrote, failed/running runs stay out of the numbers but appear in the runs
table, absent optional keys show as "—", a method has one colour in every figure, the output is byte-for-byte
deterministic, and --readme / --check-readme keep a page's table in sync (including the committed one in
docs/results.md).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from analysis import figures, main_table, report, system_figures, tables
from analysis.load import load_results

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
CATS = ("params", "grads", "optimizer", "activations", "temp", "other")


def write_run(root: Path, run_id: str, *, method: str, model: str, seed: int, mode: str = "train",
              status: str = "completed", peak_gib: float = 1.0, tps: float | None = 1000.0, val: float | None = 3.0,
              extra: dict | None = None, drop: tuple[str, ...] = (), metric_extra: dict | None = None) -> Path:
    run = root / run_id
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"method": {"name": method}, "model": {"name": model},
                                                     "seed": seed, "mode": mode, "run_id": run_id}))
    (run / "status").write_text(status + "\n")
    if status == "failed":
        (run / "error.txt").write_text("Traceback (most recent call last):\nRuntimeError: CUDA out of memory\n")
    if status != "completed":
        return run
    steps = 4
    lines = [{"step": s, "loss/train": 5.0 - 0.5 * s + 0.01 * seed, "lr": 1e-3, "throughput/tokens_per_s": tps,
              "time/step_s": 0.1, "memory/peak(GiB)": peak_gib, **({"loss/val": 5.1 - 0.5 * s} if s % 2 else {}),
              **(metric_extra or {})}
             for s in range(steps)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    by_cat = {c: int(peak_gib * GIB / len(CATS)) for c in CATS}
    summary = {"run_id": run_id, "method": method, "model": model, "mode": mode, "device": "cuda", "seed": seed,
               "params_total": 125_000_000, "params_trainable": 125_000_000, "steps": steps, "tokens": 4096,
               "tokens_per_s": tps, "step_time_s": 0.1 if tps else None, "train_loss": 3.5,
               "val_loss": val if mode == "train" else None,
               "memory": {"peak_bytes": int(peak_gib * GIB), "avg_bytes": int(peak_gib * GIB * 0.75),
                          "peak_by_category_bytes": by_cat, "avg_by_category_bytes": by_cat, "source": "fake",
                          "peak_by_phase_bytes": {"forward": GIB, "backward": 2 * GIB, "optimizer": GIB}},
               "cpu_rss_peak_bytes": 3 * GIB, "host_device_bytes": GIB // 2, "checkpoint_bytes": 2 * GIB,
               "git_sha": "abc", "versions": {"torch": "2.13"}, "method_summary": {}, **(extra or {})}
    for key in drop:
        summary.pop(key, None)
    (run / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return run


HMT_EXTRA = {  # what hmt_core writes (rank/history, probe) today
    "method_summary": {"rank/histogram_all_refreshes": {"32": 6, "64": 2}, "rank/histogram_current": {"32": 2},
                       "rank/history": {"layers.0.mlp": [[0, 64], [2, 32]], "layers.1.attn": [[0, 64], [3, 32]]}},
    "activation_summary": {"policy": {"attn_out": "fp8"}, "saved_bytes": {"attn": 2 * 2**20, "mlp": 4 * 2**20},
                           "probe": {"act/attn/saved(bytes)": 2.0 * 2**20, "act/total/saved(bytes)": 6.0 * 2**20,
                                     "act/attn/rel_err": 0.02, "act/mlp/rel_err": 0.005, "act/grad_cos": 0.999,
                                     "act/attn/grad_cos": 0.9995}},
}


def write_fixture_results(root: Path) -> Path:
    for seed, val in ((0, 3.0), (1, 3.2)):
        write_run(root, f"adamw-125m-s{seed}", method="adamw", model="125m", seed=seed, peak_gib=4.0, val=val)
        write_run(root, f"hmt-125m-s{seed}", method="hmt", model="125m", seed=seed, peak_gib=1.5, tps=800.0,
                  extra=HMT_EXTRA)
    write_run(root, "adamw-tiny-s0", method="adamw", model="tiny", seed=0, peak_gib=0.5, drop=("checkpoint_bytes",))
    write_run(root, "newopt-125m-s0", method="newopt", model="125m", seed=0, peak_gib=2.0, tps=None,
              drop=("activation_summary", "checkpoint_bytes", "host_device_bytes"))
    write_run(root, "galore-1b-dry", method="galore", model="1b", seed=0, mode="dryrun", peak_gib=9.0, val=None)
    write_run(root, "galore-125m-failed", method="galore", model="125m", seed=0, status="failed")
    write_run(root, "qlora-125m-running", method="qlora", model="125m", seed=0, status="running")
    return root


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    return write_fixture_results(tmp_path / "results")


@pytest.fixture(scope="module")
def full_report(tmp_path_factory) -> tuple[Path, Path]:
    """(results dir, report dir) of one full report run, shared by the tests that only read it."""
    base = tmp_path_factory.mktemp("full")
    results = write_fixture_results(base / "results")
    assert report.main([str(results), "--out", str(base / "report")]) == 0
    return results, base / "report"


def test_report_writes_every_table_and_figure(full_report: tuple[Path, Path]) -> None:
    _, out = full_report
    for name in ("main", "main_systems", "memory_by_category", "memory_by_phase", "transfers", "activation_error",
                 "runs", "flattening"):
        assert (out / "tables" / f"{name}.md").read_text().count("|") > 10, name
        assert "\\begin{tabular}" in (out / "tables" / f"{name}.tex").read_text(), name
    for name in ("loss_curves", "pareto_val_loss_vs_memory", "pareto_tokens_per_s_vs_peak_memory",
                 "memory_by_category", "rank_heatmap_hmt_125m",
                 "rank_distribution", "activation_error", "transfers_and_checkpoints"):
        for suffix in (".png", ".pdf"):
            assert (out / "figures" / f"{name}{suffix}").stat().st_size > 1000, name + suffix
    runs = pd.read_parquet(out / "data" / "runs.parquet")
    assert sorted(runs["status"]) == ["completed"] * 7 + ["failed", "running"]
    metrics = pd.read_parquet(out / "data" / "metrics.parquet")
    assert len(metrics) == 7 * 4 and {"loss/train", "loss/val", "run_id", "step"} <= set(metrics.columns)
    assert len(pd.read_parquet(out / "data" / "ranks.parquet")) == 2 * 4  # 2 hmt runs x 2 layers x 2 records


def test_main_table_is_seed_means_in_report_order(results_dir: Path) -> None:
    table = main_table.main_table(load_results(results_dir))
    by_key = {(row[0], row[1]): row for row in table.rows}
    assert [(r[0], r[1]) for r in table.rows] == [("adamw", "tiny"), ("adamw", "125m"), ("hmt", "125m"),
                                                  ("newopt", "125m")]  # failed/running/dryrun runs are left out
    adamw = by_key[("adamw", "125m")]
    # seeds, lr (not in these configs), loss ± std, exp(3.1), optimizer state (not reported), peak, speed ratios
    assert adamw[2:] == ["2", "—", "3.100 ± 0.141", "22.2", "—", "4.00", "1.00×", "1.00×"], adamw
    assert by_key[("hmt", "125m")][7:] == ["1.50", "0.80×", "1.00×"], by_key[("hmt", "125m")]
    assert by_key[("newopt", "125m")][8:] == ["—", "—"]  # tokens/s and step time absent
    systems = {(row[0], row[1]): row for row in main_table.systems_table(load_results(results_dir)).rows}
    assert systems[("adamw", "125m")][2:] == ["3.00", "1,000", "100.0", "3.00", "0.50", "2.00", "—", "—"]
    assert systems[("hmt", "125m")][-2:] == ["40.0 (32–64)", "2.00e-02"]  # 6×32 + 2×64 over 8 refreshes


def test_absent_keys_show_a_dash_and_failures_are_listed(results_dir: Path) -> None:
    results = load_results(results_dir)
    transfers = {(r[0], r[1], r[2]): r for r in tables.transfer_table(results).rows}
    assert transfers[("newopt", "125m", "train")][3:5] == ["—", "—"]
    assert transfers[("galore", "1b", "dryrun")][3] == "0.500"
    runs = {row[0]: row for row in tables.runs_table(results).rows}
    assert runs["galore-125m-failed"][1] == "failed" and "CUDA out of memory" in runs["galore-125m-failed"][6]
    assert runs["qlora-125m-running"][1:4] == ["running", "qlora", "125m"]
    acts = tables.activation_table(results).rows
    assert acts == [["hmt", "125m", "attn", "2.0", "2.00e-02", "0.9995"],
                    ["hmt", "125m", "mlp", "4.0", "5.00e-03", "—"]]


def test_activation_error_falls_back_to_metrics(tmp_path: Path) -> None:
    write_run(tmp_path, "hmt-tiny-s0", method="hmt", model="tiny", seed=0, drop=("activation_summary",),
              metric_extra={"act/mlp/rel_err": 0.25})
    write_run(tmp_path, "adamw-tiny-s0", method="adamw", model="tiny", seed=0, drop=("activation_summary",))
    acts = load_results(tmp_path).activations
    assert acts[["run_id", "component", "rel_err"]].values.tolist() == [["hmt-tiny-s0", "mlp", 0.25]]
    assert tables.activation_table(load_results(tmp_path)).rows == [["hmt", "tiny", "mlp", "—", "2.50e-01", "—"]]


def test_plain_schema_for_ranks_and_activations(tmp_path: Path) -> None:
    """``rank_history``/``rank_histogram`` and ``{component: {saved_bytes, rel_err}}`` are read as well."""
    write_run(tmp_path, "hmt-tiny-s0", method="hmt", model="tiny", seed=0, extra={
        "method_summary": {"rank_histogram": {"8": 3}, "rank_history": {"l0": [[0, 8], [5, 4]]}},
        "activation_summary": {"mlp": {"saved_bytes": 2**20, "rel_err": 0.1}}})
    results = load_results(tmp_path)
    assert results.ranks[["layer", "step", "rank"]].values.tolist() == [["l0", 0, 8.0], ["l0", 5, 4.0]]
    assert results.rank_hist[["rank", "count"]].values.tolist() == [[8, 3]]
    assert tables.activation_table(results).rows == [["hmt", "tiny", "mlp", "1.0", "1.00e-01", "—"]]


def test_latex_escapes_and_markdown_pipes() -> None:
    table = tables.Table("t", "a_b & c", ["Run", "Val"], [["x_1|2", "3.1 ± 0.2"], ["50%", "—"]])
    tex = tables.to_latex(table)
    assert r"x\_1\textbar{}2 & 3.1 $\pm$ 0.2 \\" in tex and r"50\% & --- \\" in tex and r"a\_b \& c" in tex
    assert "| x_1\\|2 | 3.1 ± 0.2 |" in tables.to_markdown(table)


def test_one_colour_per_method_in_every_figure(results_dir: Path) -> None:
    results = load_results(results_dir)
    colors = figures.method_colors(results.runs["method"].dropna().unique())
    assert colors["hmt"] == figures.FIXED_COLORS["hmt"] and colors["newopt"] not in figures.FIXED_COLORS.values()
    seen: dict[str, set] = {}
    for make in (figures.loss_curves_figure, figures.loss_memory_figure, figures.pareto_figure,
                 system_figures.activation_error_figure,
                 system_figures.transfer_figure, system_figures.rank_figures, figures.memory_category_figure):
        for name, fig in make(results, colors).items():
            for ax in fig.axes:
                if ax.get_label() == "<colorbar>":
                    assert ax.get_ylabel(), f"{name}: colorbar without label"
                    continue
                assert ax.get_xlabel() and ax.get_ylabel(), f"{name}: unlabelled axes"
                legends = [ax.get_legend()] if ax.get_legend() else fig.legends
                assert legends or name.startswith("rank_heatmap"), f"{name}: no legend"
                for legend in legends:
                    for handle, text in zip(legend.legend_handles, legend.get_texts()):
                        method = text.get_text().split(": ")[-1].split(" (")[0].split(",")[0]  # "3: hmt (x), …"
                        if method in colors:
                            color = handle.get_color() if hasattr(handle, "get_color") else handle.get_facecolor()
                            seen.setdefault(method, set()).add(matplotlib_hex(color))
    assert seen and all(found == {colors[m].lower()} for m, found in seen.items()), seen


def matplotlib_hex(color) -> str:
    from matplotlib.colors import to_hex

    if hasattr(color, "__len__") and not isinstance(color, str) and len(color) and hasattr(color[0], "__len__"):
        color = color[0]
    return to_hex(color).lower()


def test_pareto_front_keeps_non_dominated_points() -> None:
    points = [(4.0, 1000.0), (1.5, 800.0), (2.0, 700.0), (9.0, 900.0), (1.5, 600.0)]
    assert figures._pareto_front(points) == [(1.5, 800.0), (4.0, 1000.0)]


def test_report_is_byte_for_byte_deterministic(full_report: tuple[Path, Path], tmp_path: Path) -> None:
    results_dir, a = full_report
    b, copy = tmp_path / "b", tmp_path / "copy"
    shutil.copytree(results_dir, copy)  # another directory, files copied in another order and at other times
    assert report.main([str(copy), "--out", str(b)]) == 0
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    differing = [str(f) for f in files if (a / f).read_bytes() != (b / f).read_bytes()]
    assert differing == [], differing


def test_readme_block_roundtrip(results_dir: Path, tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# HMT\n\nintro\n\n{report.README_BEGIN}\nold table\n{report.README_END}\n\nmore text\n")
    out = str(tmp_path / "report")
    fast = ["--no-figures"]
    assert report.main([str(results_dir), "--out", out, *fast, "--check-readme", str(readme)]) == 1
    assert report.main([str(results_dir), "--out", out, *fast, "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# HMT\n\nintro\n\n") and text.endswith(f"{report.README_END}\n\nmore text\n")
    assert "| adamw | 125m | 2 | — | 3.100 ± 0.141 | 22.2 | — | 4.00 | 1.00× | 1.00× |" in text, text
    assert "old table" not in text
    assert report.main([str(results_dir), "--out", out, *fast, "--check-readme", str(readme)]) == 0
    summary = results_dir / "hmt-125m-s0" / "summary.json"
    summary.write_text(summary.read_text().replace('"val_loss": 3.0', '"val_loss": 2.5'))
    assert report.main([str(results_dir), "--out", out, *fast, "--check-readme", str(readme)]) == 1


def test_committed_results_regenerate_the_results_page_table(tmp_path: Path) -> None:
    """docs/results.md's main table is what the committed tuned campaign gives (speed from its timing runs)."""
    readme, results = REPO / "docs" / "results.md", REPO / "results" / "campaign"
    assert report.README_BEGIN in readme.read_text() and report.README_END in readme.read_text()
    committed = [p for p in results.iterdir() if (p / "summary.json").exists()]
    assert len(committed) >= 30, "the tuned campaign's final runs are committed under results/campaign"
    assert report.main([str(results), "--timing", str(REPO / "results" / "campaign-timing"), "--out", str(tmp_path),
                        "--no-figures", "--check-readme", str(readme)]) == 0


def test_committed_campaign_is_tuned_and_multi_seed() -> None:
    """Every final setting of the committed campaign ran with >= 3 seeds, none of them the search seed, at the
    learning rate with the lowest validation loss among >= 5 searched rates of the same setting."""
    from analysis.load import load_results

    final = load_results(REPO / "results" / "campaign").completed()
    search = load_results(REPO / "results" / "campaign-lr-search").runs
    checked = 0
    for setting, runs in final.groupby("setting_sans_lr"):
        rates = search[search["setting_sans_lr"] == setting]
        if runs["lr"].isna().all() or rates.empty:  # an ablation at another row's tuned rate: no search of its own
            continue
        losses = {float(lr): (float(v) if s == "completed" else math.inf)
                  for lr, v, s in zip(rates["lr"], rates["val_loss"], rates["status"])}
        best = min(sorted(losses), key=lambda lr: losses[lr])
        label = f"{runs['method'].iloc[0]} {runs['model'].iloc[0]} {runs['variant'].iloc[0]}"
        assert len(losses) >= 5 and runs["seed"].nunique() >= 3, (label, losses, list(runs["seed"]))
        assert set(runs["lr"].astype(float)) == {best}, (label, losses, set(runs["lr"]))
        assert not set(runs["seed"]) & set(rates["seed"]), (label, set(runs["seed"]), set(rates["seed"]))
        checked += 1
    assert checked >= 10, f"only {checked} tuned settings found"


# A basis refresh happens before the updates at steps 0, K, 2K, …: ⌈steps / K⌉ of them.
REFRESH_KEYS = {"galore": "update_proj_gap", "apollo": "update_proj_gap", "hmt": "update_interval"}


def test_committed_projected_runs_train_through_several_basis_refreshes() -> None:
    """A reference run that only ever sees its first basis says nothing about refreshes (moment policy, rank
    changes, the limiter after a basis change): every projected run must refresh at least three times, by its
    configuration, and HMT's runs by their own logged count (``optim/basis_refreshes`` counts refreshed matrices,
    so the last record holds ⌈steps / K⌉ × the first step's count)."""
    runs = [p for p in (REPO / "results" / "reference").iterdir() if (p / "config.yaml").exists()]
    seen: dict[str, list[tuple[str, int]]] = {}
    for run in sorted(runs):
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        name = cfg["method"]["name"]
        if name not in REFRESH_KEYS:
            continue
        refreshes = math.ceil(cfg["train"]["steps"] / cfg["method"][REFRESH_KEYS[name]])
        seen.setdefault(name, []).append((run.name, refreshes))
        if name == "hmt":
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            first, last = records[0]["optim/basis_refreshes"], records[-1]["optim/basis_refreshes"]
            assert first > 0 and last == refreshes * first, (run.name, first, last, refreshes)
    assert set(seen) == set(REFRESH_KEYS), f"projected methods in results/reference: {sorted(seen)}"
    few = [(run, n) for runs_ in seen.values() for run, n in runs_ if n < 3]
    assert not few, f"runs with fewer than 3 basis refreshes: {few}"


def test_host_memory_columns_and_results_from_before_the_split(tmp_path: Path) -> None:
    """Device and host figures load into their own columns; a summary written before the meter told host from
    device loads with those columns empty (its figures stay the device columns)."""
    write_run(tmp_path, "hmt-tiny-s0", method="hmt", model="tiny", seed=0, extra={
        "method_summary": {"optim/state_bytes": 3000, "optim/state_device_bytes": 3000, "optim/state_host_bytes": 700}})
    old = write_run(tmp_path, "hmt-tiny-s1", method="hmt", model="tiny", seed=1,
                    extra={"method_summary": {"optim/state_bytes": 3700}})
    summary_path = tmp_path / "hmt-tiny-s0" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["memory"].update(host_peak_bytes=5 * 2**20, host_avg_bytes=2**20)
    summary_path.write_text(json.dumps(summary))
    runs = load_results(tmp_path).runs.set_index("run_id")
    new_row, old_row = runs.loc["hmt-tiny-s0"], runs.loc[old.name]
    print(runs[["optim_state_bytes", "optim_state_host_bytes", "host_peak_bytes", "peak_bytes"]])
    assert (new_row["optim_state_bytes"], new_row["optim_state_host_bytes"]) == (3000, 700)
    assert (new_row["host_peak_bytes"], new_row["host_avg_bytes"]) == (5 * 2**20, 2**20)
    assert old_row["optim_state_bytes"] == 3700 and old_row["peak_bytes"] == GIB
    assert all(pd.isna(old_row[c]) for c in ("optim_state_host_bytes", "host_peak_bytes", "host_avg_bytes"))
