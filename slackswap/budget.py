"""The activation memory budget: a fraction of the keep-all peak, an absolute byte count, or the device.

The fraction form is what the paper reports ("50 % of the unconstrained peak"); the byte form is what
a user with a concrete GPU has; the device form (`budget=device`) is what that GPU leaves once the
static training state and a reserve are placed: device memory - static - reserve
(`slackswap.memory.static`). Exactly one must be given, so a sweep over `budget.fraction` can never
be silently overridden by a leftover `budget.bytes`.

`reserve_bytes` (every mode) is device memory that neither activations nor static state can use: the
CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers. It enters the device budget and the headroom
every run reports.
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
    device: bool = False
    #: Assumption: 1 GiB for the CUDA context (~0.3-0.6 GiB on A100/H100 with CUDA 12), cuBLAS
    #: workspaces and NCCL buffers; docs/memory.md.
    reserve_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not isinstance(self.device, bool):
            raise ConfigError("budget.device", self.device, "must be true or false")
        if (self.fraction is not None) + (self.bytes is not None) + self.device != 1:
            raise ConfigError(
                "budget",
                {"fraction": self.fraction, "bytes": self.bytes, "device": self.device},
                "set exactly one of budget.fraction, budget.bytes and budget.device",
            )
        value = self.reserve_bytes
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError("budget.reserve_bytes", value, "must be a non-negative integer")
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

    def resolve_bytes(self, keep_all_peak_bytes: int, activation_capacity_bytes: int | None = None) -> int:
        """Bytes available for activations. A fraction is floored: the budget is never exceeded by rounding.

        Device mode needs `activation_capacity_bytes` (device - static - reserve), positive: a device
        that static memory alone fills is an infeasible run, decided before this is called.
        """
        if self.device:
            if activation_capacity_bytes is None or activation_capacity_bytes <= 0:
                raise ConfigError(
                    "activation_capacity_bytes", activation_capacity_bytes, "budget.device needs a positive capacity"
                )
            return activation_capacity_bytes
        if self.bytes is not None:
            return self.bytes
        if keep_all_peak_bytes <= 0:
            raise ConfigError("keep_all_peak_bytes", keep_all_peak_bytes, "must be positive to scale a fraction")
        return math.floor(self.fraction * keep_all_peak_bytes)
