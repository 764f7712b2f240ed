"""The search behind `python -m pipelines.advise`: which configuration trains a model fastest on a node.

A configuration is (GPUs, ZeRO stage and shards, precision/optimizer recipe, micro-batch, planner,
plan against the allocated or the reserved peak). Each one is priced as one training step on one
GPU of the data-parallel job:

    step_s = grad_accum x (micro-step + exposed communication) + optimizer step + exposed after-step gathers

- the micro-step (forward + backward, with the plan's recomputes, swaps and stalls) is the planned
  and simulated step of the micro-batch's graph (`slackswap.experiment.fitting.plan_and_simulate`), with the
  caching allocator replayed, under the activation capacity the device leaves: device memory -
  reserve - static training state per GPU (`slackswap.memory.static`);
- communication: `slackswap.communication.step_communication` (alpha-beta ring collectives, overlap
  as FSDP / DeepSpeed / DDP schedule them);
- the optimizer step: one HBM-bound op per parameter group, timed as the profile times it
  (`optimizer_step_moved_bytes` through the roofline `op_duration_s`), on the rank's 1/N shard;
- tokens/s per GPU = grad_accum x micro-batch x seq_len / step_s; MFU = model FLOPs / (step_s x dense
  peak), both from `slackswap.experiment.throughput` (model FLOPs: the graph's forward, loss and
  backward op FLOPs, no recompute; `FLOPS_SOURCE`).

Pruning, before any planning: a (GPUs, sharding, recipe) whose static memory leaves no activation
capacity is one rejected region ("static memory does not fit"); for each, the micro-batch search
stops at the first micro-batch whose activation floor (the all-recompute floor: per op, the bytes no
plan can move, the most over ops; the MILP's `floor_bytes`) exceeds the capacity ("activations do not
fit"). Floors grow with the micro-batch, so no larger one can fit. milp runs only on the best
`milp_top_k` configurations of the heuristics (it takes ~1 s per 7B plan against ~0.05 s), and its
plan competes with theirs.

Pure library: no Hydra, no MLflow. The graph of a micro-batch comes from a caller's function, so the
caller decides where graphs come from (analytic, traced) and caches them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from slackswap.communication import (
    Topology,
    check_sharding,
    not_modelled,
    rate_limited_all_gathers,
    step_communication,
)
from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.experiment import throughput
from slackswap.experiment.advise_node import (
    graph_source,
    host_check,
    rank_hardware,
    topology_from_node,
)
from slackswap.experiment.advise_space import (
    ACTIVATIONS_DO_NOT_FIT,
    COMMUNICATION_BOUND,
    COMMUNICATION_BOUND_SHARE,
    PLAN_AGAINST,
    RECIPE_DOES_NOT_APPLY,
    STATIC_DOES_NOT_FIT,
    Advice,
    Candidate,
    Layout,
    Region,
    Row,
    SearchSpace,
    layouts,
    numerics_change,
    pareto_front,
)
from slackswap.experiment.advise_step import (
    activation_floor_bytes,
    forward_compute_s,
    infeasible_row,
    layer_param_counts,
    optimizer_step_s,
    recipe_for_layout,
)
from slackswap.graph import Graph, Phase
from slackswap.hardware import Hardware
from slackswap.memory.recipe import FSDP1, TrainingConfig
from slackswap.memory.static import bytes_per_param, static_memory
from slackswap.model_config import ModelConfig


@dataclass
class _Workload:
    """Per micro-batch: the graph, its floor, forward time and model FLOPs (computed once)."""

    graph: Graph
    floor_bytes: int
    forward_s: float
    flops: float


@dataclass
class _Context:
    model: ModelConfig
    hardware: Hardware
    topology: Topology
    space: SearchSpace
    graph_for: Callable[[int], Graph]
    #: GPU count -> the hardware one rank plans and simulates on (its host link shared on the node).
    rank_hardware: Mapping[int, Hardware] = field(default_factory=dict)
    #: (GPU count, bytes one rank offloads per step) -> why the node's host cannot hold it, or None.
    host_check: Callable[[int, int], str | None] | None = None
    #: The node (`slackswap.node.Node`): prices the pipeline's p2p sends of layout rows.
    node: Any = None
    workloads: dict[int, _Workload] = field(default_factory=dict)
    #: Sharding units (parameter groups: the layers, and the embeddings + head).
    units: int = 0
    optimizer_cache: dict[tuple[TrainingConfig, int], float] = field(default_factory=dict)
    plan_cache: dict[tuple, Any] = field(default_factory=dict)

    def workload(self, mb: int) -> _Workload:
        if mb not in self.workloads:
            graph = self.graph_for(mb)
            if any(op.phase == Phase.OPTIMIZER for op in graph.ops):
                raise ConfigError("graph_for", mb, "the search prices the optimizer step itself: "
                                  "give graphs without optimizer ops (model.include_optimizer=false)")
            self.workloads[mb] = _Workload(graph, activation_floor_bytes(graph), forward_compute_s(graph),
                                           throughput.model_flops(graph))
        return self.workloads[mb]


def _static(ctx: _Context, training: TrainingConfig) -> Any:
    from slackswap.profile import parameter_counts

    return static_memory(*parameter_counts(ctx.model), training, ctx.model.dtype)


# --- evaluating one configuration -----------------------------------------------------------------


def evaluate(ctx: _Context, cand: Candidate) -> Row:
    """Plan, simulate and price one configuration (module docstring)."""
    from slackswap.experiment.fitting import FitOptions, FittedPlan, plan_and_simulate
    from slackswap.planners.registry import get_planner
    from slackswap.profile import parameter_counts

    model, hw, space = ctx.model, ctx.hardware, ctx.space
    training = cand.training
    static = _static(ctx, training)
    capacity = hw.device_memory_bytes - space.reserve_bytes - space.margin_bytes - static.total_bytes
    work = ctx.workload(cand.micro_batch)
    key_opt = (training, cand.layout.zero_shards)
    if key_opt not in ctx.optimizer_cache:
        ctx.optimizer_cache[key_opt] = optimizer_step_s(model, hw, training)
    opt_s = ctx.optimizer_cache[key_opt]
    flops = space.grad_accum * work.flops
    rank_hw = ctx.rank_hardware.get(cand.layout.gpus, hw)
    base = dict(candidate=cand, optimizer_s=opt_s, static_bytes=static.total_bytes,
                activation_capacity_bytes=capacity, model_flops_per_step=flops, numerics=numerics_change(training),
                comm_not_modelled=not_modelled(rank_hw.collective_overlap_slowdown))
    key = (cand.micro_batch, cand.planner, cand.plan_against, capacity, id(rank_hw))
    allocated = ctx.plan_cache.get((*key[:2], "allocated", *key[3:]))
    if key not in ctx.plan_cache and cand.plan_against == "reserved" and allocated is not None and (
        isinstance(allocated, InfeasibleBudgetError) or not allocated.result.feasible or allocated.report.fits
    ):
        # Planning against the reserved peak starts with the same plan and stops at once when the
        # planner gives up, the simulator rejects the plan or the allocator serves it: the same
        # result, not recomputed (slackswap.experiment.fitting.plan_and_simulate).
        ctx.plan_cache[key] = allocated
    if key not in ctx.plan_cache:
        planner = get_planner(cand.planner, **dict(space.planners[cand.planner]))
        # Against the reserved peak the first round is the allocated peak's plan: reused, not replanned.
        first = allocated if cand.plan_against == "reserved" and isinstance(allocated, FittedPlan) else None
        try:
            options = FitOptions(allocator="caching", plan_against=cand.plan_against)
            ctx.plan_cache[key] = plan_and_simulate(planner, work.graph, rank_hw, capacity, options, first)
        except InfeasibleBudgetError as exc:
            ctx.plan_cache[key] = exc
    fitted = ctx.plan_cache[key]
    if isinstance(fitted, InfeasibleBudgetError):
        return infeasible_row(base, f"{ACTIVATIONS_DO_NOT_FIT}: planner {cand.planner}: {fitted.reason}")
    result, report = fitted.result, fitted.report
    if not result.feasible:
        return infeasible_row(base, f"{ACTIVATIONS_DO_NOT_FIT}: simulator: {result.infeasible_reason}",
                           peak_activation=None)
    micro_s = result.step_s
    num_params, _ = parameter_counts(model)
    param_b, grad_b, _, _ = bytes_per_param(training, model.dtype)
    comm = step_communication(
        num_params=num_params, param_bytes=param_b, grad_bytes=grad_b, zero_stage=cand.layout.zero_stage,
        gpus=cand.layout.gpus, shards=cand.layout.zero_shards, topology=ctx.topology,
        forward_compute_s=work.forward_s, backward_compute_s=max(micro_s - work.forward_s, 0.0),
        units=ctx.units,
    )
    per_micro_exposed = comm.forward_exposed_s + comm.backward_exposed_s
    # The overlapped collectives still cost compute on a preset calibrated for it (NCCL kernels take SMs
    # and HBM bandwidth; `Hardware.collective_overlap_slowdown`, 0 on uncalibrated presets): a fixed cost
    # per micro-batch, so it ranks small micro-batches lower, as the published runs do.
    per_micro_exposed += comm.overlap_cost_s(rank_hw.collective_overlap_slowdown)
    # FSDP1's rate limiter idles the GPU once per all-gather it holds the CPU thread on (0 under
    # fully_shard and on uncalibrated presets): another fixed cost per micro-batch.
    per_micro_exposed += rank_hw.rate_limited_all_gather_s * rate_limited_all_gathers(
        training.fsdp_api == FSDP1, cand.layout.zero_stage, cand.layout.zero_shards, ctx.units)
    exposed = space.grad_accum * per_micro_exposed + comm.after_step_comm_s
    step_s = space.grad_accum * (micro_s + per_micro_exposed) + opt_s + comm.after_step_comm_s
    tokens = space.grad_accum * cand.micro_batch * model.seq_len
    fits = bool(report.fits)
    # The reserved peak with room to spare; when the allocator serves the step only by releasing its
    # cache (that peak above the capacity, `fits` still true), the device fills to the capacity.
    reserved = min(report.peak_reserved_bytes, capacity) if fits else report.peak_reserved_bytes
    peak = static.total_bytes + space.reserve_bytes + reserved
    reason = "" if fits else f"allocator: {report.oom_reason}"
    host = ctx.host_check(cand.layout.gpus, int(result.host_pinned_bytes)) if ctx.host_check else None
    if fits and host:
        fits, reason = False, host
    slow_s = result.recompute_s + result.stall_s
    if exposed >= COMMUNICATION_BOUND_SHARE * step_s:
        bound = COMMUNICATION_BOUND
    elif slow_s >= 0.01 * step_s and slow_s >= exposed:
        bound = "recompute/stall"
    else:
        bound = "compute"
    return Row(
        status="ok", reason=reason, fits_device=fits, tokens_per_s=throughput.tokens_per_s(tokens, step_s),
        mfu=throughput.mfu(flops, step_s, hw, model.dtype), step_s=step_s, micro_step_s=micro_s,
        comm=comm, comm_exposed_s=exposed, peak_bytes=peak, headroom_bytes=hw.device_memory_bytes - peak,
        peak_activation_bytes=int(result.peak_activation_bytes), peak_reserved_bytes=report.peak_reserved_bytes,
        swapped=int(result.swapped_tensors), recomputed=int(result.recomputed_tensors),
        recompute_s=result.recompute_s, stall_s=result.stall_s, bound=bound, **base,
    )


# --- the search -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchPlan:
    """The configurations the search will evaluate, in order, after pruning; and the regions pruned."""

    candidates: tuple[Candidate, ...]
    regions: tuple[Region, ...]
    pruned_configurations: int
    milp_runs: int


def _ordered_planners(space: SearchSpace) -> list[str]:
    return [p for p in space.planners if p != "milp"]


def plan_search(model: ModelConfig, hardware: Hardware, topology: Topology, space: SearchSpace,
                graph_for: Callable[[int], Graph], **hooks: Any) -> tuple[SearchPlan, _Context]:
    """Enumerate the space and prune it (static memory, activation floors) before planning anything.
    `hooks`: `rank_hardware`, `host_check` (see `_Context`)."""
    ctx = _Context(model, hardware, topology, space, graph_for, **hooks)
    ctx.units = len(layer_param_counts(model))
    planners = _ordered_planners(space)
    per_mb = len(planners) * len(space.plan_against)
    candidates: list[Candidate] = []
    regions: list[Region] = []
    pruned = 0
    for gpus in space.gpus:
        topology.fabric_for(gpus)  # a job that spans nodes needs a network: ConfigError naming advise.gpus
        for layout in layouts(gpus, space.zero_stages, topology.gpus_per_node):
            check_sharding(layout.gpus, layout.zero_stage, layout.zero_shards)
            for recipe_name, recipe in space.recipes.items():
                where = {"gpus": gpus, "zero_stage": layout.zero_stage, "zero_shards": layout.zero_shards,
                         "layout": layout.label, "recipe": recipe_name}
                group_size = len(space.micro_batches) * per_mb
                try:
                    recipe.check_model_dtype(model.dtype)
                except ConfigError as exc:
                    regions.append(Region(RECIPE_DOES_NOT_APPLY, str(exc), where, group_size))
                    pruned += group_size
                    continue
                training = recipe_for_layout(recipe, layout)
                static = _static(ctx, training)
                capacity = hardware.device_memory_bytes - space.reserve_bytes - space.margin_bytes - static.total_bytes
                if capacity <= 0:
                    detail = (f"{static.describe()}; + reserve {space.reserve_bytes / 2**30:.2f} GiB + margin "
                              f"{space.margin_bytes / 2**30:.2f} GiB is "
                              f"{-capacity / 2**30:.2f} GiB over {hardware.device_memory_bytes / 2**30:.2f} GiB")
                    regions.append(Region(STATIC_DOES_NOT_FIT, detail, where, group_size))
                    pruned += group_size
                    continue
                for i, mb in enumerate(space.micro_batches):
                    floor = ctx.workload(mb).floor_bytes
                    if floor > capacity:
                        left = len(space.micro_batches) - i
                        detail = (f"from micro-batch {mb} up: activation floor {floor / 2**30:.2f} GiB > capacity "
                                  f"{capacity / 2**30:.2f} GiB (device - reserve - margin - static)")
                        regions.append(Region(ACTIVATIONS_DO_NOT_FIT, detail, {**where, "micro_batch": mb},
                                              left * per_mb))
                        pruned += left * per_mb
                        break
                    for planner in planners:
                        for against in space.plan_against:
                            candidates.append(Candidate(layout, recipe_name, training, mb, planner, against))
    milp_runs = 0
    if "milp" in space.planners and candidates:
        milp_runs = min(space.milp_top_k, len(candidates)) * len(space.plan_against)
    return SearchPlan(tuple(candidates), tuple(regions), pruned, milp_runs), ctx


def _no_graphs(mb: int) -> Graph:
    raise AssertionError(f"a task's context carries its micro-batch's workload; {mb} was not shipped")


def _evaluate_group(task: tuple[_Context, tuple[Candidate, ...]]) -> list[Row]:
    ctx, cands = task
    return [evaluate(ctx, c) for c in cands]


def _task_context(ctx: _Context, mb: int) -> _Context:
    """What one task needs of `ctx`: its micro-batch's workload, empty plan caches, no graph source
    (the source's cache holds every graph; a worker would be sent them all)."""
    return replace(ctx, graph_for=_no_graphs, workloads={mb: ctx.workload(mb)}, plan_cache={},
                   optimizer_cache=dict(ctx.optimizer_cache))


def _evaluate_all(ctx: _Context, cands: Sequence[Candidate]) -> Iterator[Row]:
    """`evaluate` every candidate, rows in candidate order, over the space's joblib workers. A task is
    a run of consecutive candidates of one (layout, recipe, micro-batch): its planners share the
    graph, and a plan against the reserved peak reuses the one against the allocated peak. Caches only
    memoise, so the rows do not depend on how many workers ran them."""
    from slackswap.experiment.parallel_map import ordered_map

    groups: list[list[Candidate]] = []
    for c in cands:
        if groups and _config_key_of(groups[-1][-1]) == _config_key_of(c):
            groups[-1].append(c)
        else:
            groups.append([c])
    tasks = ((_task_context(ctx, g[0].micro_batch), tuple(g)) for g in groups)
    for rows in ordered_map(_evaluate_group, tasks, ctx.space.n_jobs, ctx.space.backend):
        yield from rows


def _config_key_of(c: Candidate) -> tuple:
    return (c.layout, c.recipe, c.micro_batch)


def _rank_key(row: Row) -> tuple:
    return (-(row.tokens_per_s or 0.0), row.peak_bytes or 0, row.candidate.layout.gpus)


def run_search(
    model: ModelConfig,
    hardware: Hardware,
    topology: Topology,
    space: SearchSpace,
    graph_for: Callable[[int], Graph],
    *,
    on_row: Callable[[int, int, Row], None] | None = None,
    rank_hardware: Mapping[int, Hardware] | None = None,
    host_check: Callable[[int, int], str | None] | None = None,
    node: Any = None,
) -> Advice:
    """Prune, evaluate every remaining configuration (`on_row(i, n, row)` after each, i from 1), run
    milp on the best heuristic configurations, rank, and explain the winners.

    `rank_hardware`: GPU count -> the per-rank hardware (shared host link) to plan on; absent counts
    use `hardware`. `host_check(gpus, host_pinned_bytes)`: why the host cannot pin a plan's host buffers."""
    plan, ctx = plan_search(model, hardware, topology, space, graph_for, rank_hardware=dict(rank_hardware or {}),
                            host_check=host_check, node=node)
    total = len(plan.candidates) + plan.milp_runs
    rows: list[Row] = []
    for row in _evaluate_all(ctx, plan.candidates):
        rows.append(row)
        if on_row:
            on_row(len(rows), total, rows[-1])
    if plan.milp_runs:
        fitting = sorted((r for r in rows if r.fits_device), key=_rank_key)
        seen: set[tuple] = set()
        tops = []
        for r in fitting:
            c = r.candidate
            k = (c.layout, c.recipe, c.micro_batch)
            if k not in seen:
                seen.add(k)
                tops.append(c)
            if len(tops) == space.milp_top_k:
                break
        milp = [replace(c, planner="milp", plan_against=against) for c in tops for against in space.plan_against]
        for row in _evaluate_all(ctx, milp):
            rows.append(row)
            if on_row:
                on_row(len(rows), total, rows[-1])
        total = len(rows)
    regions = list(plan.regions) + _communication_regions(rows)
    pruned = plan.pruned_configurations
    if space.searches_layouts:
        from slackswap.experiment.advise_layout import search_layouts

        found = search_layouts(ctx, rows, on_row=on_row)
        rows += found.rows
        regions += found.regions
        pruned += found.pruned
    ranked = sorted((i for i, r in enumerate(rows) if r.fits_device), key=lambda i: _rank_key(rows[i]))
    best: dict[int, int] = {}
    faithful: dict[int, int] = {}
    for i in ranked:
        best.setdefault(rows[i].candidate.layout.gpus, i)
        if not rows[i].numerics:
            faithful.setdefault(rows[i].candidate.layout.gpus, i)
    rows = _explain(rows, ranked, best)
    return Advice(tuple(rows), tuple(regions), best, tuple(ranked), pruned, faithful)


def _communication_regions(rows: Sequence[Row]) -> list[Region]:
    """A (GPUs, layout) every fitting row of which is communication bound."""
    groups: dict[Layout, list[Row]] = {}
    for r in rows:
        if r.fits_device:
            groups.setdefault(r.candidate.layout, []).append(r)
    out = []
    for layout, members in groups.items():
        if layout.gpus > 1 and all(r.bound == COMMUNICATION_BOUND for r in members):
            best = min(members, key=_rank_key)
            detail = (f"exposed communication {best.comm_exposed_s:.3f} s of a {best.step_s:.3f} s step at best "
                      f"({best.comm.fabric}; >= {COMMUNICATION_BOUND_SHARE:.0%} of the step)")
            out.append(Region(COMMUNICATION_BOUND, detail,
                              {"gpus": layout.gpus, "zero_stage": layout.zero_stage,
                               "zero_shards": layout.zero_shards, "layout": layout.label}, len(members)))
    return out


def _differences(a: Candidate, b: Candidate) -> str:
    fields = []
    for key, va in a.choices().items():
        vb = b.choices()[key]
        if key in ("gpus", "zero_stage", "zero_shards"):
            continue
        if va != vb:
            fields.append(f"{key} {vb}")
    return ", ".join(fields) or "same choices"


def _config_key(row: Row) -> tuple:
    c = row.candidate
    return (c.layout, c.recipe, c.micro_batch)


def distinct_ranked(advice: Advice) -> list[int]:
    """The ranked rows, one per (layout, recipe, micro-batch) and throughput: planners that give the
    same step (every planner keeps everything when it all fits) are one line, listed in `ties`."""
    seen: set[tuple] = set()
    out = []
    for i in advice.ranked:
        r = advice.rows[i]
        k = (*_config_key(r), r.tokens_per_s)
        if k not in seen:
            seen.add(k)
            out.append(i)
    return out


def ties(advice: Advice, index: int) -> list[str]:
    """`planner/plan_against` of every fitting row with the same configuration and throughput."""
    r = advice.rows[index]
    return [f"{o.candidate.planner}/{o.candidate.plan_against}" for o in (advice.rows[j] for j in advice.ranked)
            if _config_key(o) == _config_key(r) and o.tokens_per_s == r.tokens_per_s]


def _explain(rows: list[Row], ranked: Sequence[int], best: Mapping[int, int]) -> list[Row]:
    """Why each GPU count's winner wins: what it does with memory, and its margin over the runner-up
    of the same GPU count."""
    out = list(rows)
    for gpus, i in best.items():
        r = rows[i]
        # The runner-up: the best other configuration of this GPU count that differs in more than the
        # planner or the planning target, or that gives another throughput.
        same = [j for j in ranked if rows[j].candidate.layout.gpus == gpus and j != i
                and (_config_key(rows[j]) != _config_key(r) or rows[j].tokens_per_s != r.tokens_per_s)]
        parts = []
        if r.recomputed or r.swapped:
            parts.append(f"recomputes {r.recomputed} and swaps {r.swapped} tensors "
                         f"(+{r.recompute_s:.3f} s recompute, {r.stall_s:.3f} s stall per micro-step)")
        else:
            parts.append("keeps every activation (no recompute, no swap)")
        parts.append(f"micro-batch {r.candidate.micro_batch} fills the device to "
                     f"{r.peak_bytes / 2**30:.1f} GiB")
        if r.comm is not None and r.comm.total_comm_s:
            parts.append(f"communication {r.comm.total_comm_s:.3f} s, {r.comm_exposed_s:.3f} s exposed "
                         f"({r.comm.fabric})")
        if r.numerics:
            parts.append(f"changes the training's numerics ({r.candidate.recipe}: {r.numerics})")
        if same:
            ru = rows[same[0]]
            margin = (r.tokens_per_s - ru.tokens_per_s) / ru.tokens_per_s
            parts.append(f"{margin:+.1%} over the runner-up ({ru.candidate.layout.label}: "
                         f"{_differences(r.candidate, ru.candidate)})")
        out[i] = replace(r, why="; ".join(parts))
    return out


#: The records (`advise_space`) and the node's part (`advise_node`) stay importable from here.
__all__ = ["ACTIVATIONS_DO_NOT_FIT", "Advice", "COMMUNICATION_BOUND", "COMMUNICATION_BOUND_SHARE", "Candidate",
    "Layout", "PLAN_AGAINST", "RECIPE_DOES_NOT_APPLY", "Region", "Row", "STATIC_DOES_NOT_FIT", "SearchSpace",
    "graph_source", "host_check", "layouts", "pareto_front", "rank_hardware", "topology_from_node"]
