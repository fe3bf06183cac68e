"""The one registry of training methods: name -> the module that holds its frozen ``Config`` and its ``make``
factory (``hmt_core.method``). A method is one module plus one line here; an unknown name raises with the known
ones. What the harness needs to know about a method it asks the method (``Method``, ``MethodConfig``), never its
name; the names live here and in each method's own module."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from baselines import adafactor, adamw, apollo, galore, qlora
from hmt_core import hmt
from hmt_core.method import Method, MethodConfig

MODULES: dict[str, ModuleType] = {
    "hmt": hmt,
    "adamw": adamw,
    "qlora": qlora,
    "galore": galore,
    "apollo": apollo,
    "adafactor": adafactor,
}
CONFIGS: dict[str, type[MethodConfig]] = {name: module.Config for name, module in MODULES.items()}
FACTORIES: dict[str, Callable[[Any], Method]] = {name: module.make for name, module in MODULES.items()}
PLANNED = "hmt"  # the method whose settings experiments.planner chooses (the baselines it measures as they are)
DEFAULT = "hmt"  # the method a run gets when it names none (experiments/conf/run.yaml's defaults: method: hmt)


def planned(config: MethodConfig) -> bool:
    """Whether ``experiments.planner`` plans this method's settings (``--capacity`` measures the others)."""
    return config.name == PLANNED


def fsdp2_names() -> list[str]:
    """The methods whose optimizer steps FSDP2's sharded parameters (``Config.fsdp2``), sorted."""
    return sorted(name for name, config in CONFIGS.items() if config.fsdp2)


def _check_name(name: str) -> None:
    if name not in FACTORIES:
        raise ValueError(f"unknown method {name!r}; known methods: {sorted(FACTORIES)}")


def make_config(raw: dict[str, Any]) -> MethodConfig:
    """Build a method's frozen Config from a plain dict holding its ``name`` and fields."""
    name = raw.get("name")
    _check_name(name)
    return CONFIGS[name](**raw)


def make_method(config: MethodConfig) -> Method:
    _check_name(config.name)
    return FACTORIES[config.name](config)
