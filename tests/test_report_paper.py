"""The paper's tables and figures (``analysis.main_table``, ``analysis.figures``, ``analysis.memory_by_size``,
``analysis.latex``) on a synthetic tuned, multi-seed campaign: copies of the committed ``results/reference`` runs
with seeds 1-3, shifted losses and speeds, per-setting learning rates and settings as the campaign's rows.

Every expected number is recomputed here from the files written (json + statistics, not the report's pandas);
a failing assertion prints the numbers it compared.
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import statistics
from pathlib import Path

import pytest
import yaml

from analysis import figures, latex, main_table, report, tables
from analysis.load import load_results

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "results" / "reference"
MIB, GIB = 2**20, 2**30
SEED_SHIFT = {1: -0.02, 2: 0.0, 3: 0.03}  # validation/training loss shift per seed
HMT_ACT = {"attn_qkv": "recompute", "attn_core": "recompute", "attn_out": "int8", "mlp_intermediate": "int8"}
# name: (reference run, lr, config changes, summary changes, loss shift of the setting)
SETTINGS = {
    "adamw": ("base-tiny", 1e-3, {}, {}, 0.0),
    "adamw-8bit": ("base-tiny", 3e-3, {"method": {"eight_bit": True}},
                   {"method_summary": {"optim/state_bytes": 10_000_000}, "tokens_per_s": 3000.0}, 0.01),
    "galore": ("galore-tiny-train-s0-81effcd8", 1e-2, {}, {}, -0.05),
    "hmt": ("hmt-tiny-train-s0-1476fa55", 1e-2, {}, {}, 0.0),
    "hmt-act": ("hmt-tiny-train-s0-1476fa55", 3e-2, {"activation": HMT_ACT},
                {"activation_summary": {"policy": {}, "saved_bytes": {"attn": MIB, "mlp": 2 * MIB},
                                        "probe": {"act/attn/rel_err": 0.004, "act/mlp/rel_err": 0.011}}}, 0.02),
    "hmt-min": ("hmt-tiny-train-s0-1476fa55", 3e-2,
                {"method": {"mode": "B", "rank": 1, "state_dtype": "bf16"}, "activation": {"layer_recompute": True},
                 "train": {"max_grad_norm": 0}}, {"checkpoint_bytes": 3 * GIB // 2}, 0.3),
    "adamw-ft": ("adamw-tiny-ft-train-s0-15f3e621", 1e-4, {}, {}, 0.0),
    "hmt-ft": ("hmt-tiny-ft-train-s0-68119dec", 1e-3, {}, {}, 0.01),
}


def _merge(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def make_campaign(root: Path) -> Path:
    """``root/campaign/<setting>-s<seed>`` for seeds 1-3 and ``root/campaign-lr-search`` (seed 0, two rates)."""
    for name, (source, lr, config_changes, summary_changes, shift) in SETTINGS.items():
        runs = [(root / "campaign", seed, lr) for seed in (1, 2, 3)]
        runs += [(root / "campaign-lr-search", 0, rate) for rate in (lr, lr * 3) if name.startswith("adamw")]
        for folder, seed, rate in runs:
            run_id = f"{name}-s{seed}" + (f"-lr{rate:g}" if seed == 0 else "")
            run = Path(shutil.copytree(REFERENCE / source, folder / run_id))
            config = _merge(yaml.safe_load((run / "config.yaml").read_text()), config_changes)
            config.update(seed=seed, run_id=run_id)
            config["method"]["lr"] = rate
            (run / "config.yaml").write_text(yaml.safe_dump(config))
            delta = shift + SEED_SHIFT.get(seed, 0.0)
            summary = _merge(json.loads((run / "summary.json").read_text()), summary_changes)
            summary.update(run_id=run_id, seed=seed, val_loss=summary["val_loss"] + delta,
                           tokens_per_s=summary["tokens_per_s"] * (1 + 0.01 * seed))
            (run / "summary.json").write_text(json.dumps(summary))
            lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for line in lines:
                for key in ("loss/val", "loss/train"):
                    if key in line:
                        line[key] += delta
            (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root / "campaign"


@pytest.fixture(scope="module")
def campaign(tmp_path_factory) -> Path:
    return make_campaign(tmp_path_factory.mktemp("paper"))


@pytest.fixture(scope="module")
def results(campaign: Path):
    return load_results(campaign)


def summaries(campaign: Path, name: str) -> list[dict]:
    return [json.loads((campaign / f"{name}-s{seed}" / "summary.json").read_text()) for seed in (1, 2, 3)]


def val_curves(campaign: Path, name: str) -> dict[int, list[float]]:
    """{logged step: [validation loss per seed]}."""
    curves: dict[int, list[float]] = {}
    for seed in (1, 2, 3):
        for line in (campaign / f"{name}-s{seed}" / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "loss/val" in row:
                curves.setdefault(row["step"], []).append(row["loss/val"])
    return curves


def rows_by_setting(table: tables.Table) -> dict[tuple[str, str, str], list[str]]:
    return {(row[0], row[1], row[2]): row for row in table.rows}


MIN_LABEL = "activation=full_ckpt, method.mode=B, method.rank=1, method.state_dtype=bf16, train.max_grad_norm=0"


def test_main_table_rows_sections_and_numbers(campaign: Path, results) -> None:
    table = main_table.main_table(results)
    assert table.columns == ["Method", "Model", "Setting", "Seeds", "LR", "Val loss (nats/token)", "Perplexity",
                             "Optimizer state (MiB)", "Peak memory (GiB)", "Tokens/s (×AdamW)",
                             "Step time (×AdamW)"]
    assert table.sections == [("Pretraining", 0), ("Fine-tuning", 6)], table.sections
    assert [row[:3] for row in table.rows] == [
        ["adamw", "tiny", "base"], ["adamw", "tiny", "method.eight_bit=true"], ["galore", "tiny", ""],
        ["hmt", "tiny", "base"], ["hmt", "tiny", MIN_LABEL], ["hmt", "tiny", "activation=hmt"],
        ["adamw", "tiny-ft", ""], ["hmt", "tiny-ft", ""]], [row[:3] for row in table.rows]
    by = rows_by_setting(table)
    adamw_tps = statistics.mean(s["tokens_per_s"] for s in summaries(campaign, "adamw"))
    adamw_step = statistics.mean(s["step_time_s"] for s in summaries(campaign, "adamw"))
    for name, key in (("adamw-8bit", ("adamw", "tiny", "method.eight_bit=true")), ("hmt", ("hmt", "tiny", "base")),
                      ("hmt-min", ("hmt", "tiny", MIN_LABEL))):
        runs = summaries(campaign, name)
        val = [s["val_loss"] for s in runs]
        expected = ["3", format(SETTINGS[name][1], "g"),
                    f"{statistics.mean(val):.3f} ± {statistics.stdev(val):.3f}",
                    f"{math.exp(statistics.mean(val)):,.1f}",
                    f"{statistics.mean(s['method_summary']['optim/state_bytes'] for s in runs) / MIB:,.2f}",
                    f"{statistics.mean(s['memory']['peak_bytes'] for s in runs) / GIB:.3f}",
                    f"{statistics.mean(s['tokens_per_s'] for s in runs) / adamw_tps:.2f}×",
                    f"{statistics.mean(s['step_time_s'] for s in runs) / adamw_step:.2f}×"]
        assert by[key][3:] == expected, (name, by[key], expected)
    assert by[("adamw", "tiny", "base")][-2:] == ["1.00×", "1.00×"]
    ft = summaries(campaign, "hmt-ft")  # fine-tuning rows are compared with AdamW on tiny-ft
    ft_ratio = statistics.mean(s["tokens_per_s"] for s in ft) / statistics.mean(
        s["tokens_per_s"] for s in summaries(campaign, "adamw-ft"))
    assert by[("hmt", "tiny-ft", "")][-2] == f"{ft_ratio:.2f}×", (by[("hmt", "tiny-ft", "")], ft_ratio)


def test_systems_table_rank_activation_error_and_checkpoint(campaign: Path, results) -> None:
    table = main_table.systems_table(results)
    by = rows_by_setting(table)
    hist = summaries(campaign, "hmt")[0]["method_summary"]["rank/histogram_all_refreshes"]
    mean = sum(int(r) * c for r, c in hist.items()) / sum(hist.values())
    ranks = sorted(int(r) for r, c in hist.items() if c)
    assert by[("hmt", "tiny", "base")][-2] == f"{mean:.1f} ({ranks[0]}–{ranks[-1]})", (by[("hmt", "tiny", "base")],
                                                                                       mean, ranks)
    galore_ranks = {json.loads(line).get("rank/mean") for seed in (1, 2, 3) for line in
                    (campaign / f"galore-s{seed}" / "metrics.jsonl").read_text().splitlines()}
    assert by[("galore", "tiny", "")][-2] == format(galore_ranks.pop(), "g") and not galore_ranks
    assert by[("hmt", "tiny", "activation=hmt")][-1] == "1.10e-02"  # the worst component (mlp)
    assert by[("adamw", "tiny", "base")][-2:] == ["—", "—"]
    assert by[("hmt", "tiny", MIN_LABEL)][-3] == "1.50" and by[("hmt", "tiny", "base")][-3] == "—"
    rss = statistics.mean(s["cpu_rss_peak_bytes"] for s in summaries(campaign, "hmt")) / GIB
    assert by[("hmt", "tiny", "base")][6] == f"{rss:.2f}", (by[("hmt", "tiny", "base")], rss)


def test_flattening_is_the_relative_change_over_the_last_quarter(campaign: Path, results) -> None:
    by = rows_by_setting(main_table.flattening_table(results))
    for name, key, total in (("hmt", ("hmt", "tiny", "base"), 200), ("adamw-ft", ("adamw", "tiny-ft", ""), 80)):
        curve = {step + 1: statistics.mean(v) for step, v in val_curves(campaign, name).items()}
        last = (curve[3 * total // 4] - curve[total]) / curve[total]  # evaluations fall on 0.5T, 0.75T, T
        third = (curve[total // 2] - curve[3 * total // 4]) / curve[3 * total // 4]
        expected = ["3", str(total), f"{curve[3 * total // 4]:.3f}", f"{curve[total]:.3f}", f"{100 * last:+.2f}",
                    f"{100 * third:+.2f}"]
        assert by[key][3:] == expected, (name, by[key], expected)


def test_readme_block_has_both_sections_and_the_systems_table(results) -> None:
    block = report.readme_block(results)
    assert block.index("*Pretraining*") < block.index("*Fine-tuning*") < block.index("The same runs")
    assert "| hmt | tiny | INT8 activations | 3 | 0.03 |" in block, block  # activation=hmt by its short name
    assert "activation=hmt" not in block, block


def test_loss_curves_shade_mean_plus_minus_std_over_seeds(campaign: Path, results) -> None:
    colors = figures.method_colors(results.runs["method"].unique())
    fig = figures.loss_curves_figure(results, colors)["loss_curves"]
    axes = {ax.get_title().split(" (")[0]: ax for ax in fig.axes}
    assert set(axes) == {"model tiny", "model tiny-ft"} and "3 seed(s)" in axes["model tiny"].get_title()
    for model, names, step in (("tiny", ("adamw", "adamw-8bit", "galore", "hmt", "hmt-act", "hmt-min"), 149),
                               ("tiny-ft", ("adamw-ft", "hmt-ft"), 59)):
        bands = []
        for band in axes[f"model {model}"].collections:
            vertices = band.get_paths()[0].vertices
            at = sorted(y for x, y in vertices if x == step)
            bands.append((round(at[0], 9), round(at[-1], 9)))
        expected = []
        for name in names:
            values = val_curves(campaign, name)[step]
            m, s = statistics.mean(values), statistics.stdev(values)
            expected.append((round(m - s, 9), round(m + s, 9)))
        assert sorted(bands) == sorted(expected), (model, bands, expected)


def test_pareto_front_minimises_memory_and_loss() -> None:
    points = [(4.0, 3.0), (1.0, 3.5), (2.0, 3.2), (2.0, 3.6), (5.0, 2.9), (6.0, 3.1), (1.0, 3.4)]
    assert figures.pareto_front_min(points) == [(1.0, 3.4), (2.0, 3.2), (4.0, 3.0), (5.0, 2.9)]


def test_loss_memory_figure_draws_the_front_per_model(campaign: Path, results) -> None:
    colors = figures.method_colors(results.runs["method"].unique())
    fig = figures.loss_memory_figure(results, colors)["pareto_val_loss_vs_memory"]
    panels = [ax for ax in fig.axes if ax.get_xlabel()]
    assert [(ax.get_title(), ax.get_xlabel()) for ax in panels] == [
        ("model tiny", "optimizer state (MiB)"), ("model tiny", "peak memory (GiB)"),
        ("model tiny-ft", "optimizer state (MiB)"), ("model tiny-ft", "peak memory (GiB)")]
    points = []
    for name in ("adamw", "adamw-8bit", "galore", "hmt", "hmt-act", "hmt-min"):
        runs = summaries(campaign, name)
        points.append((statistics.mean(s["method_summary"]["optim/state_bytes"] for s in runs) / MIB,
                       statistics.mean(s["val_loss"] for s in runs)))
    front = [line for line in panels[0].lines if line.get_linestyle() == ":"]
    assert len(front) == 1
    drawn = list(zip(*front[0].get_data()))
    expected = figures.pareto_front_min(points)
    assert [tuple(round(v, 9) for v in p) for p in drawn] == [tuple(round(v, 9) for v in p) for p in expected], \
        (drawn, expected)
    legend = [t.get_text() for t in panels[1].get_legend().get_texts()]
    assert "6: hmt: activation=hmt, 3 seed(s)" in legend, legend  # raw labels: the report names them (labels)


# ---- LaTeX -------------------------------------------------------------------------------------------------------
SPECIALS = "a_b%c&d#e$f{g}h~i^j\\k"
ESCAPED = r"a\_b\%c\&d\#e\$f\{g\}h\textasciitilde{}i\textasciicircum{}j\textbackslash{}k"


def test_latex_escapes_every_special_in_headers_and_cells() -> None:
    table = tables.Table("t", SPECIALS, [SPECIALS, "×"], [[SPECIALS, "1.0 ± 0.1"]], sections=[("x_y", 0)])
    tex = tables.to_latex(table)
    assert f"{ESCAPED} & $\\times$ \\\\" in tex and f"{ESCAPED} & 1.0 $\\pm$ 0.1 \\\\" in tex, tex
    assert r"\multicolumn{2}{l}{\textit{x\_y}} \\" in tex and tex.isascii(), tex
    assert [line for line in tex.splitlines() if line.startswith("\\") and "rule" in line] == [
        r"\toprule", r"\midrule", r"\bottomrule"], tex


def _unescaped(pattern: str, text: str) -> int:
    return len(re.findall(r"(?<!\\)" + pattern, text.replace(r"\\", "")))


def test_every_report_table_is_booktabs_and_escaped(campaign: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert report.main([str(campaign), "--out", str(out), "--no-figures"]) == 0
    texs = sorted((out / "tables").glob("*.tex"))
    names = {p.stem for p in texs}
    assert {"main", "main_systems", "flattening", "lr_search", "versus_adamw", "all_tables"} <= names, names
    for path in texs:
        if path.stem == "all_tables":
            continue
        tex = path.read_text()
        assert tex.isascii(), (path.name, [c for c in tex if not c.isascii()])
        spec = re.search(r"^\\begin\{tabular\}\{(.*)\}$", tex, flags=re.MULTILINE).group(1)
        columns = len(re.findall(r"[lrc]|p\{[^}]*\}", re.sub(r">\{[^}]*\}", "", spec)))  # ">{\raggedright}p{..}"
        body = tex[tex.index("\\toprule"):tex.index("\\bottomrule")].splitlines()[1:]
        for line in body:
            if line in ("\\midrule",) or line.startswith("\\multicolumn"):
                continue
            assert _unescaped("&", line) == columns - 1, (path.name, line)
            assert _unescaped(r"\{", line) == _unescaped(r"\}", line), (path.name, line)
        assert tex.count("\\toprule") == tex.count("\\bottomrule") == 1, path.name
    document = (out / "tables" / "all_tables.tex").read_text()
    assert "\\usepackage{booktabs}" in document
    # every table but the list of runs (a diagnostic: tables/runs.md, index.md), the settings' overrides last
    inputs = re.findall(r"\\input\{(\w+)\.tex\}", document)
    assert sorted(inputs) == sorted(names - {"all_tables", "runs"}) and inputs[-1] == "settings", inputs


pdflatex = pytest.mark.skipif(not latex.pdflatex_available(), reason="pdflatex is not installed")


@pdflatex
def test_compile_latex_builds_the_pdf(campaign: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report"
    assert report.main([str(campaign), "--out", str(out), "--no-figures", "--compile-latex"]) == 0, \
        capsys.readouterr().err
    assert (out / "tables" / "all_tables.pdf").read_bytes()[:5] == b"%PDF-"


@pdflatex
def test_compile_failure_names_the_table(campaign: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(tables, "latex_escape", lambda text: text)  # "×", "_" ... reach pdflatex raw
    out = tmp_path / "report"
    assert report.main([str(campaign), "--out", str(out), "--no-figures", "--compile-latex"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    culprit = re.match(r"error: pdflatex failed on tables/(\w+)\.tex: ", err[0]) if len(err) == 1 else None
    assert culprit, err
    raw = (out / "tables" / f"{culprit.group(1)}.tex").read_text()  # the table named holds an unescaped special
    assert any(not c.isascii() or c == "_" for c in raw), (err, raw)
    assert (out / "tables" / "all_tables.log").exists()


def test_compile_latex_without_pdflatex_is_an_error_before_writing(campaign: Path, tmp_path: Path, monkeypatch,
                                                                    capsys) -> None:
    monkeypatch.setattr(latex, "PDFLATEX", "pdflatex-that-is-not-installed")
    out = tmp_path / "report"
    with pytest.raises(SystemExit) as exited:
        report.main([str(campaign), "--out", str(out), "--no-figures", "--compile-latex"])
    err = capsys.readouterr().err
    assert exited.value.code == 2, exited.value
    assert err.startswith("error: --compile-latex: pdflatex is not on PATH") and not out.exists(), err


def test_figures_of_many_models_are_drawn_per_model_and_a_crowded_model_is_named_not_drawn(
        results, monkeypatch) -> None:
    """A whole results tree: more models than ``MAX_MODEL_PANELS`` give one figure per model; a model with more
    settings than a legend can name is skipped with the reason (no figure collapses to a point, no warning)."""
    import warnings

    import matplotlib.pyplot as plt

    colors = figures.method_colors(results.runs["method"].unique())
    make = figures.per_model(figures.pareto_figure)
    assert list(make(results, colors)) == ["pareto_tokens_per_s_vs_peak_memory"]  # 2 models: one figure
    monkeypatch.setattr(figures, "MAX_MODEL_PANELS", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        made = make(results, colors)
        assert sorted(made) == ["pareto_tokens_per_s_vs_peak_memory_tiny",
                                "pareto_tokens_per_s_vs_peak_memory_tiny-ft"]
        for fig in made.values():
            fig.canvas.draw()  # constrained layout would warn here if the panels collapsed
            plt.close(fig)
    monkeypatch.setattr(figures, "MAX_SETTINGS", 5)  # tiny has 6 settings here, tiny-ft 2
    made = make(results, colors)
    assert made["pareto_tiny"] == (  # the figure maker's name: the figure was never made
        "6 settings of model tiny, more than a legend can name (5): report one campaign's folder at a time"), made
    assert not isinstance(made["pareto_tokens_per_s_vs_peak_memory_tiny-ft"], str)
    plt.close("all")
