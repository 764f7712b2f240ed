"""The activation memory budget: a fraction of the keep-all peak, or an absolute byte count.

The fraction form is what the paper reports ("50 % of the unconstrained peak"); the byte form is what
a user with a concrete GPU has. Exactly one must be given, so a sweep over `budget.fraction` can never
be silently overridden by a leftover `budget.bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slackswap.errors import ConfigError, reject_unknown_fields


@dataclass(frozen=True)
class Budget:
    fraction: float | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.bytes is None):
            raise ConfigError(
                "budget",
                {"fraction": self.fraction, "bytes": self.bytes},
                "set exactly one of budget.fraction and budget.bytes",
            )
        if self.fraction is not None:
            value = self.fraction
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or not 0 < value <= 1
            ):
                raise ConfigError("budget.fraction", value, "must be in (0, 1] (a share of the keep-all peak)")
        if self.bytes is not None:
            value = self.bytes
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError("budget.bytes", value, "must be a positive integer")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Budget:
        data = dict(data)
        reject_unknown_fields("budget", data, cls.__dataclass_fields__)
        return cls(**data)

    def resolve_bytes(self, keep_all_peak_bytes: int) -> int:
        """Bytes available for activations. A fraction is floored: the budget is never exceeded by rounding."""
        if self.bytes is not None:
            return self.bytes
        if keep_all_peak_bytes <= 0:
            raise ConfigError("keep_all_peak_bytes", keep_all_peak_bytes, "must be positive to scale a fraction")
        return math.floor(self.fraction * keep_all_peak_bytes)
