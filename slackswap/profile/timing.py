"""Roofline op timing: the one place that turns (FLOPs, bytes moved) into seconds on a GPU.

duration = max((flops + n_half[op_class]) / (peak[dtype] * efficiency[op_class]),
               moved_bytes / (hbm_bytes_per_s * hbm_efficiency)) + launch_overhead_s

`n_half` is the preset's Hockney half-performance length (`Hardware.half_performance_flops`, 0 where
the preset gives none): an op of F FLOPs reaches `efficiency * F / (F + n_half)` of the peak, so small
GEMMs run further below it than large ones (docs/profile.md "Shape-aware efficiency"). It applies to
ops with FLOPs only.

`flops` counts matrix-multiply FLOPs only (2*m*n*k), the Korthikanti/Narayanan convention, so an
elementwise op (flops 0) is timed purely by its HBM traffic. The efficiencies are per op class, not
per op, so no single kernel can be tuned to hit a target figure. See docs/profile.md.
"""

from __future__ import annotations

import math

from slackswap.errors import ConfigError
from slackswap.graph import OpClass
from slackswap.hardware import Hardware


def op_duration_s(flops: float, moved_bytes: int, op_class: OpClass | str, dtype: str, hardware: Hardware,
                  *, attention_kernel: str = "") -> float:
    """Seconds one op takes on `hardware` under the roofline model (see the module docstring).

    `attention_kernel`: for an attention-class op, the kernel that runs it (`model.attention_kernel`),
    timed at the preset's efficiency for that kernel (`Hardware.attention_efficiency`); "" (every
    caller that names none) keeps the preset's one attention efficiency."""
    if not math.isfinite(flops) or flops < 0:
        raise ConfigError("op.flops", flops, "must be a non-negative finite number")
    if moved_bytes < 0:
        raise ConfigError("op.moved_bytes", moved_bytes, "must be non-negative")
    op_class = str(op_class)
    if op_class not in hardware.efficiency:
        raise ConfigError(
            f"hardware.efficiency.{op_class}", None, f"op class has no efficiency on hardware {hardware.name!r}"
        )
    peak_flops_per_s = hardware.peak_for(dtype)  # validates the dtype even for a 0-FLOP op
    efficiency = hardware.efficiency[op_class]
    if op_class == OpClass.ATTENTION:
        efficiency = hardware.attention_efficiency(attention_kernel)
    n_half = hardware.half_performance_flops.get(op_class, 0.0) if flops > 0 else 0.0
    compute_s = (flops + n_half) / (peak_flops_per_s * efficiency)
    memory_s = moved_bytes / (hardware.hbm_bytes_per_s * hardware.hbm_efficiency)
    return max(compute_s, memory_s) + hardware.launch_overhead_s
