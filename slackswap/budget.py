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

from slackswap import validation as check
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
        check.flag("budget.device", self.device)
        if (self.fraction is not None) + (self.bytes is not None) + self.device != 1:
            raise ConfigError(
                "budget",
                {"fraction": self.fraction, "bytes": self.bytes, "device": self.device},
                "set exactly one of budget.fraction, budget.bytes and budget.device",
            )
        check.integer("budget.reserve_bytes", self.reserve_bytes, 0)
        if self.fraction is not None:
            check.fraction("budget.fraction", self.fraction, why="a share of the keep-all peak")
        if self.bytes is not None:
            check.integer("budget.bytes", self.bytes, 1)

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
