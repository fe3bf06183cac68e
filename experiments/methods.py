"""The plain name -> (Config, factory) tables of training methods. An unknown name raises with the known ones."""

from __future__ import annotations

from typing import Any, Callable

from baselines import adamw, qlora
from hmt_core.method import Method

CONFIGS: dict[str, type] = {
    "adamw": adamw.Config,
    "qlora": qlora.Config,
}
FACTORIES: dict[str, Callable[[Any], Method]] = {
    "adamw": adamw.make,
    "qlora": qlora.make,
}


def _check_name(name: str) -> None:
    if name not in FACTORIES:
        raise ValueError(f"unknown method {name!r}; known methods: {sorted(FACTORIES)}")


def make_config(raw: dict[str, Any]) -> Any:
    """Build a method's frozen Config from a plain dict holding its ``name`` and fields."""
    name = raw.get("name")
    _check_name(name)
    return CONFIGS[name](**raw)


def make_method(config: Any) -> Method:
    _check_name(config.name)
    return FACTORIES[config.name](config)
