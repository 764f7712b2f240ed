"""Planner registry: names in conf/planner/*.yaml map to planner classes here.

Planner modules register themselves with `@register_planner("name")`; `get_planner` imports every
built-in planner module first, so a name works no matter which modules the caller imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from slackswap.errors import ConfigError
from slackswap.planners.base import Planner

_BUILTIN_MODULES: tuple[str, ...] = (
    "keep_all",
    "slackswap",
    "slackswap_seed",
    "full_recompute",
    "selective_recompute",
    "recompute_knapsack",
    "swap_only",
    "capuchin",
    "dtr",
    "memo",
    "milp",
)

_REGISTRY: dict[str, Callable[..., Planner]] = {}


def register_planner(name: str) -> Callable[[type], type]:
    """Class decorator: make the class constructible as `get_planner(name, **options)`."""

    def decorate(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ConfigError("planner.name", name, f"is registered twice ({_REGISTRY[name]} and {cls})")
        _REGISTRY[name] = cls
        return cls

    return decorate


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(f"slackswap.planners.{module}")


def available_planners() -> tuple[str, ...]:
    _load_builtins()
    return tuple(sorted(_REGISTRY))


def get_planner(name: str, **options: object) -> Planner:
    """Construct the planner registered as `name` with its keyword options."""
    known = available_planners()
    if name not in _REGISTRY:
        raise ConfigError("planner.name", name, f"unknown planner; known: {', '.join(known)}")
    try:
        return _REGISTRY[name](**options)
    except TypeError as exc:
        raise ConfigError(f"planner.options ({name})", sorted(options), f"not accepted: {exc}") from None
