"""The report's presentation: paired statistics over seeds (``analysis.stats``), short setting names
(``analysis.labels``), one warning line per cause (``analysis.diagnostics``), minus signs in LaTeX and a main-table
title that says whether the learning rates were tuned. Expected numbers are computed here by hand."""

from __future__ import annotations

import math
import statistics

import pandas as pd
from scipy import stats as scipy_stats

from analysis import labels, main_table, stats, tables
from analysis.diagnostics import summarize_warnings
from analysis.load import Results

MIN_OVERRIDES = ('activation=full_ckpt, method.basis=random, method.mode=B, method.rank=1, method.scale=128.0, '
                 'method.scaling=tensor, method.state_dtype=bf16, method.target_patterns=["attn","mlp","lm_head"], '
                 'train.max_grad_norm=0.0')


def test_paired_t_test_pairs_by_seed() -> None:
    a = {3: 5.10, 1: 5.00, 2: 5.07, 7: 9.99}  # seed 7 has no partner: left out
    b = {1: 4.90, 2: 4.99, 3: 4.98}
    diffs = [a[s] - b[s] for s in (1, 2, 3)]
    t = statistics.mean(diffs) / (statistics.stdev(diffs) / math.sqrt(3))
    expected = 2 * scipy_stats.t.sf(abs(t), df=2)  # the t distribution's tail, not ttest_rel
    p = stats.paired_p(a, b)
    # 1e-9: the same formula through two code paths, double rounding only
    assert abs(p - expected) < 1e-9, (p, expected, t)
    assert stats.paired(a, b) == [(5.00, 4.90), (5.07, 4.99), (5.10, 4.98)]
    assert stats.verdict(a, b) == ("higher" if expected < stats.ALPHA else "no"), (p, stats.verdict(a, b))
    # unpaired (Welch) would ignore that every seed moves the same way: the paired test sees it
    welch = scipy_stats.ttest_ind([a[s] for s in (1, 2, 3)], list(b.values()), equal_var=False).pvalue
    assert p < stats.ALPHA < welch, (p, welch)


def test_paired_t_test_edge_cases() -> None:
    assert math.isnan(stats.paired_p({1: 1.0}, {1: 2.0})) and stats.verdict({1: 1.0}, {2: 2.0}) == "—"
    assert stats.paired_p({1: 1.0, 2: 2.0}, {1: 0.5, 2: 1.5}) == 0.0  # the same shift at every seed
    assert stats.paired_p({1: 1.0, 2: 2.0}, {1: 1.0, 2: 2.0}) == 1.0
    assert stats.verdict({1: 1.0, 2: 2.0}, {1: 1.5, 2: 2.5}) == "lower"
    assert stats.paired({1: float("nan"), 2: 1.0}, {1: 1.0, 2: 2.0}) == [(1.0, 2.0)]


def test_short_labels_name_settings_and_never_merge_two() -> None:
    assert labels.short_label("") == "" and labels.short_label("base") == "default"
    assert labels.short_label(MIN_OVERRIDES) == "memory-minimal"
    assert labels.short_label("method.basis=random, method.mode=B, method.rank=1, method.scale=128, "
                              "method.scaling=tensor") == "Mode B rank 1"
    assert labels.short_label("method.rank=32, train.max_grad_norm=0") == "rank=32 + no clipping"
    assert labels.short_label("activation=hmt") == "INT8 activations"
    # two settings that would share a name keep their overrides
    assert labels.short_labels(["train.max_grad_norm=0", "train.max_grad_norm=0.0"]) == {
        "train.max_grad_norm=0": "train.max_grad_norm=0", "train.max_grad_norm=0.0": "train.max_grad_norm=0.0"}


def test_relabel_keeps_the_overrides_for_the_appendix() -> None:
    runs = pd.DataFrame({"run_id": ["a", "b", "c"], "status": ["completed"] * 3, "method": ["hmt"] * 3,
                         "model": ["tiny"] * 3, "mode": ["train"] * 3,
                         "variant": ["base", "activation=hmt", MIN_OVERRIDES]})
    shown = labels.relabel(runs, "variant")
    assert list(shown["variant"]) == ["default", "INT8 activations", "memory-minimal"]
    table = labels.settings_table(shown)
    assert [row[2:] for row in table.rows] == [["default", "(none: the baseline)"],
                                               ["INT8 activations", "activation=hmt"],
                                               ["memory-minimal", MIN_OVERRIDES]], table.rows


def test_one_warning_line_per_cause_with_a_count() -> None:
    lines = [f"results/{folder}/run{i}/config.yaml: missing; the run is grouped by method and model only"
             for folder, i in (("a", 1), ("a", 2), ("b", 3))]
    lines += [f"results/c/p{i}/verify: run_id verify already read from results/c/p0/verify; this copy is skipped"
              for i in (1, 2)]
    lines += ["results/d/run/summary.json: not valid JSON (Expecting value: line 1 column 1 (char 0); cut short?)"]
    out = summarize_warnings(lines)
    assert len(out) == 3, out
    assert out[0].startswith(f"3× {lines[0]} (and 2 more like it; results/a: 2, results/b: 1)"), out
    assert out[1].startswith("2× results/c/p1/verify: run_id verify already read"), out
    assert out[2] == lines[-1], out


def test_minus_signs_are_typeset_as_minus() -> None:
    assert tables.latex_cell("-0.564") == "$-$0.564" and tables.latex_cell("+0.190") == "+0.190"
    assert tables.latex_cell("a-b") == "a-b" and tables.latex_escape("L(0.75T) − L(T)") == "L(0.75T) $-$ L(T)"
    tex = tables.to_latex(tables.Table("t", "x − y", ["Δ"], [["-1.30"]]))
    assert "$-$1.30 \\\\" in tex and "?" not in tex, tex


def _results(lrs: dict[str, float]) -> Results:
    runs = pd.DataFrame([{"run_id": f"{name}-s{seed}", "status": "completed", "method": name, "model": "tiny",
                          "mode": "train", "seed": seed, "val_loss": 5.0, "lr": lr, "setting": name,
                          "setting_sans_lr": name, "variant": "", "tokens_per_s": 1.0, "step_time_s": 1.0,
                          "peak_bytes": 1.0, "optim_state_bytes": 1.0} for name, lr in lrs.items() for seed in (1, 2)])
    empty = pd.DataFrame()
    return Results(runs=runs, metrics=empty, ranks=empty, rank_hist=empty, activations=empty)


def test_main_table_title_says_whether_the_rates_were_tuned() -> None:
    final = _results({"adamw": 1e-3, "hmt": 1e-2})
    assert "configured learning rate, with no learning-rate search" in main_table.main_table(final).title
    assert "a search chose for each" in main_table.main_table(final, search=_results({"adamw": 3e-3,
                                                                                       "hmt": 3e-3})).title
    assert "for 1 of the 2 settings" in main_table.main_table(final, search=_results({"hmt": 3e-3})).title
