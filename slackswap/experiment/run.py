"""One run: profile -> budget -> plan -> simulate -> allocator -> metrics, as one library call.

`run_one(spec)` returns a `RunOutcome`: the verdict, the typed figures a caller ranks by (step time,
tokens/s, MFU, peak, headroom, device fit), the full metrics.json mapping of docs/contract.md, and the
graph, plan and simulation behind them. It writes nothing; `slackswap.experiment.files` writes a run
directory from an outcome. An infeasible budget is an outcome (`Verdict.INFEASIBLE` with its reason),
not an exception; a bad spec never gets here (`RunSpec.from_dict` raises `ConfigError`).

The device verdict is separate from the budget verdict: `fits_device` says whether the step's peak
(the allocator's reserved peak when it is modelled) plus the static training state and the reserve
fit the device's memory, whatever the budget mode. A run can meet an absolute budget that the device
cannot hold (`Verdict.OK` with `fits_device` False); docs/pipeline.md says how that reads.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from slackswap.errors import InfeasibleBudgetError
from slackswap.experiment.baseline import Baseline, load_baseline
from slackswap.experiment.fitting import FittedPlan, plan_and_simulate
from slackswap.experiment.floor import cached_floor
from slackswap.experiment.layout_comm import layout_communication, with_layout_comm
from slackswap.experiment.spec import RunSpec
from slackswap.experiment.throughput import FLOPS_SOURCE, mfu, model_flops, tokens_per_s
from slackswap.graph import Graph
from slackswap.memory.static import DeviceCapacity
from slackswap.metrics_table import check_metrics
from slackswap.metrics_table import names as metric_names
from slackswap.plan import Decision, Plan
from slackswap.planners.base import gib
from slackswap.simulate.result import SimResult


class Verdict(StrEnum):
    """The budget verdict of a run; the same strings as the pipeline's `ok` / `infeasible` statuses."""

    OK = "ok"
    INFEASIBLE = "infeasible"


@dataclass(frozen=True)
class RunOutcome:
    verdict: Verdict
    #: Empty for OK; for INFEASIBLE, which stage said so and why ("planner: ...", "simulator: ...",
    #: "device memory: ...").
    reason: str
    #: metrics.json (docs/contract.md): one key set for every outcome of a spec; unknowns are None.
    metrics: Mapping[str, Any]
    #: Wall seconds per stage (`profile_s` and `ideal_sim_s` are 0.0 when the baseline was cached).
    timings_s: Mapping[str, float]
    baseline: Baseline
    budget_bytes: int | None
    plan: Plan | None = None
    result: SimResult | None = None
    fitted: FittedPlan | None = field(default=None, repr=False)

    @property
    def graph(self) -> Graph:
        return self.baseline.graph

    @property
    def step_s(self) -> float | None:
        return self.metrics["step_s"]

    @property
    def tokens_per_s(self) -> float | None:
        return self.metrics["tokens_per_s"]

    @property
    def mfu(self) -> float | None:
        return self.metrics["mfu"]

    @property
    def peak_bytes(self) -> int | None:
        """The peak the device sees: the allocator's reserved peak when modelled, else the activation peak."""
        return self.metrics["device_peak_activation_bytes"]

    @property
    def headroom_bytes(self) -> int:
        return self.metrics["headroom_bytes"]

    @property
    def fits_device(self) -> bool | None:
        return self.metrics["fits_device"]

    @property
    def static_bytes(self) -> int:
        return self.metrics["static_bytes"]

    @property
    def min_feasible_bytes(self) -> int | None:
        return self.metrics["min_feasible_bytes"]

    @property
    def swapped(self) -> tuple[str, ...]:
        return () if self.plan is None else tuple(self.plan.tensors_with(Decision.SWAP))

    @property
    def recomputed(self) -> tuple[str, ...]:
        return () if self.plan is None else tuple(self.plan.tensors_with(Decision.RECOMPUTE))


def model_parameter_counts(spec: RunSpec, graph: Graph | None = None) -> tuple[int, int]:
    """(parameters, largest parameter group) of the run's model: a traced graph's own (the module's
    parameters, counted by the tracer: a user's model is not the analytic family of its shape keys),
    else the analytic model's (`slackswap.profile.parameter_counts`)."""
    if graph is not None and graph.meta.get("source") == "torch" and "num_params" in graph.meta:
        return int(graph.meta["num_params"]), int(graph.meta.get("max_unit_params") or graph.meta["num_params"])
    from slackswap.profile import parameter_counts

    return parameter_counts(spec.model, spec.parallel)


def device_capacity(spec: RunSpec, graph: Graph | None = None) -> DeviceCapacity:
    """Device memory - reserve - static training state per GPU (`slackswap.memory.static`), of the
    parameters `model_parameter_counts` gives (the traced module's with `graph`)."""
    from slackswap.memory.static import static_memory

    traced = graph is not None and graph.meta.get("source") == "torch"
    if spec.model.moe is not None and spec.parallel.ep > 1 and not traced:
        # the routed experts' state over their expert data-parallel group, the dense over zero_shards
        from slackswap.profile.stages import device_static_memory

        static = device_static_memory(spec.model, spec.parallel, spec.training, 0)
    else:
        static = static_memory(*model_parameter_counts(spec, graph), spec.training, spec.model.dtype)
    return DeviceCapacity(spec.hardware.device_memory_bytes, spec.budget.reserve_bytes, static)


def suggest_shards(spec: RunSpec, graph: Graph | None = None) -> tuple[int, int] | None:
    from slackswap.memory.static import smallest_fitting_shards

    return smallest_fitting_shards(
        *model_parameter_counts(spec, graph),
        spec.training,
        spec.model.dtype,
        spec.hardware.device_memory_bytes,
        spec.budget.reserve_bytes,
    )


def run_one(spec: RunSpec, timings: dict[str, float] | None = None) -> RunOutcome:
    """Run `spec` and return its outcome. `timings`, if given, is filled as each stage finishes (a run
    that raises midway still says where its time went) and is the outcome's `timings_s`."""
    from slackswap.memory.static import capacity_reason
    from slackswap.node import pinned_reason
    from slackswap.simulate.metrics import compute_metrics, unsimulated_metrics

    timings = {} if timings is None else timings
    if spec.parallel.pp > 1:
        return run_pipeline(spec, timings)
    base, hit = load_baseline(spec)
    timings["profile_s"] = 0.0 if hit else base.profile_wall_s
    timings["ideal_sim_s"] = 0.0 if hit else base.ideal_sim_wall_s
    ideal = base.ideal
    capacity = device_capacity(spec, base.graph)
    comm = layout_communication(spec, base.graph)
    exposed_s = None if comm is None else comm.exposed_s

    def outcome(verdict: Verdict, reason: str, simulation: Mapping[str, Any], budget: int | None,
                fitted: FittedPlan | None = None) -> RunOutcome:
        metrics = run_metrics(spec, base, capacity, with_layout_comm(simulation, exposed_s), fitted)
        plan, result = (None, None) if fitted is None else (fitted.plan, fitted.result)
        return RunOutcome(verdict, reason, metrics, timings, base, budget, plan, result, fitted)

    if spec.budget.device and not capacity.fits:
        # Static memory alone fills the device: a result (infeasible), reported term by term.
        reason = capacity_reason(capacity, suggest_shards(spec, base.graph))
        return outcome(Verdict.INFEASIBLE, f"device memory: {reason}", unsimulated_metrics(ideal, None, reason), None)
    budget_bytes = spec.budget.resolve_bytes(base.keep_all_peak_bytes, capacity.activation_capacity_bytes)

    t0 = time.perf_counter()
    try:
        fitted = plan_and_simulate(spec.planner, base.graph, spec.hardware, budget_bytes, spec.fit)
    except InfeasibleBudgetError as exc:
        timings["plan_s"] = plan_wall_s = time.perf_counter() - t0
        floor_bytes, note = None, f"; no floor figure for {spec.planner_name} (not searched: each probe is costly)"
        if getattr(spec.planner, "floor_by_bisection", True):
            t0 = time.perf_counter()
            floor = cached_floor(
                (spec.workload_key, spec.planner_name, repr(sorted(spec.planner_options.items()))),
                spec.planner, base.graph, spec.hardware, budget_bytes, base.keep_all_peak_bytes,
            )
            timings["floor_s"] = time.perf_counter() - t0
            floor_bytes, note = floor.floor_bytes, _floor_note(spec.planner_name, floor.floor_bytes)
        reason = exc.reason + note
        # No plan, so nothing to simulate: what a simulation would give is None.
        simulation = unsimulated_metrics(
            ideal, budget_bytes, reason, min_feasible_bytes=floor_bytes, plan_wall_s=plan_wall_s
        )
        return outcome(Verdict.INFEASIBLE, f"planner: {reason}", simulation, budget_bytes)
    timings["plan_s"] = fitted.plan_wall_s
    timings["sim_s"] = fitted.sim_wall_s
    simulation = compute_metrics(fitted.result, ideal, plan_wall_s=fitted.plan_wall_s, sim_wall_s=fitted.sim_wall_s)
    pinned = None if spec.node is None else pinned_reason(spec.node, int(fitted.result.host_pinned_bytes))
    if fitted.result.feasible and pinned is not None:
        # Every rank of the node holds the same host copies in pinned host memory: over it, infeasible.
        return outcome(Verdict.INFEASIBLE, pinned, dict(simulation) | {"feasible": False}, budget_bytes, fitted)
    if fitted.result.feasible:
        done = outcome(Verdict.OK, "", simulation, budget_bytes, fitted)
        if spec.alone_hardware is not None:
            done.metrics["alone_throughput_ratio"] = alone_throughput(spec, base, budget_bytes, exposed_s)
        return done
    reason = f"simulator: {fitted.result.infeasible_reason}"
    return outcome(Verdict.INFEASIBLE, reason, simulation, budget_bytes, fitted)


def run_pipeline(spec: RunSpec, timings: dict[str, float]) -> RunOutcome:
    """A pipeline layout's run: each stage planned under its own budget, the step the pipeline's
    (`slackswap.experiment.pipeline_run`). The outcome's graph, plan and simulation are stage 0's
    (the stage that holds the most micro-batches); metrics.json adds the `pipeline` group."""
    from slackswap.experiment import pipeline_run as pr
    from slackswap.node import pinned_reason

    t0 = time.perf_counter()
    stages = pr.build_stages(spec)
    timings["profile_s"] = time.perf_counter() - t0
    timings["ideal_sim_s"] = 0.0  # inside profile_s: each stage's keep-all run sizes its budget
    out = pr.with_bound(spec, pr.plan_pipeline(spec, stages))
    timings["plan_s"], timings["sim_s"] = out.plan_wall_s, out.sim_wall_s
    base = pr.stage_baseline(stages[0], timings["profile_s"], 0.0)
    simulation = pr.pipeline_simulation_metrics(spec, out)
    first = out.stages[0]
    metrics = run_metrics(spec, base, stages[0].capacity, simulation, first.fitted)
    fits, headroom = pr.stage_fits(out)
    metrics["fits_device"] = False if fits is None and spec.budget.device else fits
    metrics["headroom_bytes"] = headroom
    metrics["device_peak_activation_bytes"] = simulation["peak_activation_bytes"]
    # Per GPU: the average stage's FLOPs over the step's m micro-batches.
    flops = spec.parallel.microbatches * sum(model_flops(s.graph) for s in stages) / spec.parallel.pp
    metrics["model_flops"] = flops
    metrics["tokens_per_s"] = tokens_per_s(spec.tokens_per_step, simulation["step_s"])
    metrics["mfu"] = mfu(flops, simulation["step_s"], spec.hardware, spec.model.dtype)
    metrics["ideal_tokens_per_s"] = tokens_per_s(spec.tokens_per_step, simulation["ideal_step_s"])
    metrics["ideal_mfu"] = mfu(flops, simulation["ideal_step_s"], spec.hardware, spec.model.dtype)
    metrics |= pr.pipeline_metrics(spec, out, stages)
    check_metrics(metrics)
    fitted, result = first.fitted, None if first.fitted is None else first.fitted.result
    pinned = simulation["host_pinned_bytes"]
    pinned = None if spec.node is None or pinned is None else pinned_reason(spec.node, int(pinned))
    if out.reason or pinned is not None:
        metrics["feasible"] = False
        return RunOutcome(Verdict.INFEASIBLE, out.reason or pinned, metrics, timings, base,
                          metrics["budget_bytes"], None if fitted is None else fitted.plan, result, fitted)
    return RunOutcome(Verdict.OK, "", metrics, timings, base, metrics["budget_bytes"], fitted.plan, result, fitted)


def alone_throughput(spec: RunSpec, base: Baseline, budget_bytes: int,
                     layout_comm_s: float | None = None) -> float | None:
    """Throughput retained by the same planner and budget with the GPU alone on its preset link (None
    if infeasible there): the reference that shows what the node's sharing cost this planner."""
    from slackswap.simulate.metrics import compute_metrics

    try:
        alone = plan_and_simulate(spec.planner, base.graph, spec.alone_hardware, budget_bytes, spec.fit)
    except InfeasibleBudgetError:
        return None
    if not alone.result.feasible:
        return None
    metrics = compute_metrics(alone.result, base.ideal, plan_wall_s=alone.plan_wall_s, sim_wall_s=alone.sim_wall_s)
    return with_layout_comm(metrics, layout_comm_s)["throughput_ratio"]


def _floor_note(planner_name: str, floor_bytes: int | None) -> str:
    if floor_bytes is None:
        return f"; {planner_name} has no plan even at the keep-all peak"
    return f"; the least budget {planner_name} plans within is {gib(floor_bytes)} (bisection on the budget)"


def run_metrics(
    spec: RunSpec, base: Baseline, capacity: DeviceCapacity, simulation: Mapping[str, Any],
    fitted: FittedPlan | None = None,
) -> dict[str, Any]:
    """metrics.json, built here only, with one key set for every outcome of one spec (ok, planner
    infeasible, simulator infeasible, device infeasible), checked against `slackswap.metrics_table`
    (where each name, unit and meaning is declared): the simulation's keys
    (`slackswap.simulate.metrics`), the device's static split and fit, the allocator replay's keys when
    the allocator is modelled, the planning budget, throughput and MFU, and the real-vs-analytic peaks
    when the graph is traced. What an outcome did not compute is None.

    `fitted` is the `plan_and_simulate` result of a planned and simulated run; None when no plan was
    made.
    """
    report = None if fitted is None else fitted.report
    metrics = dict(simulation) | _static_metrics(capacity)
    if spec.fit.models_allocator:
        metrics |= dict.fromkeys(metric_names("allocator")) if report is None else report.metrics()
    # What the device has left at this run's peak (reserved peak when the allocator is modelled); with
    # no plan, all of the activation capacity.
    peak = simulation["peak_activation_bytes"] if report is None else report.peak_reserved_bytes
    metrics["headroom_bytes"] = capacity.activation_capacity_bytes - (peak or 0)
    metrics["device_peak_activation_bytes"] = peak
    simulated = fitted is not None and fitted.result.feasible
    metrics["fits_device"] = _fits_device(spec, capacity, simulated, peak)
    metrics["planning_budget_bytes"] = None if fitted is None else fitted.planning_budget_bytes
    metrics["planning_rounds"] = None if fitted is None else fitted.rounds
    flops = model_flops(base.graph)
    step_s = simulation["step_s"] if simulation["feasible"] else None
    metrics["model_flops"] = flops
    metrics["model_flops_source"] = FLOPS_SOURCE
    metrics["tokens_per_step"] = spec.tokens_per_step
    metrics["tokens_per_s"] = tokens_per_s(spec.tokens_per_step, step_s)
    metrics["mfu"] = mfu(flops, step_s, spec.hardware, spec.model.dtype)
    metrics["ideal_tokens_per_s"] = tokens_per_s(spec.tokens_per_step, simulation["ideal_step_s"])
    metrics["ideal_mfu"] = mfu(flops, simulation["ideal_step_s"], spec.hardware, spec.model.dtype)
    metrics |= _source_metrics(base)
    metrics |= _node_metrics(spec, simulation)
    metrics |= layout_metrics(spec, base.graph)
    check_metrics(metrics)
    return metrics


def layout_metrics(spec: RunSpec, graph: Graph) -> dict[str, Any]:
    """One rank's layout figures (no keys for one full replica): the degrees, the largest per-layer saved
    bytes, and the collectives the layout adds with their ring time on the node's fabrics and the part
    of it the step waits on (`layout_comm_s`, in `step_s` of a one-stage layout; `with_layout_comm`)."""
    from slackswap.parallel import DEGREES

    comm = layout_communication(spec, graph)
    if comm is None:
        return {}
    saved: dict[int, int] = {}
    for t in graph.saved_tensors:
        if t.layer >= 0:
            saved[t.layer] = saved.get(t.layer, 0) + t.size_bytes
    degrees = {k: getattr(spec.parallel, k) for k in (*DEGREES, "sp")}  # the pipeline's own: `pipeline_*`
    return {f"parallel_{k}": v for k, v in degrees.items()} | {
        "parallel_world_size": spec.parallel.world_size,
        "rank_layer_saved_bytes": max(saved.values()) if saved else 0,
        "layout_collectives": comm.count,
        "layout_comm_bus_bytes": comm.bus_bytes,
        "layout_comm_forward_s": comm.forward_s,
        "layout_comm_backward_s": comm.backward_s,
        "layout_comm_s": comm.exposed_s,
        "layout_comm_hidden_s": comm.hidden_s,
        "layout_comm_fabric": ",".join(f"{g}:{f}" for g, f in sorted(comm.fabrics.items())) or None,
        "layout_comm_unpriced": comm.unpriced or None,
    }


def _node_metrics(spec: RunSpec, simulation: Mapping[str, Any]) -> dict[str, Any]:
    """The node's share of the host link each GPU got and the pinned host bytes the node's ranks need."""
    if spec.node is None:
        return {}
    pinned = simulation.get("host_pinned_bytes")
    return spec.shared_link.metrics() | {
        "node": spec.node.name,
        "gpus_per_node": spec.node.gpus_per_node,
        "pinned_host_bytes": spec.node.pinned_host_bytes,
        "pinned_needed_bytes": None if pinned is None else pinned * spec.node.gpus_per_node,
        # set by `run_one` once an ok plan is also simulated with the GPU alone (a node that shares)
        "alone_throughput_ratio": None,
    }


def _fits_device(spec: RunSpec, capacity: DeviceCapacity, simulated: bool, peak: int | None) -> bool | None:
    """Whether this run's step fits the device: its peak + static + reserve within device memory.

    Judged by the simulated step whenever the simulator ran it to the end (`simulated`), even when
    something else made the run infeasible (the node's pinned host memory). False when static memory
    alone does not fit, or when the budget is the device's own capacity and no plan met it; None when
    there is no simulated step to judge by under a fraction or absolute budget.
    """
    if not capacity.fits:
        return False
    if simulated and peak is not None:
        return peak <= capacity.activation_capacity_bytes
    return False if spec.budget.device else None


def _static_metrics(capacity: DeviceCapacity) -> dict[str, Any]:
    """Static bytes per GPU by term, and the device's split: reported by every run, whatever the budget."""
    static = capacity.static
    return {
        "static_bytes": static.total_bytes,
        **{f"static_{name}": value for name, value in static.terms().items()},
        "num_params": static.num_params,
        "device_memory_bytes": capacity.device_memory_bytes,
        "reserve_bytes": capacity.reserve_bytes,
        "activation_capacity_bytes": capacity.activation_capacity_bytes,
    }


def _source_metrics(base: Baseline) -> dict[str, Any]:
    """A traced graph's keep-all peak against the analytic graph's of the same shape (no keys if analytic)."""
    if base.analytic_peak_bytes is None:
        return {}
    return {"analytic_keep_all_peak_bytes": base.analytic_peak_bytes,
            "real_to_analytic_peak_ratio": base.keep_all_peak_bytes / base.analytic_peak_bytes}
