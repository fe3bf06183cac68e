"""The report's tables, each rendered to Markdown and LaTeX from the same cells.

Rows are aggregated over the seeds of one setting (mean; validation loss also shows the standard deviation when
there are several seeds): runs of one method and model with different settings (``analysis.settings``) are
separate rows, told apart by a "Setting" column listing the keys that differ (the column appears only when some
method and model has several settings). Rows are ordered by method (``METHOD_ORDER``, then by name), model size
and variant, so the same results always give the same bytes. A missing value is shown as "—". Only completed
runs enter the numeric tables; the ``runs`` table lists every run with its state, failed ones included.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from analysis import stats
from analysis.load import CATEGORIES, Results
from analysis.settings import natural_key
from experiments.results import atomic_write_text
from experiments.sweeps.tuning import metric_or_inf, select_lr

METHOD_ORDER = ("adamw", "qlora", "galore", "apollo", "hmt")
GIB = 2**30
MIB = 2**20
DASH = "—"


@dataclass
class Table:
    name: str
    title: str
    columns: list[str]
    rows: list[list[str]]
    align: list[str] = field(default_factory=list)  # "l" | "r" per column; default: first two left, rest right
    sections: list[tuple[str, int]] = field(default_factory=list)  # (title, index of its first row), in row order

    def alignment(self) -> list[str]:
        return self.align or ["l", "l"] + ["r"] * (len(self.columns) - 2)


def method_sort_key(name: str) -> tuple:
    return (METHOD_ORDER.index(name) if name in METHOD_ORDER else len(METHOD_ORDER), str(name))


def model_sort_key(name: str) -> tuple:
    """``tiny`` < ``125m`` < ``350m`` < ``1b`` < ... < names without a size (by name)."""
    if name == "tiny":
        return (0, 0.0, name)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmbt])", str(name).lower())
    if match:
        return (1, float(match.group(1)) * {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2)], name)
    return (2, 0.0, str(name))


def variant_sort_key(label) -> tuple:
    """The baseline setting ("" or "base", ``analysis.settings.compact_labels``; "default" once
    ``analysis.labels`` named it) first, then the others in natural order."""
    return (str(label) not in ("", "base", "default"), natural_key(str(label)))


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def cell(value) -> str:
    """A plain value as text: "—" when missing, ``3`` not ``3.0`` for whole numbers."""
    if _missing(value):
        return DASH
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def fmt(value, spec: str, scale: float = 1.0) -> str:
    return DASH if _missing(value) else format(value / scale, spec)


def fmt_p(p: float) -> str:
    """A p-value with three decimals, "< 0.001" below that, "—" when there is none (NaN)."""
    return DASH if _missing(p) else ("< 0.001" if p < 0.001 else format(p, ".3f"))


def fmt_mean_std(values: pd.Series, spec: str) -> str:
    values = values.dropna().astype(float)
    if values.empty:
        return DASH
    if len(values) == 1:
        return format(values.iloc[0], spec)
    return f"{format(values.mean(), spec)} ± {format(values.std(ddof=1), spec)}"


def _mean(values: pd.Series):
    values = pd.to_numeric(values, errors="coerce").dropna()
    return float(values.mean()) if len(values) else None


def groups(runs: pd.DataFrame, keys: tuple[str, ...] = ("method", "model")) -> list[tuple[tuple, pd.DataFrame]]:
    """(key values, rows) per group, in report order."""
    if runs.empty:
        return []
    out = [(k if isinstance(k, tuple) else (k,), g) for k, g in runs.groupby(list(keys), dropna=False, sort=False)]
    sorters = {"method": method_sort_key, "model": model_sort_key, "variant": variant_sort_key}
    return sorted(out, key=lambda kg: tuple(sorters.get(key, lambda v: (str(v),))(value)
                                             for key, value in zip(keys, kg[0])))


def _variants(runs: pd.DataFrame) -> bool:
    """Whether some method and model of these runs has several settings (then tables get a Setting column)."""
    return "variant" in runs and bool((runs["variant"].fillna("") != "").any())


def _by_setting(runs: pd.DataFrame, keys: tuple[str, ...]) -> tuple[bool, list[tuple[list[str], pd.DataFrame]]]:
    """(with variant column, [(leading cells, rows)]): ``groups`` over ``keys`` and, when needed, the variant, whose
    label then follows the keys' cells."""
    with_variant = _variants(runs)
    if with_variant:
        runs = runs.assign(variant=runs["variant"].fillna(""))
    found = groups(runs, keys + (("variant",) if with_variant else ()))
    return with_variant, [([str(v) for v in key], g) for key, g in found]


def _columns(keys: list[str], with_variant: bool, rest: list[str]) -> tuple[list[str], list[str]]:
    """(column names, alignment): the key columns (+ "Setting", the variant) left-aligned, the rest right-aligned."""
    lead = keys + (["Setting"] if with_variant else [])
    return lead + rest, ["l"] * len(lead) + ["r"] * len(rest)


def _reference_adamw(runs: pd.DataFrame) -> pd.DataFrame | None:
    """The AdamW runs a model's rows are compared with: its one AdamW setting (8-bit AdamW, when present, is a
    row like the others); None when there is none or several remain."""
    adamw = runs[runs["method"] == "adamw"]
    raw = "variant_overrides" if "variant_overrides" in adamw else "variant"  # the overrides, also once relabelled
    if raw in adamw:
        adamw = adamw[~adamw[raw].fillna("").str.contains("eight_bit=true", regex=False)]
    return adamw if len(adamw) and adamw["setting"].nunique() == 1 else None


def _ratio(value, reference) -> str:
    return DASH if _missing(value) or _missing(reference) or not reference else f"{value / reference:.2f}×"


def _state_bytes(mine: pd.DataFrame, theirs: pd.DataFrame) -> tuple:
    """Mean optimizer state of both sides from one source: the optimizer's own count
    (``method_summary['optim/state_bytes']``) when both report it, else the memory tracker's optimizer category at
    the peak step."""
    for column in ("optim_state_bytes", "peak_optimizer_bytes"):
        pair = (_mean(mine[column]), _mean(theirs[column])) if column in mine and column in theirs else (None, None)
        if None not in pair:
            return pair
    return None, None


def by_seed(runs: pd.DataFrame, column: str = "val_loss") -> dict:
    """``{seed: mean of column}`` over the runs (one run per seed in a setting; a repeat is averaged)."""
    values = runs.assign(_v=pd.to_numeric(runs[column], errors="coerce")).dropna(subset=["_v"])
    return {seed: float(g["_v"].mean()) for seed, g in values.groupby("seed", dropna=True)}


VERSUS_TITLE = ("Against AdamW on the same model: validation-loss difference (mean over seeds) and a {test} (runs "
                "with one seed share data order; p over the seeds both ran, a difference counts only when p < 0.05); "
                "memory and speed as ratios of means")


def versus_adamw_table(results: Results) -> Table:
    """Each setting against AdamW on the same model: validation-loss difference, whether it exceeds the seed
    spread (``analysis.stats``: paired t-test by seed, p < 0.05), and memory and speed as ratios measured in the
    same results. Rows only for models with exactly one plain AdamW setting."""
    runs = results.completed()
    runs = runs[runs["mode"] == "train"]
    with_variant, found = _by_setting(runs, ("method", "model"))
    rows = []
    for lead, g in found:
        model_runs = runs[runs["model"].astype(str) == lead[1]]
        ref = _reference_adamw(model_runs)
        if ref is None or g["setting"].iloc[0] == ref["setting"].iloc[0]:
            continue
        mine, theirs = by_seed(g), by_seed(ref)
        delta = (sum(mine.values()) / len(mine) - sum(theirs.values()) / len(theirs)) if mine and theirs else None
        p = stats.paired_p(mine, theirs)
        rows.append([*lead, str(g["seed"].nunique(dropna=False)), str(len(stats.paired(mine, theirs))),
                     fmt_mean_std(g["val_loss"], ".3f"), fmt(delta, "+.3f"),
                     fmt_p(p), stats.verdict(mine, theirs),
                     _ratio(*_state_bytes(g, ref)),
                     _ratio(_mean(g["peak_bytes"]), _mean(ref["peak_bytes"])),
                     _ratio(_mean(g["tokens_per_s"]), _mean(ref["tokens_per_s"])),
                     _ratio(_mean(g["step_time_s"]), _mean(ref["step_time_s"]))])
    columns, align = _columns(["Method", "Model"], with_variant, [
        "Seeds", "Pairs", "Val loss", "Δ vs AdamW", "p (paired t)", "Differs?", "Optimizer state ×AdamW",
        "Peak memory ×AdamW", "Tokens/s ×AdamW", "Step time ×AdamW"])
    return Table("versus_adamw", VERSUS_TITLE.format(test=stats.TEST_NAME), columns, rows, align)


def lr_search_table(results: Results) -> Table:
    """A learning-rate search (``experiments.sweeps.tuning``): the metric at every rate searched, the rate chosen (the
    tuner's own rule, ``select_lr``) and whether the grid brackets it. Failed runs read "failed"; runs the
    divergence check stopped, and completed runs with a non-finite metric, read "diverged"."""
    runs = results.runs[results.runs["mode"] == "train"].copy()
    runs = runs[runs["status"].isin(["completed", "failed", "diverged"]) & runs["lr"].notna()]
    rates = sorted({float(v) for v in runs["lr"]})
    with_variant = bool((runs["variant_sans_lr"].fillna("") != "").any())
    keys = ("method", "model") + (("variant_sans_lr",) if with_variant else ())
    rows = []
    for key, g in groups(runs.assign(variant_sans_lr=runs["variant_sans_lr"].fillna("")), keys):
        losses = {float(r["lr"]): (r["val_loss"] if r["status"] == "completed" else None) for _, r in g.iterrows()}
        best, bracketed = select_lr(losses)
        diverged = {float(r["lr"]) for _, r in g.iterrows() if r["status"] == "diverged"}
        cells = [DASH if lr not in losses else ("diverged" if lr in diverged else "failed" if losses[lr] is None else
                 ("diverged" if metric_or_inf(losses[lr]) == math.inf else format(float(losses[lr]), ".3f")))
                 for lr in rates]
        rows.append([str(v) for v in key] + cells + [format(best, "g"), "yes" if bracketed else "no"])
    columns, align = _columns(["Method", "Model"], with_variant,
                              [f"lr={lr:g}" for lr in rates] + ["Best lr", "Bracketed"])
    return Table("lr_search", "Learning-rate search: validation loss per rate (seed of the search)", columns, rows,
                 align)


MODE_KEYS = ("method", "model", "mode")


def memory_category_table(results: Results) -> Table:
    with_variant, found = _by_setting(results.completed(), MODE_KEYS)
    rows = [lead + [fmt(_mean(g[f"peak_{c}_bytes"]), ".3f", GIB) for c in CATEGORIES]
            + [fmt(_mean(g["peak_bytes"]), ".3f", GIB)] for lead, g in found]
    columns, align = _columns(["Method", "Model", "Mode"], with_variant, [*CATEGORIES, "peak"])
    return Table("memory_by_category", "Memory by category at the peak step (GiB)", columns, rows, align)


def memory_phase_table(results: Results) -> Table:
    runs = results.completed()
    phases = sorted(c[len("peak_phase_"):-len("_bytes")] for c in runs.columns if c.startswith("peak_phase_"))
    order = {"forward": 0, "backward": 1, "optimizer": 2}
    phases.sort(key=lambda p: (order.get(p, len(order)), p))
    with_variant, found = _by_setting(runs, MODE_KEYS)
    rows = [lead + [fmt(_mean(g[f"peak_phase_{p}_bytes"]), ".3f", GIB) for p in phases]
            for lead, g in found] if phases else []
    columns, align = _columns(["Method", "Model", "Mode"], with_variant, phases)
    return Table("memory_by_phase", "Peak memory per training phase (GiB)", columns, rows, align)


def transfer_table(results: Results) -> Table:
    with_variant, found = _by_setting(results.completed(), MODE_KEYS)
    rows = [lead + [fmt(_mean(g["host_device_bytes"]), ".3f", GIB), fmt(_mean(g["checkpoint_bytes"]), ".3f", GIB),
                    fmt(_mean(g["cpu_rss_peak_bytes"]), ".2f", GIB)] for lead, g in found]
    columns, align = _columns(["Method", "Model", "Mode"], with_variant,
                              ["Host↔device (GiB)", "Checkpoint (GiB)", "CPU RSS peak (GiB)"])
    return Table("transfers", "Host-device traffic, checkpoint size and host memory (GiB)", columns, rows, align)


def activation_table(results: Results) -> Table:
    runs = results.completed()
    runs = runs[[c for c in ("run_id", "method", "model", "variant") if c in runs]]
    acts = results.activations.merge(runs, on="run_id") if len(results.activations) else runs.iloc[:0]
    with_variant = _variants(acts)
    keys = ("method", "model") + (("variant",) if with_variant else ()) + ("component",)
    rows = [[str(v) for v in key] + [fmt(_mean(g["saved_bytes"]), ".1f", MIB), fmt(_mean(g["rel_err"]), ".2e"),
                                     fmt(_mean(g["grad_cos"]), ".4f")]
            for key, g in groups(acts.assign(variant=acts["variant"].fillna("")) if with_variant else acts, keys)]
    columns, align = _columns(["Method", "Model"], with_variant,
                              ["Component", "Saved (MiB)", "Relative error", "Grad cosine"])
    align[len(align) - 4] = "l"  # the component column
    return Table("activation_error", "Activation compression per component (mean over seeds)", columns, rows, align)


def runs_table(results: Results) -> Table:
    rows = []
    for _, r in results.runs.iterrows():
        rows.append([str(r["run_id"]), str(r["status"]), *(cell(r[k]) for k in ("method", "model", "mode", "seed")),
                     cell(r.get("error"))[:80]])
    return Table("runs", "Every run and its state", ["Run", "State", "Method", "Model", "Mode", "Seed", "Error"], rows,
                 ["l"] * 7)


ALL_TABLES = (versus_adamw_table, memory_category_table, memory_phase_table, transfer_table, activation_table,
              runs_table)  # the report puts analysis.main_table's tables first


# ---- rendering -------------------------------------------------------------------------------------------------
def _section_rows(table: Table) -> list[tuple[str | None, list[list[str]]]]:
    """[(section title or None, its rows)]: one untitled section when the table has none."""
    if not table.sections:
        return [(None, table.rows)]
    starts = [start for _, start in table.sections] + [len(table.rows)]
    return [(title, table.rows[start:end]) for (title, start), end in zip(table.sections, starts[1:])]


def to_markdown(table: Table) -> str:
    """A pipe table; a table with sections is one pipe table per section, each under its title in italics."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    rule = ["---:" if a == "r" else ":---" for a in table.alignment()]
    parts = []
    for title, rows in _section_rows(table):
        body = [line(row) for row in rows] or [line(["(no data)"] + [""] * (len(table.columns) - 1))]
        parts.append((f"*{title}*\n\n" if title else "")
                     + "\n".join([line(table.columns), "| " + " | ".join(rule) + " |", *body]) + "\n")
    return "\n".join(parts)


# LaTeX's specials, and the non-ASCII characters the tables use, as text-mode LaTeX (pdflatex without extra
# packages); any other non-ASCII character becomes its ASCII decomposition, or "?" (``latex_escape``).
LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                 "<": r"\textless{}", ">": r"\textgreater{}", "|": r"\textbar{}",
                 '"': r'\texttt{"}',  # OT1 roman has no straight double quote ("..." would print as closing quotes)
                 "±": r"$\pm$", "—": "---", "–": "--", "↔": r"$\leftrightarrow$", "×": r"$\times$",
                 "Δ": r"$\Delta$", "≤": r"$\leq$", "≥": r"$\geq$", "≈": r"$\approx$", "·": r"$\cdot$",
                 "µ": r"$\mu$", "−": r"$-$", "→": r"$\rightarrow$", "‖": r"$\|$", "\u00a0": "~",
                 "…": r"\ldots{}", "²": r"\textsuperscript{2}"}


def latex_escape(text: str) -> str:
    """``text`` as LaTeX text: specials escaped (``LATEX_SPECIAL``), the result plain ASCII."""
    import unicodedata

    def one(ch: str) -> str:
        if ch in LATEX_SPECIAL:
            return LATEX_SPECIAL[ch]
        if ch.isascii():
            return ch
        plain = unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode()
        return "".join(LATEX_SPECIAL.get(c, c) for c in plain) or "?"

    return "".join(one(ch) for ch in text)


NEGATIVE_NUMBER = re.compile(r"-(?=\d|\.\d)")  # a hyphen-minus that starts a number: a minus sign in LaTeX


def latex_cell(text: str) -> str:
    """``latex_escape``, with a leading "-" before a number typeset as a minus sign (``$-$``), not a hyphen."""
    if NEGATIVE_NUMBER.match(text):
        return "$-$" + latex_escape(text[1:])
    return latex_escape(text)


def to_latex(table: Table) -> str:
    """A booktabs ``tabular`` (``\\toprule``/``\\midrule``/``\\bottomrule``); each section opens with its title
    in italics across the columns, after a ``\\midrule``."""
    n = len(table.columns)
    body = []
    for i, (title, rows) in enumerate(_section_rows(table)):
        if title:
            body += ([r"\midrule"] if i else []) + [rf"\multicolumn{{{n}}}{{l}}{{\textit{{{latex_escape(title)}}}}} \\"]
        body += [" & ".join(latex_cell(c) for c in row) + r" \\" for row in rows]
        if not rows:
            body.append(rf"\multicolumn{{{n}}}{{c}}{{(no data)}} \\")
    return "\n".join([
        r"% Generated by python -m analysis.report; do not edit.",
        rf"% {latex_escape(table.title)}",
        rf"\begin{{tabular}}{{{''.join(table.alignment())}}}",
        r"\toprule",
        " & ".join(latex_escape(c) for c in table.columns) + r" \\",
        r"\midrule",
        *body,
        r"\bottomrule",
        r"\end{tabular}",
    ]) + "\n"


def write_table_files(tables: list[Table], out: Path) -> list[Path]:
    """Each table as ``<name>.md`` (titled) and ``<name>.tex`` in ``out`` (atomic writes); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for table in tables:
        for suffix, text in ((".md", f"**{table.title}**\n\n{to_markdown(table)}"), (".tex", to_latex(table))):
            path = out / f"{table.name}{suffix}"
            atomic_write_text(path, text)
            written.append(path)
    return written
