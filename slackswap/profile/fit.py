"""Fit a hardware preset's efficiencies and launch overhead to measured op times (`python -m
pipelines.calibrate`; docs/profile.md "Calibrating a preset").

The roofline is `slackswap.profile.timing.op_duration_s`, unchanged: the fit only chooses its free
figures (the efficiency and Hockney half-performance FLOPs of each op class with FLOPs, the HBM
efficiency and the per-op launch overhead); the peaks stay the preset's datasheet figures.

The objective is each op's error in seconds (predicted minus measured, over the mean measured op),
by `scipy.optimize.least_squares` within the validity ranges of `Hardware` ((0, 1] for efficiencies,
>= 0 for the overhead and half-performance FLOPs). What the fitted preset is for is a step, a sum of
op times: in seconds an op's error counts by the time it adds to that sum, and the launch overhead is
the model's constant term per op, so at the optimum the residuals sum to about zero and the fitted
ops' sum is reproduced (the normal equation of an intercept). The log of predicted over measured per
op, which counted a 2 us view as much as a 3 ms kernel, left the sum of hf_gpt2_2l's ops 14-24 % under
the measured one and the other shape's 19-41 % under (docs/profile.md "Calibrating a preset").
Every `holdout_every`-th op is left out of a check fit and that fit is reported on those ops as well as
on the ones it saw: a fit that only describes its own points says nothing. The preset itself is then
fitted on every op. Why: one shape's GEMMs are nearly one size, so its ops barely separate a GEMM's
efficiency from its half-performance FLOPs (a per-FLOP cost from a fixed one), and which ops a fit
leaves out moves that split and with it every prediction at another shape. On hf_gpt2_2l, 12 rounds of
both shapes measured one after the other (`python benchmarks/cross_shape_fit.py --tables 12`, load
0.6-0.7): the check fit timed the other shape's ops -10.2 to +14.5 % off their measured sum, the
preset fitted on every op -5.1 to +7.2 % (docs/profile.md "Calibrating a preset").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from slackswap.errors import ConfigError
from slackswap.graph import Graph, Op
from slackswap.hardware import OP_CLASSES, Hardware
from slackswap.profile.timing import op_duration_s

#: Tensor dtype tags (`Tensor.role` of a captured graph) -> the preset's peak keys.
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
#: Smallest efficiency / overhead the search may reach (a CPU timed against a GPU preset's peaks
#: needs efficiencies far below 1; nothing physical sits below these).
_MIN_EFFICIENCY = 1e-9
_MIN_OVERHEAD_S = 1e-12
#: Largest log(1 + half-performance FLOPs) the search may reach (1e18 FLOPs, past any op's size).
_MAX_LOG_HALF = math.log(1e18)


def op_dtype(graph: Graph, op: Op, default: str) -> str:
    """The peak key of an op: its first output's dtype where the graph records one, else `default`."""
    for t in op.outputs:
        key = _DTYPES.get(graph.tensors[t].role)
        if key is not None:
            return key
    return default


@dataclass(frozen=True)
class FitReport:
    #: The preset fitted on every measured op.
    hardware: Hardware
    #: Median |predicted / measured - 1| of `hardware` over every measured op.
    fit_median_rel_error: float
    #: The check fit's (every `holdout_every`-th op left out): median |predicted / measured - 1| over
    #: the ops it left out, and their sum of predicted over sum of measured, minus 1 (what a step sums).
    holdout_median_rel_error: float
    holdout_sum_rel_error: float
    #: Ops `hardware` is fitted on (every measured op) and ops the check fit left out.
    fit_ops: int
    holdout_ops: int
    #: Op classes with no op in the fit: their efficiency is the preset's, not fitted.
    unfitted_classes: tuple[str, ...]
    #: Sum of predicted over sum of measured, minus 1, over every measured op (the objective's target: ~0).
    fit_sum_rel_error: float = 0.0
    #: The check fit's preset (fitted without the held-out ops), for comparing the two elsewhere.
    check_hardware: Hardware | None = None


def _params(hardware: Hardware, classes: Sequence[str]) -> np.ndarray:
    """Log-parameters: per class its efficiency, then HBM efficiency, launch overhead, then per class
    log(1 + half-performance FLOPs) (0: none)."""
    effs = [math.log(hardware.efficiency[c]) for c in classes]
    halves = [math.log1p(hardware.half_performance_flops.get(c, 0.0)) for c in classes]
    return np.array(effs + [math.log(hardware.hbm_efficiency),
                            math.log(max(hardware.launch_overhead_s, _MIN_OVERHEAD_S))] + halves)


def _hardware(base: Hardware, classes: Sequence[str], x: np.ndarray) -> Hardware:
    n = len(classes)
    efficiency = dict(base.efficiency) | {c: float(min(1.0, math.exp(v))) for c, v in zip(classes, x[:n], strict=True)}
    halves = dict(base.half_performance_flops) | {c: float(math.expm1(v)) for c, v in
                                                  zip(classes, x[n + 2:], strict=True)}
    return replace(base, efficiency=efficiency, hbm_efficiency=float(min(1.0, math.exp(x[n]))),
                   launch_overhead_s=float(math.exp(x[n + 1])), half_performance_flops=halves)


def _data_start(ops: Sequence[tuple[Op, str]], measured_s: Mapping[str, float], hardware: Hardware,
                classes: Sequence[str], halves: bool) -> np.ndarray:
    """Log-parameters where each term alone explains half its ops' median time: efficiency of a class
    from its FLOP ops, HBM efficiency from the 0-FLOP ops, launch overhead from the fastest ops; with
    `halves`, each class's half-performance FLOPs at its ops' median FLOPs, else none."""
    times = [measured_s[op.name] for op, _ in ops]
    x = []
    for c in classes:
        x.append(math.log(statistics.median(
            op.flops / (hardware.peak_for(d) * measured_s[op.name] / 2) for op, d in ops
            if str(op.op_class) == c and op.flops > 0)))
    moving = [op.moved_bytes / (hardware.hbm_bytes_per_s * measured_s[op.name] / 2) for op, _ in ops
              if op.flops == 0 and op.moved_bytes > 0]
    x.append(math.log(statistics.median(moving)) if moving else math.log(hardware.hbm_efficiency))
    x.append(math.log(max(_MIN_OVERHEAD_S, float(np.quantile(times, 0.1)))))
    for c in classes:
        x.append(math.log1p(statistics.median(op.flops for op, _ in ops if str(op.op_class) == c and op.flops > 0))
                 if halves else 0.0)
    return np.array(x)


def _predict(ops: Sequence[tuple[Op, str]], hardware: Hardware) -> np.ndarray:
    return np.array([op_duration_s(op.flops, op.moved_bytes, op.op_class, dtype, hardware) for op, dtype in ops])


def roofline_step_s(graph: Graph, hardware: Hardware, default_dtype: str) -> float:
    """Every op of `graph` timed by the roofline on `hardware` as the fit times it (`op_dtype`), one after
    another: a keep-all step on a synchronous device (the CPU's one stream; keep-all makes no copies)."""
    return float(_predict([(op, op_dtype(graph, op, default_dtype)) for op in graph.ops], hardware).sum())


def fit_preset(graph: Graph, measured_s: Mapping[str, float], hardware: Hardware, default_dtype: str,
               holdout_every: int = 5, name: str | None = None) -> FitReport:
    """`hardware` with the efficiencies and launch overhead that best time `graph`'s ops as measured,
    fitted on every op, and the check fit without every `holdout_every`-th op reported on those
    (module docstring). `measured_s`: op name -> seconds (a table's medians)."""
    if holdout_every < 2:
        raise ConfigError("holdout_every", holdout_every, "must be an integer >= 2 (every k-th op is held out)")
    ops = [(op, op_dtype(graph, op, default_dtype)) for op in graph.ops if measured_s.get(op.name, 0.0) > 0]
    if len(ops) < 2 * holdout_every:
        raise ConfigError("measured ops", len(ops), f"too few timed ops to fit and hold out every {holdout_every}th")
    held = [p for i, p in enumerate(ops) if i % holdout_every == holdout_every - 1]
    _, check = _fit([p for i, p in enumerate(ops) if i % holdout_every != holdout_every - 1], measured_s, hardware)
    classes, fitted = _fit(ops, measured_s, hardware)
    fitted = replace(fitted, name=name or f"{hardware.name}_fitted")

    def errors(pairs, preset):
        pred = _predict(pairs, preset)
        meas = np.array([measured_s[op.name] for op, _ in pairs])
        return [abs(p / m - 1) for p, m in zip(pred, meas, strict=True)], float(pred.sum() / meas.sum() - 1)

    fit_err, fit_sum = errors(ops, fitted)
    held_err, held_sum = errors(held, check)
    unfitted = tuple(c for c in OP_CLASSES if c not in classes)
    return FitReport(fitted, statistics.median(fit_err), statistics.median(held_err), held_sum, len(ops), len(held),
                     unfitted, fit_sum, check)


def _fit(fit: Sequence[tuple[Op, str]], measured_s: Mapping[str, float],
         hardware: Hardware) -> tuple[list[str], Hardware]:
    """(the op classes with FLOPs among `fit`, `hardware` with the figures that best time `fit`)."""
    from scipy.optimize import least_squares

    classes = [c for c in OP_CLASSES if any(str(op.op_class) == c and op.flops > 0 for op, _ in fit)]
    measured = np.array([measured_s[op.name] for op, _ in fit])
    scale = float(measured.mean())

    def residuals(x: np.ndarray) -> np.ndarray:
        return (_predict(fit, _hardware(hardware, classes, x)) - measured) / scale

    low = [math.log(_MIN_EFFICIENCY)] * (len(classes) + 1) + [math.log(_MIN_OVERHEAD_S)] + [0.0] * len(classes)
    high = [0.0] * (len(classes) + 1) + [math.log(1.0)] + [_MAX_LOG_HALF] * len(classes)
    # The max() of the roofline is flat in whichever term does not bind, so a start where one term
    # binds everywhere never moves the other: start from the preset and from the data (each term sized
    # to explain its ops' median time; with and without half-performance FLOPs), keep the best.
    best = None
    for x0 in (_params(hardware, classes), _data_start(fit, measured_s, hardware, classes, False),
               _data_start(fit, measured_s, hardware, classes, True)):
        result = least_squares(residuals, np.clip(x0, low, high), bounds=(low, high))
        if best is None or result.cost < best.cost:
            best = result
    return classes, _hardware(hardware, classes, best.x)


def preset_yaml(report: FitReport, base: Mapping[str, object], provenance: Sequence[str]) -> str:
    """The fitted preset as YAML: the base preset's fields with the fitted ones, the provenance as
    comments and in `source` (a preset field, so `Hardware.from_dict` loads the file as it is)."""
    import yaml

    data = dict(base)
    data.pop("defaults", None)
    hw = report.hardware
    data.update(name=hw.name, efficiency=dict(hw.efficiency), hbm_efficiency=hw.hbm_efficiency,
                launch_overhead_s=hw.launch_overhead_s, half_performance_flops=dict(hw.half_performance_flops),
                source=f"fitted by slackswap.profile.fit to measured op times; {'; '.join(provenance)}")
    fit_lines = [f"fit on all {report.fit_ops} ops: median |error| {report.fit_median_rel_error:.1%}, "
                 f"sum error {report.fit_sum_rel_error:+.1%}",
                 f"a check fit without {report.holdout_ops} of them, on those held out: median |error| "
                 f"{report.holdout_median_rel_error:.1%}, sum error {report.holdout_sum_rel_error:+.1%}"]
    if report.unfitted_classes:
        fit_lines.append(f"not fitted (no such op measured): {', '.join(report.unfitted_classes)}")
    header = "\n".join(f"# {line}" for line in [*provenance, *fit_lines])
    return f"{header}\n{yaml.safe_dump(data, sort_keys=False)}"
