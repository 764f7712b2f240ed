"""One prediction of a plan's step on measured op times, for `pipelines.train` (`profile.timing=measured`)
and `benchmarks/measured_profile.py` alike: what the product prints is what the benchmark checks.

    table = measure_op_times(..., **profiling_plans(hardware))  # each op's replay, each tensor's copies
    costs = measure_host_costs("cpu", export_block_shape(model))  # per machine and model shape, no plan
    table = costs.attach(table)                                # stored with the op-time table
    predicted = predict_measured(graph, plan, hardware, machine, HostCosts.of(table), export, model)

The step is `slackswap.experiment.prediction.predict_step` (the plan simulated on the measured profile,
plus synchronous copies on the CPU), with the host work of the executor that runs it, measured by fixed
microbenchmarks (once per machine; the export's dispatch at each model's shape, `export_block_shape`)
and counted from the graph and the plan: for the eager runtime its
hooks and replays (`RuntimeHostCost`, `slackswap.runtime.eager.host_cost`), for a plan run through the
eager export its SAC dispatch and its checkpoints (`ExportHostCost`,
`slackswap.experiment.measured_executor.predict_export`). The runtime's recompute steps are priced at
their ops' replay times where the op-time table has them (`OpTimeTable.replay_times`: each op's replay
timed in profiling steps of the model under `profiling_plans`' replay plan, when the table is measured), the
microbenchmark's per-step and per-call cost otherwise; its copies at each tensor's in-step copy times
where the table has them (`OpTimeTable.copy_times`, timed in profiling steps under its copy plan),
the machine description's copy curve otherwise. On a GPU that host work overlaps the kernels:
nothing is measured and nothing added. Imports torch only inside the function that measures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from slackswap.experiment.prediction import Prediction, predict_step
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Plan
from slackswap.profile.machine import Machine
from slackswap.profile.measured import ExportHostCost, OpTimeTable, RuntimeHostCost


@dataclass(frozen=True)
class HostCosts:
    """The executors' own host costs on a machine (None: not measured, nothing added)."""

    runtime: RuntimeHostCost | None = None
    export: ExportHostCost | None = None
    #: The op-time table's replay time per op (`OpTimeTable.replay_times`; None: not measured): measured
    #: with the table's op times, so `attach` leaves the table's own.
    replay_times: Mapping[str, float] | None = None
    #: The op-time table's in-step copy times per tensor (`OpTimeTable.copy_times`; None: not measured).
    copy_times: Mapping[str, tuple[float, float]] | None = None

    @classmethod
    def of(cls, table: OpTimeTable) -> HostCosts:
        return cls(table.runtime_host, table.export_host, table.replay_times, table.copy_times)

    def attach(self, table: OpTimeTable) -> OpTimeTable:
        return replace(table, runtime_host=self.runtime, export_host=self.export)

    @property
    def measured(self) -> bool:
        return self.runtime is not None and self.export is not None

    def line(self) -> str:
        """One console line of the figures (empty when not measured)."""
        parts = []
        if self.runtime is not None:
            h = self.runtime
            parts.append(f"runtime {h.context_per_step_s * 1e6:.0f} us per step, {h.hook_per_event_s * 1e6:.2f} us "
                         f"per saved-tensor event ({h.recompute_hook_per_event_s * 1e6:.2f} us of a recomputed "
                         f"tensor), {h.replay_per_step_s * 1e6:.1f} us per recompute step, "
                         f"{h.replay_per_call_s * 1e6:.1f} us per replayed ATen call, {h.per_copy_s * 1e6:.1f} us per "
                         f"copy, {h.module_check_per_call_s * 1e6:.1f} us per module call a recomputing plan checks; "
                         f"an idle plan less the profile's pass-through hook, "
                         f"{h.profile_hook_per_event_s * 1e6:.2f} us per event")
        if self.export is not None:
            e = self.export
            parts.append(f"export {e.sac_per_call_s * 1e6:.1f} us per ATen call through the SAC modes, "
                         f"checkpoint {e.checkpoint_per_region_s * 1e6:.0f} us per region + "
                         f"{e.checkpoint_per_saved_s * 1e6:.1f} us per saved tensor")
        if self.replay_times is not None:
            parts.append(f"replay times of {len(self.replay_times)} ops measured in the model's own profiling steps")
        if self.copy_times is not None:
            parts.append(f"copy times of {len(self.copy_times)} tensors measured in the model's own profiling steps")
        return "; ".join(parts)


def export_block_shape(model: ModelConfig) -> tuple[int, int]:
    """(width, tokens) the export's dispatch microbenchmark runs its blocks at for `model`: its hidden size
    and its tokens per micro-batch, so the blocks' activations are the model's size
    (`slackswap.runtime.export.dispatch_cost`, "Why at the model's shape")."""
    return model.hidden_size, model.micro_batch_size * model.seq_len


def measure_host_costs(device: str, shape: tuple[int, int] | None = None) -> HostCosts:
    """The executors' host costs measured now on `device`: on the CPU the three microbenchmarks (2-3 s),
    the export's dispatch at `shape` (`export_block_shape`; None: the microbenchmark's own), on one
    intra-op thread whatever the run's (`one_intra_op_thread`); elsewhere none."""
    return measure_export_costs(measure_runtime_costs(device), device, shape)


def measure_runtime_costs(device: str) -> HostCosts:
    """The eager runtime's host costs alone (`slackswap.runtime.eager.host_cost`): a property of the
    machine, measured once for every model; on the CPU only (elsewhere none)."""
    if not device.startswith("cpu"):
        return HostCosts()
    from slackswap.planners.registry import get_planner
    from slackswap.runtime.eager.host_cost import measure_runtime_host_cost

    with one_intra_op_thread():
        full_recompute = get_planner("full_recompute")
        return HostCosts(measure_runtime_host_cost(lambda graph, hardware: full_recompute.plan(graph, hardware, None)))


def measure_export_costs(costs: HostCosts, device: str, shape: tuple[int, int] | None = None) -> HostCosts:
    """`costs` with the export's host costs measured now on `device` (the CPU only: elsewhere `costs` as
    given), its dispatch at `shape`: per model, for a caller that measured the runtime's once for several
    (`benchmarks/measured_profile.py`)."""
    if not device.startswith("cpu"):
        return costs
    from slackswap.runtime.export.checkpoint_cost import measure_export_host_cost

    with one_intra_op_thread():
        return replace(costs, export=measure_export_host_cost(shape))


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """torch on one intra-op thread inside, as it was after. Why: the host costs are the calling thread's
    Python work, read in its CPU time; with torch's intra-op workers the calling thread also spins at their
    barriers, and that time lands in the differences (at torch's 2 threads on a loaded 2-core machine: 58 us
    per copy against 2-6 us, 0 us per SAC call against 11-16 us)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def profiling_plans(hardware: Hardware) -> dict[str, Callable[[Graph], Plan]]:
    """The plans of the profiling steps a CPU op-time table ends with, as `measure_op_times` and
    `cached_op_times` take them (`**profiling_plans(hardware)`): `replay_plan`, the full_recompute
    planner's, which recomputes every op of the stack it can (each op's replay timed), and `copy_plan`,
    the save_on_cpu planner's, which offloads and fetches back every saved tensor (each tensor's copies
    timed; the runtime runs them inline on the CPU, whatever offloader the plan names for the simulator).
    Here because the planners are a layer above the runtime that measures; one mapping, so that a
    measured training run, `pipelines.calibrate` and the benchmark measure and cache the same table."""
    from slackswap.planners.registry import get_planner

    full_recompute, save_on_cpu = get_planner("full_recompute"), get_planner("save_on_cpu")
    return {"replay_plan": lambda graph: full_recompute.plan(graph, hardware, None),
            "copy_plan": lambda graph: save_on_cpu.plan(graph, hardware, None)}


@dataclass(frozen=True)
class MeasuredPrediction:
    prediction: Prediction
    #: What the prediction counted and added, by name (logged and printed beside it).
    figures: dict[str, Any] = field(default_factory=dict)


def predict_measured(graph: Graph, plan: Plan, hardware: Hardware, machine: Machine | None, costs: HostCosts,
                     export: bool = False, model: object = None) -> MeasuredPrediction:
    """`plan`'s step on `machine` as its executor runs it (module docstring). `export`: `plan` was made
    for the export (`plan_for_export`) and runs as eager selective checkpointing; `model` (the plan's)
    lets the export's regions be counted."""
    if not export:
        prediction = predict_step(graph, plan, hardware, machine, costs.runtime, costs.replay_times,
                                  costs.copy_times)
        return MeasuredPrediction(prediction, {"predicted_runtime_host_s": prediction.runtime_host_s,
                                               "replay_timed_steps": prediction.replay_timed_steps,
                                               "replay_fallback_steps": prediction.replay_fallback_steps,
                                               "replay_times_measured": costs.replay_times is not None,
                                               "copies_at_copy_times": prediction.copy_timed,
                                               "copies_by_curve": prediction.copy_curve,
                                               "copy_times_measured": costs.copy_times is not None})
    from slackswap.experiment.measured_executor import predict_export

    executed = predict_export(graph, plan, hardware, machine, model, costs.export)
    p = executed.prediction
    figures: dict[str, Any] = {
        "plan_recomputes": executed.plan_recomputes, "executed_recomputes": executed.executed_recomputes,
        "sac_dispatch_calls": executed.dispatch_calls, "sac_cached_calls": executed.cached_calls,
        "predicted_dispatch_s": p.dispatch_s,
        "checkpoint_regions": executed.checkpoint_regions, "checkpoint_saved": executed.checkpoint_saved,
        "predicted_checkpoint_s": p.checkpoint_s, "predicted_runtime_host_s": p.runtime_host_s,
        "replayed_views": executed.replayed_views,
        "predicted_replayed_views_s": p.replayed_views_s}
    if costs.export is not None:
        figures |= {"sac_dispatch_per_call_s": costs.export.sac_per_call_s,
                    "checkpoint_per_region_s": costs.export.checkpoint_per_region_s,
                    "checkpoint_per_saved_s": costs.export.checkpoint_per_saved_s,
                    "sac_dispatch_source": costs.export.source}
    return MeasuredPrediction(p, figures)


__all__ = ["HostCosts", "MeasuredPrediction", "export_block_shape", "measure_export_costs", "measure_host_costs",
           "measure_runtime_costs", "one_intra_op_thread", "predict_measured", "profiling_plans"]
