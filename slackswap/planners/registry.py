"""Planner registry: names in conf/planner/*.yaml map to planner classes here.

Planner modules register themselves with `@register_planner("name")`. `get_planner` and
`available_planners` first import every module of `slackswap.planners.strategies` (discovered, not
listed) and the MILP planner, so a name works no matter which modules the caller imported, and
adding a planner needs no edit here.

Registering a planner also puts its `plan` under the replay rule
(`slackswap.planners.support.replay_rule`): no planner offers a recompute that cannot yield the tensor
autograd saved, and every planner reads the same rule.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from slackswap.errors import ConfigError
from slackswap.planners.base import Planner
from slackswap.planners.support.replay_rule import ruled_plan

#: Planner modules outside the strategies package.
_OTHER_MODULES: tuple[str, ...] = ("slackswap.planners.milp.planner",)

_REGISTRY: dict[str, Callable[..., Planner]] = {}


def register_planner(name: str) -> Callable[[type], type]:
    """Class decorator: make the class constructible as `get_planner(name, **options)`."""

    def decorate(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ConfigError("planner.name", name, f"is registered twice ({_REGISTRY[name]} and {cls})")
        _REGISTRY[name] = cls
        cls.plan = ruled_plan(cls.plan)
        return cls

    return decorate


def _load_builtins() -> None:
    import slackswap.planners.strategies as strategies

    for info in pkgutil.iter_modules(strategies.__path__):
        importlib.import_module(f"{strategies.__name__}.{info.name}")
    for module in _OTHER_MODULES:
        importlib.import_module(module)


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
