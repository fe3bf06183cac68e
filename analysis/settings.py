"""A run's setting (its configuration less the seed and the keys that do not change what it computes), and the
short "variant" labels that tell apart runs of one method and model trained with different settings.

Runs are averaged together only when their settings are equal, so that the "Seeds" a table reports are seeds of
one configuration. When one method and model were run with several settings, each setting is labelled with the
keys whose values differ among them, e.g. ``method.rank=32`` and ``method.rank=64``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Hashable, Mapping
from typing import Any

# Top-level keys that are not part of a setting: the seed (what a table averages over) and where/how a run was
# stored or watched.
IGNORED_TOP_KEYS = ("seed", "run_id", "results_dir", "force", "wandb", "profile")
# Train keys that never change a run's trajectory; the same list as experiments.config.RUN_ID_IGNORED_TRAIN_KEYS
# (a test keeps them equal; importing it here would load torch into the report).
IGNORED_TRAIN_KEYS = ("progress", "checkpoint_every", "keep_checkpoints", "checkpoint_dir", "resume", "max_bad_steps",
                      "on_oom", "max_replans", "confirm", "max_spike_steps", "spike_loss_margin", "spike_grad_factor",
                      "on_spike", "max_lr_drops")
# Method keys added after results were written, with the default that runs written before them computed with (by
# method name): at its default such a key is left out of a setting, so a run that predates it and one that has it
# are one setting (same id), and a label shows the default where a run lacks the key (``method.eight_bit=false``,
# never ``(unset)``).
ADDED_METHOD_KEY_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"method.master_weights": False, "method.stochastic_rounding": False, "method.seed": 0,
              "method.eight_bit": False, "method.paged": False, "method.dense_lr_scale": 1.0},
    "hmt": {"method.embedding_update": "dense", "method.embedding_dtype": "bf16", "method.head_update": "dense",
            "method.embedding_lr_scale": 1.0, "method.vector_lr_scale": 1.0, "method.head_lr_scale": 1.0},
}
# Train keys added after results were written, at the default every earlier run computed with (the cosine schedule):
# left out of a setting at that default, like ``ADDED_METHOD_KEY_DEFAULTS``.
ADDED_TRAIN_KEY_DEFAULTS: dict[str, Any] = {"train.schedule": "cosine", "train.cooldown_frac": 0.2}


def _flatten(mapping: Mapping, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def setting_of(config: Mapping) -> dict[str, Any]:
    """The run's ``config.yaml`` flattened to dotted keys, less ``IGNORED_TOP_KEYS``, ``IGNORED_TRAIN_KEYS`` and
    ``ADDED_METHOD_KEY_DEFAULTS`` at their defaults."""
    flat = _flatten({k: v for k, v in config.items() if k not in IGNORED_TOP_KEYS})
    added = {**ADDED_METHOD_KEY_DEFAULTS.get(flat.get("method.name"), {}), **ADDED_TRAIN_KEY_DEFAULTS}
    return {k: v for k, v in flat.items() if not (k.startswith("train.") and k[len("train."):] in IGNORED_TRAIN_KEYS)
            and not (k in added and v == added[k])}


def setting_id(setting: Mapping[str, Any]) -> str:
    """8 hex digits identifying a setting (equal settings, equal ids)."""
    canonical = json.dumps(setting, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


_ABSENT = object()


def render_value(value: Any) -> str:
    """A config value as it would be written in an override: ``true``, ``null``, ``0.001``, ``[32,64]``."""
    if value is _ABSENT:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"), default=str)
    return str(value)


def natural_key(text: str) -> tuple:
    """Sort key that orders embedded numbers by value: ``rank=8`` before ``rank=32``."""
    return tuple((0, float(part), "") if re.fullmatch(r"\d+(?:\.\d+)?", part) else (1, 0.0, part)
                 for part in re.split(r"(\d+(?:\.\d+)?)", text))


def _value(setting: Mapping[str, Any], key: str) -> Any:
    """``setting[key]``; when absent, the default of a key added later (``ADDED_METHOD_KEY_DEFAULTS``), else unset."""
    return setting.get(key, ADDED_METHOD_KEY_DEFAULTS.get(setting.get("method.name"), {}).get(key, _ABSENT))


def _setting_groups(settings: Mapping[str, Mapping[str, Any]], group_of: Mapping[str, Hashable]):
    """Per group: (its run ids sorted, {setting id: setting} of the distinct settings among them, their keys)."""
    members: dict[Hashable, list[str]] = {}
    for run_id in sorted(settings):
        members.setdefault(group_of[run_id], []).append(run_id)
    for run_ids in members.values():
        distinct = {setting_id(settings[r]): settings[r] for r in run_ids}
        yield run_ids, distinct, sorted({k for s in distinct.values() for k in s})


def variant_labels(settings: Mapping[str, Mapping[str, Any]], group_of: Mapping[str, Hashable]) -> dict[str, str]:
    """``{run_id: label}``: ``""`` when the run's group (e.g. method, model, mode) holds a single setting, else
    ``key=value, ...`` over the keys whose values differ among that group's settings (sorted). Distinct settings
    always get distinct labels (a label that would repeat gets the setting id appended)."""
    labels: dict[str, str] = {}
    for run_ids, distinct, keys in _setting_groups(settings, group_of):
        if len(distinct) == 1:
            labels.update({r: "" for r in run_ids})
            continue
        differing = [k for k in keys if len({render_value(_value(s, k)) for s in distinct.values()}) > 1]
        by_id = {sid: ", ".join(f"{k}={render_value(_value(s, k))}" for k in differing)
                 for sid, s in distinct.items()}
        repeated = {label for label in by_id.values() if list(by_id.values()).count(label) > 1}
        by_id = {sid: f"{label} [{sid}]".lstrip() if label in repeated else label for sid, label in by_id.items()}
        labels.update({r: by_id[setting_id(settings[r])] for r in run_ids})
    return labels


# The activation presets of ``hmt_core.activations.policy.PRESETS`` as the keys each sets away from ``none`` (every
# component ``keep``, no layer recompute); a test keeps them equal (importing them would load torch).
ACTIVATION_NONE_VALUE = {"layer_recompute": "false"}  # any other component's value under ``none``: "keep"
ACTIVATION_PRESETS: dict[str, dict[str, str]] = {
    "full_ckpt": {"layer_recompute": "true"},
    "selective": {"attn_core": "recompute"},
    "hmt": {"attn_qkv": "recompute", "attn_core": "recompute", "attn_out": "int8", "mlp_intermediate": "int8"},
}


def _baseline(key: str, values: list[str], method: Any) -> str | None:
    """The value most settings of a group hold at ``key``; on a tie, the key's known default
    (``ADDED_METHOD_KEY_DEFAULTS``) if it is among the tied values, else None (no baseline: every setting shows it)."""
    counts = {v: values.count(v) for v in values}
    top = max(counts.values())
    tied = sorted(v for v, n in counts.items() if n == top)
    if len(tied) == 1:
        return tied[0]
    default = ADDED_METHOD_KEY_DEFAULTS.get(method, {}).get(key, _ABSENT)
    return render_value(default) if default is not _ABSENT and render_value(default) in tied else None


def _with_presets(parts: dict[str, str], baseline: dict[str, str | None]) -> dict[str, str]:
    """``activation.<key>=<value>`` parts that are exactly what an activation preset sets, on a baseline with the
    ``none`` values at those keys, shown as ``activation=<preset>``."""
    act = {k[len("activation."):]: v for k, v in parts.items() if k.startswith("activation.")}
    for name, overrides in ACTIVATION_PRESETS.items():
        on_none = all(baseline.get(f"activation.{k}") == ACTIVATION_NONE_VALUE.get(k, "keep") for k in overrides)
        if act and act == overrides and on_none:
            return {**{k: v for k, v in parts.items() if not k.startswith("activation.")}, "activation": name}
    return parts


def compact_labels(settings: Mapping[str, Mapping[str, Any]], group_of: Mapping[str, Hashable],
                   hidden: tuple[str, ...] = ("method.lr",)) -> dict[str, str]:
    """``{run_id: label}`` like ``variant_labels``, shorter: ``""`` when the run's group holds a single setting;
    else only the keys where the run's setting departs from the group's baseline (at each key that differs, the
    value most of the group's settings hold, ``_baseline``), ``base`` for the setting that departs nowhere, and
    an activation preset's keys as ``activation=<preset>``. ``hidden`` keys (the learning rate, a column of its
    own) are shown only where labels would otherwise repeat; distinct settings always get distinct labels (a
    setting id is appended as a last resort)."""
    labels: dict[str, str] = {}
    for run_ids, distinct, keys in _setting_groups(settings, group_of):
        if len(distinct) == 1:
            labels.update({r: "" for r in run_ids})
            continue
        values = {sid: {k: render_value(_value(s, k)) for k in keys} for sid, s in distinct.items()}
        differing = [k for k in keys if len({v[k] for v in values.values()}) > 1]
        method = next(iter(distinct.values())).get("method.name")
        baseline = {k: _baseline(k, [v[k] for v in values.values()], method) for k in differing}

        def label(sid: str, show_hidden: bool) -> str:
            parts = {k: values[sid][k] for k in differing
                     if (show_hidden or k not in hidden) and values[sid][k] != baseline[k]}
            parts = _with_presets(parts, baseline)
            return ", ".join(f"{k}={v}" for k, v in sorted(parts.items(), key=lambda kv: natural_key(kv[0])))

        by_id = {sid: label(sid, False) or "base" for sid in distinct}
        for show_hidden in (True, None):
            repeated = {lab for lab in by_id.values() if list(by_id.values()).count(lab) > 1}
            if not repeated:
                break
            by_id = {sid: (lab if lab not in repeated else
                           (label(sid, True) or "base") if show_hidden else f"{lab} [{sid}]")
                     for sid, lab in by_id.items()}
        labels.update({r: by_id[setting_id(settings[r])] for r in run_ids})
    return labels
