"""The plain name -> (Config, factory) tables of training methods. An unknown name raises with the known ones."""

from __future__ import annotations

from typing import Any, Callable

from baselines import adamw, apollo, galore, qlora
from hmt_core import hmt
from hmt_core.method import Method

CONFIGS: dict[str, type] = {
    "hmt": hmt.Config,
    "adamw": adamw.Config,
    "qlora": qlora.Config,
    "galore": galore.Config,
    "apollo": apollo.Config,
}
FACTORIES: dict[str, Callable[[Any], Method]] = {
    "hmt": hmt.make,
    "adamw": adamw.make,
    "qlora": qlora.make,
    "galore": galore.make,
    "apollo": apollo.make,
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
