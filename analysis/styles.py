"""How the report's figures draw each setting: a colour, a marker and a line style per method and setting.

A method keeps its colour (``analysis.figures.method_colors``) for its baseline setting (its only one, its
``default``, else the first in report order, ``tables.variant_sort_key``); its other settings each get a colour of
their own from ``SETTING_COLORS`` (colour-blind-safe Tol "muted" and "dark" tones, none of them a method's
colour), assigned in report order over the whole report so a setting has one colour in every figure, and a marker
and line style of their own within the method, so settings stay apart in print (grey scale) too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from analysis.tables import method_sort_key, variant_sort_key

SETTING_COLORS = ("#332288", "#117733", "#44AA99", "#88CCEE", "#DDCC77", "#CC6677", "#AA4499", "#882255",
                  "#6699CC", "#997700", "#994455", "#004488")
BASELINES = ("", "base", "default")  # a method's only setting, or its baseline (raw and short names)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 1)), (0, (5, 2, 1, 2)))


@dataclass(frozen=True, kw_only=True)
class Style:
    color: str
    marker: str
    linestyle: str | tuple


def setting_label(method: str, variant: str) -> str:
    """A setting's name in a legend or tick: ``hmt: INT8 activations``, or the method alone for its only setting."""
    return f"{method}: {variant}" if variant else str(method)


def setting_styles(runs: pd.DataFrame, colors: dict[str, str]) -> dict[tuple[str, str], Style]:
    """``{(method, variant): Style}`` for every method and setting in ``runs`` (``variant`` "" when a method has
    one setting)."""
    variants = runs.assign(variant=runs["variant"].fillna("") if "variant" in runs else "")
    pairs = variants[["method", "variant", "model"]].dropna(subset=["method"]).drop_duplicates()
    settings = sorted({(str(m), str(v)) for m, v in zip(pairs["method"], pairs["variant"])},
                      key=lambda mv: (method_sort_key(mv[0]), variant_sort_key(mv[1])))
    styles: dict[tuple[str, str], Style] = {}
    spare = iter(SETTING_COLORS * (1 + len(settings) // len(SETTING_COLORS)))
    for method in dict.fromkeys(m for m, _ in settings):
        own = [s for s in settings if s[0] == method]
        bases = {v for _, v in own if v in BASELINES} or {own[0][1]}  # "" on one model and "default" on another
        for i, (_, variant) in enumerate(own):
            color = colors[method] if variant in bases else next(spare)
            styles[(method, variant)] = Style(color=color, marker=MARKERS[i % len(MARKERS)],
                                              linestyle=LINESTYLES[i % len(LINESTYLES)])
    return styles

