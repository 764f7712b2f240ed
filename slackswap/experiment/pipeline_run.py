"""One run of a pipeline layout (parallel.pp > 1): every stage planned under its own budget, then the
pipeline's step simulated over them (docs/pipeline_parallel.md).

Per stage i of p (`slackswap.profile.stages.build_stage_graph`), holding k_i = min(p - i, m)
micro-batches under 1F1B (`slackswap.pipeline_stages.in_flight_microbatches`):

1. its keep-all plan simulated alone gives its keep-all pipeline peak, (k_i - 1) x what one
   micro-batch holds after its forward + the micro-batch's own peak
   (`slackswap.simulate.pipeline_stage.stage_peak_bytes`), and its static memory is its own
   parameters' (the stage's layers, plus embedding or head);
2. the run's budget resolves against those: a fraction of the stage's keep-all pipeline peak, an
   absolute budget, or the stage's device capacity (`budget.device`). That is the stage's budget;
3. the planner plans ONE micro-batch of the stage, and the simulator runs it, under planning budgets
   from the stage's budget down to budget / k_i (`_plan_device`): the first whose pipeline peak with
   k_i micro-batches in flight is within the budget is the stage's plan. budget / k_i always is when
   it plans at all (the k_i - 1 resident micro-batches hold no more than their peak each); a larger
   planning budget swaps less when the resident bytes are small beside the transients;
4. its forward, backward and tail times, and the prefetch wait before its backward that idle time
   can hide, go to `slackswap.simulate.pipeline.simulate_pipeline` with m micro-batches and the p2p
   send time of one boundary activation on the link between neighbouring stages, with the exposed
   part of the stage's tp / cp collectives added to its forward and backward (`_times`; the same
   `slackswap.profile.collectives.price` a one-stage run adds to its step).

The step time is the pipeline's. The planners see one micro-batch: the copies they plan hide under
that micro-batch's own compute, and the pipeline credits only the wait before the backward against
the stage's bubble; copies of different micro-batches do not contend for the copy engines in this
model. The simulation keys of metrics.json describe
stage 0's rank over the step (it holds the most micro-batches): per-micro-batch sums x m, host
bytes x k_0; `peak_activation_bytes`, `keep_all_peak_bytes` and `budget_bytes` are the largest
stage's; the `pipeline_*` keys give each stage.

The bound (`with_bound`, when the planner gives one: `planner=milp`, as a one-stage run's
`bound_step_s`): per chunk, a `slackswap.simulate.pipeline_bound.StageFloor` that every plan the
stage may run meets, then `pipeline_bound` over them (why that is <= the pipeline step: its
docstring). The floor's `step_s` is the milp bound of the chunk's graph at the STAGE budget B, plus
the exposed collectives `_times` adds. It covers every plan the stage may run: `_plan_device` tries
planning budgets B' <= B and simulates each plan under its B'; the plan it keeps has a pipeline peak
<= B, so its one micro-batch ran with an activation peak <= B' <= B. The milp bound at B holds for
every graph-order plan whose simulated run stays within B (docs/milp.md: each row holds in such a
run), so whichever B' was kept, the plan's forward + backward is >= the bound at B, the loosest of
them. The bound is of the graph without its optimizer ops (`_without_optimizer`): they read and
write no activation and run after the last backward, so the run of the rest is the same up to the
end of the last backward, where the milp's step then ends; the tail's floor is their durations.
The floor's `forward_s` / `backward_s` are the forward (and loss) and backward ops' durations plus
the collectives: a plan's forward runs each forward op once after its hideable wait, its backward
each backward op once after its own, so f - fh and b - bh are never below them (they are the
keep-all run's times). The milp's assumption carries over: run steps in graph order
(`build_schedule`, which every planner here uses).

Interleaved 1F1B (`parallel.virtual_stages` v > 1): "stage" above is a device and its graph v chunk
graphs (chunks d, d + p, ...). k_i counts micro-batch chunks as the device's order holds them, the
pipeline peak walks that order with each chunk's resident bytes and peak
(`slackswap.simulate.pipeline_stage.device_peak_bytes`), the static memory is all its chunks'
parameters, every chunk is planned under the same planning budget, and the pipeline step runs the
p x v chunks (`simulate_pipeline(..., schedule="interleaved", virtual_stages=v)`). Stage 0's
simulation keys add the per-micro-batch sums of device 0's chunks; its graph and plan are chunk 0's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from slackswap.errors import InfeasibleBudgetError, SolverError
from slackswap.experiment.baseline import Baseline
from slackswap.experiment.fitting import FittedPlan, plan_and_simulate
from slackswap.experiment.spec import RunSpec
from slackswap.graph import Graph
from slackswap.memory.static import DeviceCapacity, StaticMemory, static_memory
from slackswap.parallel import ParallelConfig
from slackswap.pipeline_stages import in_flight_microbatches, schedule_order
from slackswap.simulate.pipeline import PipelineResult, StageTimes, simulate_pipeline
from slackswap.simulate.pipeline_bound import PipelineBound, StageFloor, pipeline_bound
from slackswap.simulate.pipeline_stage import device_peak_bytes, resident_bytes, stage_times
from slackswap.simulate.result import SimResult

#: Simulation keys that add up over the step's micro-batches (stage 0's rank runs m of them).
_PER_MICROBATCH = ("recompute_s", "stall_s", "stall_prefetch_s", "stall_memory_s", "stall_offload_s", "pin_s",
                   "compute_busy_s", "d2h_bytes", "h2d_bytes", "d2h_busy_s", "h2d_busy_s")


@dataclass(frozen=True)
class Stage:
    """One stage's graph, keep-all run, memory and (when planned) plan."""

    index: int
    graph: Graph
    ideal: SimResult
    in_flight: int
    keep_all_peak_bytes: int
    capacity: DeviceCapacity
    budget_bytes: int | None = None
    fitted: FittedPlan | None = None
    peak_bytes: int | None = None


def p2p_seconds(spec: RunSpec, boundary_bytes: int) -> tuple[float, str | None]:
    """(seconds to send one boundary activation to the next stage, why it is unpriced or None).

    Neighbouring stages are dp x tp x cp GPUs apart (Megatron-Core puts pp outermost): NVLink while
    both sit in one node, else the network (`Topology.fabric_for`), at one pair's share of the node's
    NICs: every GPU of a stage sends to its peer at once (`Topology.network_share`). No node, or stages
    that leave a node without a network: 0 s, and the reason says so."""
    if spec.node is None:
        return 0.0, "no node given"
    from slackswap.experiment.advise_node import topology_from_node

    topology = topology_from_node(spec.node, spec.hardware)
    par = spec.parallel
    stride = par.dp * par.tp * par.cp
    if stride + 1 > topology.gpus_per_node and topology.inter_node is None:
        return 0.0, (f"neighbouring stages are {stride} GPUs apart; node {spec.node.name} has "
                     f"{topology.gpus_per_node} GPUs and no network")
    fabric = topology.fabric_for(2, stride=stride)
    return fabric.latency_s + boundary_bytes / fabric.bus_bytes_per_s, None


def build_stages(spec: RunSpec) -> list[Stage]:
    """Every chunk's graph and keep-all simulation, with its device's in-flight count, keep-all
    pipeline peak and capacity (1F1B: one chunk per device, the stage)."""
    from slackswap.profile.stages import build_stage_graph, stage_parameter_counts
    from slackswap.simulate.metrics import simulate_ideal

    par = spec.parallel
    graphs = [build_stage_graph(spec.model, spec.hardware, spec.training, par, s) for s in range(par.chunks)]
    ideals = [simulate_ideal(g, spec.hardware) for g in graphs]
    counts = [stage_parameter_counts(spec.model, par, c) for c in range(par.chunks)]
    capacities = [DeviceCapacity(spec.hardware.device_memory_bytes, spec.budget.reserve_bytes,
                                 device_static(spec, counts, d)) for d in range(par.pp)]
    return device_stages(par, graphs, ideals, capacities)


def device_static(spec: RunSpec, chunk_counts: list[tuple[int, int]], device: int) -> StaticMemory:
    """Device `device`'s static memory: every one of its chunks' parameters (`chunk_counts[c]`, the
    (parameters, largest group) of chunk c) under the run's recipe; on an MoE model under ep > 1 the
    routed experts' over their expert data-parallel group (`slackswap.profile.stages.device_static_memory`)."""
    if spec.model.moe is not None and spec.parallel.ep > 1:
        from slackswap.profile.stages import device_static_memory

        return device_static_memory(spec.model, spec.parallel, spec.training, device)
    own = [chunk_counts[c] for c in range(device, spec.parallel.chunks, spec.parallel.pp)]
    return static_memory(sum(n for n, _ in own), max(u for _, u in own), spec.training, spec.model.dtype)


def device_stages(par: ParallelConfig, graphs: list[Graph], ideals: list[SimResult],
                  capacities: list[DeviceCapacity]) -> list[Stage]:
    """The `Stage` of each chunk from its graph and keep-all simulation, with its device's in-flight
    count, keep-all pipeline peak and capacity (`capacities[d]`, one per device). Apart from
    `build_stages` so that the advise layout search, which caches graphs, plans the same stages."""
    p, devices = par.pp, []
    for d in range(p):
        own = range(d, par.chunks, p)
        peak = _device_peak(par, d, [graphs[c] for c in own], [ideals[c] for c in own])
        devices.append((device_in_flight(par, d), peak, capacities[d]))
    return [Stage(s, graphs[s], ideals[s], *devices[s % p]) for s in range(par.chunks)]


def device_in_flight(par: ParallelConfig, device: int) -> int:
    """Micro-batches (interleaved: micro-batch chunks) device `device` holds at most under par's schedule."""
    return in_flight_microbatches(device, par.pp, par.microbatches, par.pipeline_schedule, par.virtual_stages)


def _device_peak(par: ParallelConfig, device: int, graphs: list[Graph], results: list[SimResult]) -> int:
    """The device's activation peak with its chunks' micro-batches in flight as its schedule holds them
    (`slackswap.simulate.pipeline_stage.device_peak_bytes`; 1F1B: (k - 1) x R + P)."""
    order = schedule_order(par.pipeline_schedule, device, par.pp, par.microbatches, par.virtual_stages)
    return device_peak_bytes(order, [resident_bytes(g, r) for g, r in zip(graphs, results, strict=True)],
                             [r.peak_activation_bytes for r in results])


def _simulate(spec: RunSpec, times: list[StageTimes], p2p_s: float) -> PipelineResult:
    par = spec.parallel
    return simulate_pipeline(times, par.microbatches, p2p_s, par.pipeline_schedule, par.virtual_stages)


@dataclass(frozen=True)
class PipelineOutcome:
    """What `plan_pipeline` made of the stages: each planned, and the pipeline's step (None when a
    stage had no feasible plan: `reason` names the stage and why)."""

    stages: tuple[Stage, ...]
    pipeline: PipelineResult | None
    ideal_pipeline: PipelineResult
    p2p_s: float
    p2p_unpriced: str | None
    reason: str
    plan_wall_s: float
    sim_wall_s: float
    #: The pipeline step's lower bound (`with_bound`); None without one.
    bound: PipelineBound | None = None


def plan_pipeline(spec: RunSpec, stages: list[Stage]) -> PipelineOutcome:
    """Plan and simulate each device's chunks under its budget, then the pipeline step (module docstring)."""
    from slackswap.profile.stages import boundary_bytes

    p = spec.parallel.pp
    p2p_s, unpriced = p2p_seconds(spec, boundary_bytes(stages[0].graph) if len(stages) > 1 else 0)
    ideal_pipeline = _simulate(spec, [_times(spec, s.graph, s.ideal) for s in stages], p2p_s)
    planned: dict[int, Stage] = {}
    reason, plan_wall, sim_wall = "", 0.0, 0.0
    held = "micro-batch chunks" if spec.parallel.virtual_stages > 1 else "micro-batches"
    for d in range(p):
        chunks = [s for s in stages if s.index % p == d]
        first = chunks[0]
        if spec.budget.device and not first.capacity.fits:
            reason = (f"device memory: stage {d}: static training state "
                      f"{first.capacity.static.total_bytes} bytes + reserve fill the device")
            break
        budget = spec.budget.resolve_bytes(first.keep_all_peak_bytes, first.capacity.activation_capacity_bytes)
        fitted, peak, why, walls = _plan_device(spec, d, chunks, budget)
        plan_wall += walls[0]
        sim_wall += walls[1]
        for i, s in enumerate(chunks):
            planned[s.index] = Stage(**{**s.__dict__, "budget_bytes": budget, "peak_bytes": peak,
                                        "fitted": None if fitted is None else fitted[i]})
        if fitted is None:
            reason = f"stage {d} ({first.in_flight} {held} in flight, budget {budget} bytes): {why}"
            break
    pipeline = None
    if not reason:
        t0 = time.perf_counter()
        pipeline = _simulate(spec, [_times(spec, s.graph, planned[s.index].fitted.result) for s in stages], p2p_s)
        sim_wall += time.perf_counter() - t0
    done = tuple(planned[i] for i in sorted(planned))
    return PipelineOutcome(done, pipeline, ideal_pipeline, p2p_s, unpriced, reason, plan_wall, sim_wall)


#: Planning budgets tried per stage, as fractions of the way from budget to budget / in-flight (geometric).
PLANNING_STEPS = 6


def _plan_device(spec: RunSpec, device: int, chunks: list[Stage], budget: int
                 ) -> tuple[list[FittedPlan] | None, int | None, str, tuple[float, float]]:
    """Plans of one micro-batch of each of the device's chunks (1F1B: its one stage) whose device peak
    (`_device_peak`, k micro-batch chunks in flight) stays within `budget`: every chunk under one
    planning budget, from `budget` down to budget / k (the sound floor: each held chunk keeps at most
    its peak, `slackswap.pipeline_stages.stage_budget_bytes`), geometrically, the first whose plans
    simulate within it. (None, None, why, walls) when none does."""
    k, plan_wall, sim_wall, why = chunks[0].in_flight, 0.0, 0.0, ""
    steps = 1 if k == 1 else PLANNING_STEPS
    for t in range(steps):
        planning = budget if steps == 1 else int(budget * k ** (-t / (steps - 1)))
        fits: list[FittedPlan] = []
        for s in chunks:
            try:
                fitted = plan_and_simulate(spec.planner, s.graph, spec.hardware, planning, spec.fit)
            except InfeasibleBudgetError as exc:
                why = f"planner: {exc.reason}"
                break
            plan_wall += fitted.plan_wall_s
            sim_wall += fitted.sim_wall_s
            if not fitted.result.feasible:
                why = f"simulator: {fitted.result.infeasible_reason}"
                break
            fits.append(fitted)
        if len(fits) < len(chunks):
            continue
        peak = _device_peak(spec.parallel, device, [s.graph for s in chunks], [f.result for f in fits])
        if spec.fit.plan_against == "reserved":
            # against the reserved peak: one micro-batch's fragmentation (reserved - allocated) on top
            peak += max((max(f.report.peak_reserved_bytes - f.result.peak_activation_bytes, 0)
                         for f in fits if f.report is not None), default=0)
        if peak <= budget:
            return fits, peak, "", (plan_wall, sim_wall)
        why = f"pipeline peak {peak} bytes with {k} micro-batches in flight over the budget"
    tried = f"{steps} planning budgets from {budget} down to {budget // k} bytes; at the last, "
    return None, None, (tried if steps > 1 else "") + why, (plan_wall, sim_wall)


def with_bound(spec: RunSpec, out: PipelineOutcome) -> PipelineOutcome:
    """`out` with the pipeline step's lower bound (module docstring) when the planner gives bounds and
    every stage has a plan; `out` itself otherwise, and when HiGHS finds no bound for a stage (it
    cannot be infeasible for a stage with a plan within its budget, short of solver numerics)."""
    bound = getattr(spec.planner, "bound", None)
    if bound is None or out.pipeline is None:
        return out
    t0 = time.perf_counter()
    floors = []
    for s in out.stages:
        try:
            floors.append(_stage_floor(spec, s, bound))
        except (InfeasibleBudgetError, SolverError):
            return replace(out, plan_wall_s=out.plan_wall_s + time.perf_counter() - t0)
    par = spec.parallel
    found = pipeline_bound(floors, par.microbatches, out.p2p_s, par.pipeline_schedule, par.virtual_stages)
    return replace(out, bound=found, plan_wall_s=out.plan_wall_s + time.perf_counter() - t0)


def _stage_floor(spec: RunSpec, stage: Stage, bound) -> StageFloor:
    """What every plan chunk `stage` may run costs at least per micro-batch (module docstring): the
    milp bound at the stage budget (the plan's own when it was planned at that budget), the floor
    forward and backward, each with the exposed collectives `_times` adds to any plan alike."""
    from slackswap.experiment.layout_comm import layout_communication
    from slackswap.graph import FORWARD_PHASES, OpClass, Phase

    graph, fitted = stage.graph, stage.fitted
    core = _without_optimizer(graph)
    if (core is graph and fitted.plan.bound_step_s is not None
            and fitted.planning_budget_bytes == stage.budget_bytes):
        milp_s = fitted.plan.bound_step_s
    else:
        milp_s = bound(core, spec.hardware, stage.budget_bytes)[0].bound_step_s
    comm = layout_communication(spec, graph)
    cf, cb = (comm.forward_exposed_s, comm.backward_exposed_s) if comm is not None and comm.exposed_s else (0, 0)
    forward = sum(op.duration_s for op in graph.ops if op.phase in FORWARD_PHASES)
    backward = sum(op.duration_s for op in graph.ops if op.phase == Phase.BACKWARD)
    tail = sum(op.duration_s for op in graph.ops if op.phase == Phase.OPTIMIZER)
    weight = sum(op.duration_s for op in graph.ops if op.phase == Phase.BACKWARD and op.op_class == OpClass.MATMUL) / 2
    return StageFloor(forward + cf, backward + cb, milp_s + cf + cb, tail, weight)


def _without_optimizer(graph: Graph) -> Graph:
    """`graph` without its optimizer ops (they have no activation inputs or outputs); `graph` itself
    when it has none."""
    from slackswap.graph import Phase

    if not any(op.phase == Phase.OPTIMIZER for op in graph.ops):
        return graph
    return replace(graph, ops=tuple(op for op in graph.ops if op.phase != Phase.OPTIMIZER))


def stage_baseline(stage: Stage, profile_s: float, ideal_s: float) -> Baseline:
    return Baseline(stage.graph, stage.ideal, profile_s, ideal_s)


def _times(spec: RunSpec, graph: Graph, result: SimResult) -> StageTimes:
    """One micro-batch's stage times (`stage_times`) plus the exposed part of the stage's layout
    collectives in its forward and backward (nothing when the layout adds none or the node cannot
    price them: `layout_comm_unpriced` says so)."""
    from slackswap.experiment.layout_comm import layout_communication

    t = stage_times(graph, result)
    comm = layout_communication(spec, graph)
    if comm is None or not comm.exposed_s:
        return t
    return replace(t, forward_s=t.forward_s + comm.forward_exposed_s,
                   backward_s=t.backward_s + comm.backward_exposed_s)


def pipeline_simulation_metrics(spec: RunSpec, out: PipelineOutcome) -> dict[str, Any]:
    """The simulation keys of metrics.json for a pipeline run (module docstring says whose they are)."""
    from slackswap.simulate.metrics import compute_metrics, unsimulated_metrics

    first = out.stages[0]
    m, p = spec.parallel.microbatches, spec.parallel.pp
    if first.fitted is None:
        metrics = unsimulated_metrics(first.ideal, first.budget_bytes, out.reason)
    else:
        metrics = compute_metrics(first.fitted.result, first.ideal, plan_wall_s=out.plan_wall_s,
                                  sim_wall_s=out.sim_wall_s)
        # Interleaved: device 0 runs each of its chunks m times; add the others' per-micro-batch sums.
        others = [compute_metrics(s.fitted.result, s.ideal, plan_wall_s=None, sim_wall_s=None)
                  for s in out.stages[1:] if s.index % p == 0]
        for key in _PER_MICROBATCH:
            if metrics[key] is not None:
                metrics[key] = (metrics[key] + sum(o[key] or 0 for o in others)) * m
        for key in ("host_peak_bytes", "host_pinned_bytes"):
            if metrics[key] is not None:
                metrics[key] = max([metrics[key]] + [o[key] or 0 for o in others]) * first.in_flight
    step = out.pipeline.step_s if out.pipeline is not None else None
    metrics["feasible"] = out.pipeline is not None
    metrics["infeasible_reason"] = out.reason or None
    metrics["step_s"] = step
    metrics["ideal_step_s"] = out.ideal_pipeline.step_s
    metrics["throughput_ratio"] = None if step is None else out.ideal_pipeline.step_s / step
    bound = None if out.bound is None or step is None else out.bound.step_s
    metrics["bound_step_s"] = bound
    metrics["optimality_gap"] = None if bound is None else step / bound - 1.0
    peaks = [s.peak_bytes for s in out.stages]
    metrics["peak_activation_bytes"] = max(peaks) if out.pipeline is not None else None
    metrics["keep_all_peak_bytes"] = max(s.keep_all_peak_bytes for s in out.stages)
    budgets = [s.budget_bytes for s in out.stages if s.budget_bytes is not None]
    metrics["budget_bytes"] = max(budgets) if budgets else None
    return metrics


def _per_stage(values) -> str:
    return ",".join("" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v)) for v in values)


def pipeline_metrics(spec: RunSpec, out: PipelineOutcome, stages: list[Stage]) -> dict[str, Any]:
    """The `pipeline` group of metrics.json: schedule, micro-batches, bubbles, p2p, each stage's figures."""
    pipe, p = out.pipeline, spec.parallel.pp
    planned = {s.index: s for s in out.stages}
    chunk_times = [None if planned.get(s.index) is None or planned[s.index].fitted is None
                   or not planned[s.index].fitted.result.feasible
                   else _times(spec, s.graph, planned[s.index].fitted.result) for s in stages]
    # Per device (1F1B: per stage); a device's forward / backward is its chunks' for one micro-batch.
    times = [None if any(chunk_times[c] is None for c in range(d, len(stages), p))
             else StageTimes(sum(chunk_times[c].forward_s for c in range(d, len(stages), p)),
                             sum(chunk_times[c].backward_s for c in range(d, len(stages), p)))
             for d in range(p)]
    stages = stages[:p]  # chunk d is device d's first: the device's memory fields
    return {
        "pipeline_schedule": spec.parallel.pipeline_schedule,
        "pipeline_microbatches": spec.parallel.microbatches,
        "pipeline_virtual_stages": spec.parallel.virtual_stages,
        "pipeline_bubble_fraction": None if pipe is None else pipe.bubble_fraction,
        "pipeline_ideal_bubble_fraction": out.ideal_pipeline.bubble_fraction,
        "pipeline_p2p_s": out.p2p_s,
        "pipeline_p2p_unpriced": out.p2p_unpriced,
        "pipeline_in_flight_by_stage": _per_stage(s.in_flight for s in stages),
        "pipeline_budget_bytes_by_stage": _per_stage(getattr(planned.get(s.index), "budget_bytes", None)
                                                  for s in stages),
        "pipeline_peak_bytes_by_stage": _per_stage(getattr(planned.get(s.index), "peak_bytes", None) for s in stages),
        "pipeline_keep_all_peak_bytes_by_stage": _per_stage(s.keep_all_peak_bytes for s in stages),
        "pipeline_forward_s_by_stage": _per_stage(None if t is None else t.forward_s for t in times),
        "pipeline_backward_s_by_stage": _per_stage(None if t is None else t.backward_s for t in times),
        "pipeline_static_bytes_by_stage": _per_stage(s.capacity.static.total_bytes for s in stages),
        "pipeline_bound_s_by_stage": None if out.bound is None else _per_stage(out.bound.device_work_s),
    }


def stage_fits(out: PipelineOutcome) -> tuple[bool | None, int]:
    """(every stage's peak within its device capacity, the least headroom over the stages)."""
    if out.pipeline is None:
        return None, min(s.capacity.activation_capacity_bytes for s in out.stages)
    fits = all(s.peak_bytes <= s.capacity.activation_capacity_bytes for s in out.stages)
    return fits, min(s.capacity.activation_capacity_bytes - s.peak_bytes for s in out.stages)


__all__ = ["PipelineOutcome", "Stage", "StageTimes", "build_stages", "device_stages", "device_static",
           "p2p_seconds", "pipeline_metrics",
           "pipeline_simulation_metrics", "plan_pipeline", "stage_baseline", "stage_fits", "with_bound"]
