"""The type and range checks of every config dataclass, written once.

Each check takes the dotted field name as the user writes it in a config (`hardware.hbm_efficiency`,
`planner.options.max_rounds`) and the value, returns the value when it is good, and otherwise raises
a `ConfigError` whose one line names the field and the value and says what is wanted, in the same
words for the same rule everywhere (`must be an integer >= 1`, `must be in (0, 1]`). A boolean is
never taken for a number (`True` is an int in Python; in a YAML file it is a typo).
"""

from __future__ import annotations

import math
from typing import Any

from slackswap.errors import ConfigError


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_number(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


def positive(field: str, value: Any) -> Any:
    """A finite number > 0."""
    if not _finite_number(value) or value <= 0:
        raise ConfigError(field, value, "must be a positive finite number")
    return value


def non_negative(field: str, value: Any) -> Any:
    """A finite number >= 0."""
    if not _finite_number(value) or value < 0:
        raise ConfigError(field, value, "must be a non-negative finite number")
    return value


def fraction(field: str, value: Any, *, zero: bool = False, one: bool = True, why: str = "") -> Any:
    """A number in (0, 1] by default; `zero` admits 0, `one=False` excludes 1. `why`, if given, is
    added to the message in parentheses (what the fraction is of)."""
    ok = _finite_number(value) and (value >= 0 if zero else value > 0) and (value <= 1 if one else value < 1)
    if not ok:
        interval = f"{'[' if zero else '('}0, 1{']' if one else ')'}"
        raise ConfigError(field, value, f"must be in {interval}" + (f" ({why})" if why else ""))
    return value


def integer(field: str, value: Any, minimum: int | None = None) -> int:
    """An int (not a bool), at least `minimum` when one is given."""
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise ConfigError(field, value, "must be an integer" + ("" if minimum is None else f" >= {minimum}"))
    return value


def flag(field: str, value: Any) -> bool:
    """True or false, nothing that merely reads as one (`"no"`, 0)."""
    if not isinstance(value, bool):
        raise ConfigError(field, value, "must be true or false")
    return value
