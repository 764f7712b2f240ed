"""Calibrate a hardware preset on the machine at hand: the library side of `python -m pipelines.calibrate`.

    result = calibrate(spec, holdout_every=5)      # a TrainingRunSpec: model, device, hardware, profile
    result.report                                  # slackswap.profile.fit.FitReport
    result.yaml                                    # the fitted preset with its provenance

Builds the preset's model on `spec.device`, captures one step, times every op (the op-time table of
`profile.timing=measured`, cached in `spec.timing.cache_dir`), and fits the preset's efficiencies
and launch overhead to those times (`slackswap.profile.fit`): the preset on every op, and a check fit
without every `holdout_every`-th op reported on those.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slackswap.experiment.training_run import TrainingRunSpec
from slackswap.graph import Graph
from slackswap.profile.fit import FitReport, fit_preset, preset_yaml
from slackswap.profile.host_allocator import host_allocator
from slackswap.profile.measured import OpTimeTable


@dataclass(frozen=True)
class Calibration:
    report: FitReport
    table: OpTimeTable
    graph: Graph
    yaml: str
    cached: bool


def calibrate(spec: TrainingRunSpec, base_preset: Mapping[str, Any], holdout_every: int = 5,
              name: str | None = None) -> Calibration:
    """Fit `spec.hardware` (whose preset file's fields are `base_preset`) to `spec.model` measured on
    `spec.device`."""
    from slackswap.experiment.measured_prediction import profiling_plans
    from slackswap.runtime import capture_graph
    from slackswap.runtime.op_times import cached_op_times
    from slackswap.runtime.training_workload import build_training_workload

    host_allocator(spec.keep_freed_host_memory)  # as a training run does: the two share one cached table
    w = build_training_workload(spec.model, spec.torch_spec, spec.device, spec.seed)
    graph = capture_graph(w.model, (w.batch,), w.loss_fn, spec.hardware, f"{spec.model.name}@{spec.hardware.name}")
    # With the ops' replay times and the tensors' copy times, as a measured training run caches its table:
    # the table this run caches is then one a later `pipelines.train ... profile.timing=measured` reuses
    # rather than measures again.
    table, cached = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, spec.timing.cache_dir,
                                    spec.timing.warmup, spec.timing.repeats,
                                    **profiling_plans(spec.hardware))
    measured = {op: t.median_s for op, t in table.times.items()}
    fitted_name = name or f"{spec.hardware.name}_fitted_{table.key.device.split()[0].replace(':', '')}"
    report = fit_preset(graph, measured, spec.hardware, spec.model.dtype, holdout_every, fitted_name)
    versions = ", ".join(f"{k} {v}" for k, v in table.key.versions.items())
    provenance = [
        f"fitted from preset {spec.hardware.name} on {table.key.device}, {time.strftime('%Y-%m-%d %H:%M %Z')}",
        f"model {spec.model.name}: micro-batch {spec.model.micro_batch_size}, seq {spec.model.seq_len}, "
        f"{spec.model.dtype}; graph {graph.fingerprint}, op-time table {table.key.digest()} "
        f"({table.repeats} repeats after {table.warmup} warm-up)",
        f"versions: {versions}; host allocator: {table.key.host_allocator}",
        "peaks are the base preset's datasheet figures; only efficiencies and launch_overhead_s are fitted",
    ]
    return Calibration(report, table, graph, preset_yaml(report, base_preset, provenance), cached)
