"""Hydra override strings (``key=value``, ``+key=value``, ``~key``): their key, and lists of them merged so that a
later override of a key replaces an earlier one."""

from __future__ import annotations

from collections.abc import Sequence


def override_key(override: str) -> str:
    """``+train.steps=3`` -> ``train.steps``; ``~foo`` -> ``foo``; ``hydra/launcher=x`` -> ``hydra/launcher``."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*lists: Sequence[str]) -> list[str]:
    """Concatenate override lists; a later override of the same key replaces an earlier one (in place)."""
    merged: dict[str, str] = {}
    for overrides in lists:
        for override in overrides:
            key = override_key(override)
            merged.pop(key, None)
            merged[key] = override
    return list(merged.values())
