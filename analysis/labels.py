"""Short, human names for the settings a report compares, and the appendix table that spells each out.

A setting's raw label (``analysis.settings.compact_labels``) is the Hydra overrides where it departs from its
group's baseline, e.g. ``method.basis=random, method.mode=B, method.rank=1, method.scale=128.0,
method.scaling=tensor``: exact, but too long for a table column or a legend. ``short_label`` names it instead:

1. a whole-setting preset (``PRESETS``) when the label holds all of the preset's defining overrides
   (``memory-minimal``, the 7B setting of ``experiments/sweeps/campaign_hmt.yaml``);
2. else each group of overrides in ``PART_GROUPS`` by its name (``Mode B rank 1``), then each single override in
   ``PART_NAMES`` (``BF16 state``), joined with " + "; an override without a name stays as written, less its
   ``method.`` prefix.

Names never merge settings: where two settings of one group would get the same short name, both keep their raw
labels (``short_labels``). ``settings_table`` lists every short name with its full overrides (the report's
appendix).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import pandas as pd

from analysis.tables import Table, groups

BASE_NAME = "default"  # the baseline setting of a group (raw label "base")
# (name, the overrides that define it): a label holding all of them is the preset, whatever else it holds.
PRESETS: tuple[tuple[str, frozenset[str]], ...] = (
    ("memory-minimal", frozenset({"method.mode=B", "method.rank=1", "method.state_dtype=bf16",
                                  "train.max_grad_norm=0.0", 'method.target_patterns=["attn","mlp","lm_head"]'})),
    (BASE_NAME, frozenset({"method.mode=A", "method.rank=null", "method.state_dtype=fp32"})),
)
PART_GROUPS: tuple[tuple[str, frozenset[str]], ...] = (
    ("Mode B rank 1", frozenset({"method.basis=random", "method.mode=B", "method.rank=1", "method.scale=128.0",
                                 "method.scaling=tensor"})),
)
PART_NAMES = {
    "method.eight_bit=true": "8-bit",
    "method.variant=apollo": "APOLLO",
    "method.variant=mini": "APOLLO-Mini",
    "activation=hmt": "INT8 activations",
    "activation=full_ckpt": "full checkpointing",
    "activation=selective": "selective recompute",
    "method.state_dtype=bf16": "BF16 state",
    "method.weight_dtype=int8": "INT8 weights",
    "train.max_grad_norm=0.0": "no clipping",
    'method.target_patterns=["attn","mlp","lm_head"]': "incl. lm_head",
}
OVERRIDES_COLUMN = r">{\raggedright\arraybackslash}p{15cm}"  # LaTeX wraps the overrides (array package)
_PART_SPLIT = re.compile(r", (?=[A-Za-z_][\w.]*=)")  # between overrides, not inside a value like ["a","b"]


def canonical(part: str) -> str:
    """``key=value`` with a number written one way (``train.max_grad_norm=0`` is ``...=0.0``)."""
    key, _, value = part.partition("=")
    try:
        return f"{key}={float(value)!r}"
    except ValueError:
        return part


def parts_of(label: str) -> list[str]:
    """The overrides of a raw label (``key=value`` each; a value may hold commas)."""
    return [p for p in _PART_SPLIT.split(label) if p] if "=" in label else []


def _named(parts: Iterable[str]) -> frozenset[str]:
    return frozenset(canonical(p) for p in parts)


def short_label(label: str) -> str:
    """The short name of one raw label: "" stays "", ``base`` is ``default``, a label without overrides (a
    setting id) stays as it is."""
    if label == "base":
        return BASE_NAME
    parts = parts_of(label.split(" [")[0])
    if not parts:
        return label
    remaining = {canonical(p) for p in parts}
    for name, defining in PRESETS:
        if _named(defining) <= remaining:
            return name
    names = []
    for name, group in PART_GROUPS:
        if _named(group) <= remaining:
            names.append(name)
            remaining -= _named(group)
    known = {canonical(p): name for p, name in PART_NAMES.items()}
    names += [known.get(canonical(p), p.removeprefix("method.")) for p in parts if canonical(p) in remaining]
    return " + ".join(names)


def short_labels(labels: Iterable[str]) -> dict[str, str]:
    """``{raw: short}`` over the labels of one group; a short name two raw labels would share is not used."""
    raw = sorted(set(labels))
    short = {r: short_label(r) for r in raw}
    taken = [s for s in short.values()]
    return {r: (s if taken.count(s) == 1 else r) for r, s in short.items()}


def relabel(frame: pd.DataFrame, column: str, keys: tuple[str, ...] = ("method", "model", "mode")) -> pd.DataFrame:
    """``frame`` with ``column`` replaced by short names (per group of ``keys``) and the raw label kept as
    ``<column>_overrides``."""
    if frame.empty or column not in frame:
        return frame
    raw = frame[column].fillna("").astype(str)
    keys = tuple(k for k in keys if k in frame)
    group = frame[list(keys)].astype(str).agg("\x1f".join, axis=1) if keys else pd.Series("", index=frame.index)
    mapping = {g: short_labels(raw[group == g]) for g in group.unique()}
    short = [mapping[g][r] for g, r in zip(group, raw)]
    return frame.assign(**{column: short, f"{column}_overrides": raw})


def _overrides(raw: str) -> str:
    return "(none: the baseline)" if raw == "base" else str(raw)


def settings_table(runs: pd.DataFrame, memory: pd.DataFrame | None = None) -> Table:
    """Appendix: every short setting name of the relabelled ``runs`` (``variant``) and ``memory`` (dry runs,
    ``label``) with the overrides it stands for (where it departs from its group's baseline)."""
    rows: list[list[str]] = []
    if len(runs) and "variant_overrides" in runs:
        named = runs[runs["status"] == "completed"]
        named = named[named["variant_overrides"] != ""]
        for (method, model, variant), g in groups(named, ("method", "model", "variant")):
            rows.append([str(method), str(model), str(variant), _overrides(g["variant_overrides"].iloc[0])])
    if memory is not None and len(memory) and "label_overrides" in memory:
        for (method, label), g in groups(memory[memory["label_overrides"] != ""], ("method", "label")):
            overrides = _overrides(g["label_overrides"].iloc[0])
            rows.append([str(method), "dry runs (memory by size)", str(label), overrides])
    return Table("settings", "Setting names and the Hydra overrides each stands for (departures from the baseline "
                 "setting of its method and model; 'default' is that baseline)",
                 ["Method", "Model", "Setting", "Overrides"], rows, ["l"] * 3 + [OVERRIDES_COLUMN])
