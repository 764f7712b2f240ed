"""The layout half of the advise search: tensor, pipeline and context parallelism (`advise.tp`, `pp`,
`cp`, with sequence parallelism on tp > 1, and micro-batches per pipeline), dp = GPUs / (tp pp cp).

Coarse to fine, so that a 70B model on 64 GPUs answers in seconds:

1. **enumerate and prune without graphs**: a (tp, pp, cp) whose product does not divide the GPU count
   is not a layout of it (skipped); one that does not divide the model (`ParallelConfig.check_model`:
   tp the heads, KV heads and MLP width, pp the layers, cp the sequence) or puts a tp group across
   nodes is a rejected region; ZeRO over the dp group: stages 0 and 1 with a pipeline (Megatron's
   DDP and distributed optimizer), every searched stage on a pp = 1 layout (`_zero_stages`); a
   (layout, recipe) whose static memory on its fullest stage (its own parameters,
   `slackswap.profile.stages.stage_parameter_counts`; under ZeRO-k over the dp group, the ZeRO
   paper's per-rank terms of that stage's parameters, `slackswap.memory.static.static_memory`) leaves
   no activation capacity is a region **static memory does not fit**;
2. **rank by an optimistic estimate**: the full model's keep-all compute of one micro-batch split
   evenly over tp x cp x pp ranks, times (m + pp - 1) micro-batch slots of 1F1B, plus the tp
   all-reduces' ring time at the bus bandwidth (4 per layer, Megatron) and the optimizer step on the
   rank's shard. Every term is at most what the planned step costs, so its tokens/s is an upper bound;
3. **plan best-first**: the stages of each configuration are built (`build_stage_graph`), their
   activation floors checked against their capacity (a floor over it: **activations do not fit**, and
   every larger micro-batch of the layout is skipped), planned per stage under its own budget
   (`slackswap.experiment.pipeline_run.plan_pipeline`) and run through the pipeline's step model
   (`slackswap.simulate.pipeline`), with the exposed part of the stage's tp / cp collectives added to
   its forward and backward (`slackswap.profile.collectives.price`: tp in full, a cp ring beyond the
   attention it overlaps) and its optimizer step as its tail, plus the data-parallel gradient
   reduction once per step, overlapping the last backward (`step_communication` over the dp ranks,
   tp x cp GPUs apart). A configuration whose optimistic estimate cannot beat the best configuration
   planned so far (data-parallel ones included; for a numerics-preserving recipe, the
   best such) is not planned, nor any beyond `advise.layout_top_n`: region **not planned**.

Planned against the reserved peak (when `advise.plan_against` lists it) with the search's first
planner, then its others unless that plan keeps every activation (every planner would then give the
same step). A stage's peak on the device: static + reserve + communication buffers + its activation
peak with its in-flight micro-batches, plus the fragmentation (reserved - allocated) the allocator
replay of one micro-batch shows. Communication buffers: under sp, one full-sequence activation (the
all-gather's output, not a graph tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from slackswap.communication import Topology, all_reduce_s, not_modelled, step_communication
from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.experiment import throughput
from slackswap.experiment.advise_space import (
    ACTIVATIONS_DO_NOT_FIT,
    COMMUNICATION_BOUND,
    COMMUNICATION_BOUND_SHARE,
    LAYOUT_DOES_NOT_DIVIDE,
    NOT_PLANNED,
    STATIC_DOES_NOT_FIT,
    Candidate,
    Layout,
    Region,
    Row,
    StagePlan,
    numerics_change,
)
from slackswap.experiment.advise_step import (
    activation_floor_bytes,
    infeasible_row,
    optimizer_step_s,
    recipe_for_layout,
)
from slackswap.experiment.parallel_map import effective_n_jobs, ordered_map
from slackswap.memory.static import bytes_per_param, static_memory
from slackswap.parallel import ParallelConfig

#: What the layout rows leave out (advice.json `layout_note`).
LAYOUT_NOTE = ("tp collectives on the critical path (no overlap), cp rings beyond the attention they overlap; "
               "dp gradient reduce once per step overlapping the last backward (ZeRO-3: gathers per micro-batch); "
               "ZeRO-2/3 with pp and ep not searched; interleaved schedules not modelled; no host check of offloads")


@dataclass
class LayoutSearch:
    rows: list[Row] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    pruned: int = 0


@dataclass(frozen=True)
class _Config:
    layout: Layout
    recipe: str
    training: Any
    micro_batch: int
    bound_tokens_per_s: float


def _shapes(ctx: Any, gpus: int, out: LayoutSearch) -> list[tuple[int, int, int]]:
    space, model = ctx.space, ctx.model
    shapes = []
    for tp in space.tp:
        for pp in space.pp:
            for cp in space.cp:
                if (tp, pp, cp) == (1, 1, 1) or gpus % (tp * pp * cp):
                    continue
                where = {"gpus": gpus, "tp": tp, "pp": pp, "cp": cp, "layout": f"tp{tp} pp{pp} cp{cp}"}
                per = len(space.recipes) * len(space.micro_batches)
                try:
                    ParallelConfig(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp,
                                   sp=space.sp and tp > 1).check_model(model)
                except ConfigError as exc:
                    out.regions.append(Region(LAYOUT_DOES_NOT_DIVIDE, str(exc), where, per))
                    out.pruned += per
                    continue
                if tp > ctx.topology.gpus_per_node:
                    out.regions.append(Region(LAYOUT_DOES_NOT_DIVIDE, f"parallel.tp={tp}: a tp group spans nodes of "
                                              f"{ctx.topology.gpus_per_node} GPUs", where, per))
                    out.pruned += per
                    continue
                shapes.append((tp, pp, cp))
    return shapes


def _zero_stages(searched: tuple[int, ...], dp: int, pp: int) -> list[int]:
    """The ZeRO stages a (dp, pp) layout is searched under, over its dp group: 0 alone without data
    parallelism; 0 and 1 (Megatron's DDP and distributed optimizer) with a pipeline, as Megatron and
    DeepSpeed run it (DeepSpeed refuses ZeRO-2/3 with pipeline parallelism: its gradient partitions
    would be reduced once per micro-batch); every searched stage otherwise (tp / cp x ZeRO-3 is FSDP
    over the dp group on tp-sharded parameters)."""
    if dp == 1:
        return [0]
    stages = sorted({z for z in searched if pp == 1 or z <= 1})
    return stages or [1]


def _stage_params(ctx: Any, tp: int, pp: int) -> list[tuple[int, int]]:
    from slackswap.profile.stages import stage_parameter_counts

    key = ("params", tp, pp)
    if key not in ctx.plan_cache:
        par = ParallelConfig(tp=tp, pp=pp, microbatches=2 if pp > 1 else 1)
        ctx.plan_cache[key] = [stage_parameter_counts(ctx.model, par, i) for i in range(pp)]
    return ctx.plan_cache[key]


def comm_buffer_bytes(ctx: Any, layout: Layout, micro_batch: int) -> int:
    """Bytes of communication buffers outside the graph: under sp, the all-gather's full-sequence output."""
    if not layout.sp:
        return 0
    m = ctx.model
    return micro_batch * (m.seq_len // layout.cp) * m.hidden_size * m.bytes_per_element


def _compute_s(ctx: Any, mb: int) -> float:
    key = ("compute", mb)
    if key not in ctx.plan_cache:
        ctx.plan_cache[key] = float(sum(op.duration_s for op in ctx.graph_for(mb).ops))
    return ctx.plan_cache[key]


def _optimizer_s(ctx: Any, training: Any, params: int) -> float:

    key = (training, ctx.model.num_layers)
    if key not in ctx.optimizer_cache:
        ctx.optimizer_cache[key] = optimizer_step_s(ctx.model, ctx.hardware, training)
    from slackswap.profile import parameter_counts

    return ctx.optimizer_cache[key] * params / parameter_counts(ctx.model)[0]


def _bound(ctx: Any, layout: Layout, training: Any, mb: int, params: int) -> float:
    """Optimistic tokens/s per GPU (module docstring, step 2)."""
    m, space = ctx.model, ctx.space
    ranks = layout.tp * layout.cp * layout.pp
    slot = _compute_s(ctx, mb) / ranks
    if layout.tp > 1:
        size = mb * (m.seq_len // layout.cp) * m.hidden_size * m.bytes_per_element
        slot += 4 * (m.num_layers // layout.pp) * all_reduce_s(size, layout.tp, ctx.topology.intra_node)
    micro = layout.microbatches if layout.pp > 1 else space.grad_accum
    step = (micro + layout.pp - 1) * slot + _optimizer_s(ctx, training, params)
    return micro * mb * m.seq_len / ranks / step


def _configs(ctx: Any, gpus: int, out: LayoutSearch, incumbents: tuple[float, float]) -> list[_Config]:

    space, model, hw = ctx.space, ctx.model, ctx.hardware
    configs = []
    n_planners = len([p for p in space.planners if p != "milp"])
    for tp, pp, cp in _shapes(ctx, gpus, out):
        dp = gpus // (tp * pp * cp)
        for zero in _zero_stages(space.zero_stages, dp, pp):
            for m in (space.pipeline_microbatches if pp > 1 else (1,)):
                layout = Layout(gpus, zero, dp if zero else 1, tp, pp, cp, space.sp and tp > 1, m,
                                space.pipeline_schedule)
                for name, recipe in space.recipes.items():
                    try:
                        recipe.check_model_dtype(model.dtype)
                    except ConfigError:
                        continue  # the data-parallel search reports the recipe's region
                    training = recipe_for_layout(recipe, layout)
                    per_stage = _stage_params(ctx, tp, pp)
                    statics = [static_memory(n, unit, training, model.dtype) for n, unit in per_stage]
                    worst = max(range(pp), key=lambda i: statics[i].total_bytes)
                    room = (hw.device_memory_bytes - space.reserve_bytes - space.margin_bytes
                            - statics[worst].total_bytes - comm_buffer_bytes(ctx, layout, space.micro_batches[0]))
                    if room <= 0:
                        n = len(space.micro_batches) * n_planners
                        detail = (f"stage {worst}: {statics[worst].describe()}; with reserve and margin "
                                  f"{-room / 2**30:.2f} GiB over {hw.device_memory_bytes / 2**30:.2f} GiB")
                        out.regions.append(Region(STATIC_DOES_NOT_FIT, detail, {"gpus": gpus, "layout": layout.label,
                                                                                "recipe": name}, n))
                        out.pruned += n
                        continue
                    bounds = [_bound(ctx, layout, training, mb, per_stage[worst][0]) for mb in space.micro_batches]
                    where = {"gpus": gpus, "layout": layout.label, "recipe": name}
                    if max(bounds) < incumbents[0] and (numerics_change(training) or max(bounds) < incumbents[1]):
                        configs += [_Config(layout, name, training, mb, b) for mb, b in zip(space.micro_batches, bounds,
                                                                                             strict=True)]
                        continue  # not planned (search_layouts counts them): no floors needed
                    fit = _fitting_micro_batches(ctx, layout, training, statics)
                    if fit < len(space.micro_batches):
                        n = (len(space.micro_batches) - fit) * n_planners
                        detail = (f"from micro-batch {space.micro_batches[fit]} up: a stage's activation floor "
                                  "exceeds its capacity (device - reserve - margin - static - buffers)")
                        out.regions.append(Region(ACTIVATIONS_DO_NOT_FIT, detail, where, n))
                        out.pruned += n
                    configs += [_Config(layout, name, training, mb, b)
                                for mb, b in zip(space.micro_batches[:fit], bounds[:fit], strict=True)]
    return configs


def _floors(ctx: Any, layout: Layout, training: Any, mb: int) -> list[int]:
    """Each stage's activation floor at micro-batch `mb` (`activation_floor_bytes`), graphs cached."""

    return [activation_floor_bytes(g) for g in _graphs(ctx, layout, training, mb)]


def _fitting_micro_batches(ctx: Any, layout: Layout, training: Any, statics: list) -> int:
    """How many of the listed micro-batches (a prefix: floors grow with the micro-batch) have every
    stage's floor within its capacity; bisection, so few stage graphs are built."""
    space, hw = ctx.space, ctx.hardware

    def fits(i: int) -> bool:
        mb = space.micro_batches[i]
        room = hw.device_memory_bytes - space.reserve_bytes - space.margin_bytes - comm_buffer_bytes(ctx, layout, mb)
        return all(f <= room - s.total_bytes for f, s in zip(_floors(ctx, layout, training, mb), statics, strict=True))

    lo, hi = 0, len(space.micro_batches)  # fits(i) for i < lo; not for i >= hi
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def search_layouts(ctx: Any, dp_rows: list[Row], on_row: Callable[[int, int, Row], None] | None = None
                   ) -> LayoutSearch:
    """Plan the layouts best-first against the best data-parallel rows (module docstring)."""
    space = ctx.space
    out = LayoutSearch()
    planners = [p for p in space.planners if p != "milp"]
    against = "reserved" if "reserved" in space.plan_against else space.plan_against[0]
    for gpus in space.gpus:
        best = max((r.tokens_per_s for r in dp_rows if r.fits_device and r.candidate.layout.gpus == gpus), default=0.0)
        faithful = max((r.tokens_per_s for r in dp_rows if r.fits_device and not r.numerics
                        and r.candidate.layout.gpus == gpus), default=0.0)
        configs = sorted(_configs(ctx, gpus, out, (best, faithful)), key=lambda c: -c.bound_tokens_per_s)
        too_big: dict[tuple, int] = {}
        skipped = {"bound": 0, "top_n": 0, "floor": 0}
        planned, top_skipped = 0, 0.0

        # Best-first, speculatively `width` configurations at a time: a batch is the next configurations
        # the bar does not skip now, planned over the workers; then replayed in order under the bar as it
        # rises, dropping those it now skips. Skipping only grows stricter, so the rows are the ones a
        # one-by-one search plans, whatever the width.
        width = effective_n_jobs(space.n_jobs, space.backend)
        i = 0
        while i < len(configs):
            batch, j = [], i
            while j < len(configs) and len(batch) < width:
                if _skip(configs[j], too_big, (best, faithful), planned, space.layout_top_n) is None:
                    batch.append(j)
                j += 1
            results = ordered_map(_plan_config, ((_task_context(ctx, configs[k]), configs[k], tuple(planners), against)
                                                 for k in batch),
                                  space.n_jobs, space.backend)
            for k in range(i, j):
                cfg = configs[k]
                why = _skip(cfg, too_big, (best, faithful), planned, space.layout_top_n)
                rows, cache = next(results) if k in batch else ([], {})
                for key, value in cache.items():
                    ctx.plan_cache.setdefault(key, value)
                if why is not None:
                    skipped[why] += len(planners)
                    if why == "bound":
                        top_skipped = max(top_skipped, cfg.bound_tokens_per_s)
                    continue
                changes = bool(numerics_change(cfg.training))
                for row in rows:
                    planned += 1
                    out.rows.append(row)
                    if on_row:
                        on_row(len(dp_rows) + len(out.rows), len(dp_rows) + len(out.rows), row)
                    if "activation floor" in row.reason:
                        too_big[_shape_key(cfg)] = min(too_big.get(_shape_key(cfg), 1 << 30), cfg.micro_batch)
                    if row.fits_device:
                        best = max(best, row.tokens_per_s)
                        if not changes:
                            faithful = max(faithful, row.tokens_per_s)
            i = j
        for why, n in skipped.items():
            if n:
                detail = {"bound": f"optimistic estimate below the best planned ({best:,.0f} tokens/s per GPU; "
                                   f"{faithful:,.0f} keeping the numerics): at most {top_skipped:,.0f}",
                          "top_n": f"beyond advise.layout_top_n={space.layout_top_n} planned configurations",
                          "floor": "a smaller micro-batch of the same layout and recipe had its activation floor "
                                   "over the capacity"}[why]
                out.regions.append(Region(NOT_PLANNED if why != "floor" else ACTIVATIONS_DO_NOT_FIT, detail,
                                          {"gpus": gpus, "layout": "tp/pp/cp layouts"}, n))
                out.pruned += n
    return out


def _shape_key(cfg: _Config) -> tuple:
    """A configuration less its micro-batch: where one micro-batch's activation floor is over the
    capacity, every larger micro-batch of the same key is too."""
    return (cfg.layout.tp, cfg.layout.pp, cfg.layout.cp, cfg.layout.zero_stage, cfg.recipe)


def _skip(cfg: _Config, too_big: dict, bar: tuple[float, float], planned: int, top_n: int) -> str | None:
    """Why the best-first search does not plan `cfg` now (`search_layouts`), None if it does."""
    if cfg.micro_batch >= too_big.get(_shape_key(cfg), 1 << 30):
        return "floor"
    if cfg.bound_tokens_per_s < bar[0] and (numerics_change(cfg.training) or cfg.bound_tokens_per_s < bar[1]):
        return "bound"
    return "top_n" if planned >= top_n else None


def _task_context(ctx: Any, cfg: _Config) -> Any:
    """What planning `cfg` needs of `ctx`: its layout's cached parameter counts and stage graphs, not
    every graph the search built, nor the graph source (a worker is sent the task's context)."""
    lay = cfg.layout
    keep = {("params", lay.tp, lay.pp),
            ("graphs", lay.tp, lay.pp, lay.cp, lay.sp, cfg.micro_batch, cfg.training.fp8_linear_inputs),
            ("stages", lay.tp, lay.pp, lay.cp, lay.sp, cfg.micro_batch, cfg.training.fp8_linear_inputs)}
    return replace(ctx, graph_for=None, workloads={}, plan_cache={k: ctx.plan_cache[k] for k in keep
                                                                  if k in ctx.plan_cache},
                   optimizer_cache=dict(ctx.optimizer_cache))


def _plan_config(task: tuple) -> tuple[list[Row], dict]:
    """Every planner of one configuration, first to last, stopping where the others cannot differ (an
    activation floor over the capacity; a first plan that keeps every activation); and the stage
    graphs it built, for the search's cache."""
    ctx, cfg, planners, against = task
    rows = []
    for k, planner in enumerate(planners):
        row = evaluate_layout(ctx, Candidate(cfg.layout, cfg.recipe, cfg.training, cfg.micro_batch, planner, against))
        rows.append(row)
        if "activation floor" in row.reason:
            break
        if k == 0 and row.status == "ok" and not row.recomputed and not row.swapped:
            break  # keeps every activation: every planner gives this step
    return rows, {k: v for k, v in ctx.plan_cache.items() if k[0] == "stages"}


def _strided(topology: Topology, stride: int) -> Topology:
    """The topology a data-parallel ring sees when its ranks sit `stride` GPUs apart."""
    return replace(topology, gpus_per_node=max(1, topology.gpus_per_node // stride))


def _graphs(ctx: Any, lay: Layout, training: Any, mb: int) -> list:
    """Each stage's graph at micro-batch `mb` on the rank's hardware, cached per layout and micro-batch."""
    from slackswap.profile.stages import build_stage_graph

    hw = ctx.rank_hardware.get(lay.gpus, ctx.hardware)
    key = ("graphs", lay.tp, lay.pp, lay.cp, lay.sp, mb, training.fp8_linear_inputs)
    if key not in ctx.plan_cache:
        model = replace(ctx.model, micro_batch_size=mb, include_optimizer=False)
        par = ParallelConfig(tp=lay.tp, pp=lay.pp, cp=lay.cp, sp=lay.sp, microbatches=2 if lay.pp > 1 else 1)
        ctx.plan_cache[key] = [build_stage_graph(model, hw, training, par, i) for i in range(lay.pp)]
    return ctx.plan_cache[key]


def _stage_graphs(ctx: Any, cand: Candidate, hw: Any) -> list[tuple]:
    """Per stage: (graph, keep-all simulation, activation floor), cached per layout and micro-batch."""
    from slackswap.simulate.metrics import simulate_ideal

    lay = cand.layout
    key = ("stages", lay.tp, lay.pp, lay.cp, lay.sp, cand.micro_batch, cand.training.fp8_linear_inputs)
    if key not in ctx.plan_cache:
        graphs = _graphs(ctx, lay, cand.training, cand.micro_batch)
        floors = _floors(ctx, lay, cand.training, cand.micro_batch)
        ctx.plan_cache[key] = [(g, simulate_ideal(g, hw), f) for g, f in zip(graphs, floors, strict=True)]
    return ctx.plan_cache[key]


def evaluate_layout(ctx: Any, cand: Candidate) -> Row:
    """Plan every stage of one layout configuration and price its step (module docstring, step 3)."""
    from slackswap.budget import Budget
    from slackswap.experiment.fitting import FitOptions
    from slackswap.experiment.pipeline_run import Stage, plan_pipeline
    from slackswap.experiment.spec import RunSpec
    from slackswap.memory.static import DeviceCapacity
    from slackswap.pipeline_stages import in_flight_microbatches
    from slackswap.planners.registry import get_planner
    from slackswap.profile import layout_collectives
    from slackswap.profile.collectives import price
    from slackswap.simulate.pipeline import simulate_pipeline
    from slackswap.simulate.pipeline_stage import stage_peak_bytes, stage_times

    model, hw, space, lay = ctx.model, ctx.hardware, ctx.space, cand.layout
    rank_hw = ctx.rank_hardware.get(lay.gpus, hw)
    m = lay.microbatches if lay.pp > 1 else space.grad_accum
    par = ParallelConfig(dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, sp=lay.sp,
                         microbatches=lay.microbatches if lay.pp > 1 else 1, pipeline_schedule=lay.schedule)
    buffers = comm_buffer_bytes(ctx, lay, cand.micro_batch)
    reserve = space.reserve_bytes + space.margin_bytes + buffers
    stage_params = _stage_params(ctx, lay.tp, lay.pp)
    statics = [static_memory(n, unit, cand.training, model.dtype) for n, unit in stage_params]
    base: dict[str, Any] = dict(candidate=cand, optimizer_s=0.0, static_bytes=max(s.total_bytes for s in statics),
                                activation_capacity_bytes=hw.device_memory_bytes - reserve
                                - max(s.total_bytes for s in statics), model_flops_per_step=0.0,
                                numerics=numerics_change(cand.training), comm_buffer_bytes=buffers,
                                comm_not_modelled=not_modelled(hw.collective_overlap_slowdown),
                                layout_note=LAYOUT_NOTE)
    built = _stage_graphs(ctx, cand, rank_hw)
    stages = []
    for i, (graph, ideal, floor) in enumerate(built):
        capacity = DeviceCapacity(hw.device_memory_bytes, reserve, statics[i])
        if floor > capacity.activation_capacity_bytes:
            room = capacity.activation_capacity_bytes
            return infeasible_row(base, f"{ACTIVATIONS_DO_NOT_FIT}: stage {i} activation floor "
                                  f"{floor / 2**30:.2f} GiB > capacity {room / 2**30:.2f} GiB")
        k = in_flight_microbatches(i, lay.pp, m)
        stages.append(Stage(i, graph, ideal, k, stage_peak_bytes(graph, ideal, k), capacity))
    fit = FitOptions(allocator="caching", plan_against=cand.plan_against)
    spec = RunSpec(replace(model, micro_batch_size=cand.micro_batch, include_optimizer=False), rank_hw,
                   Budget(device=True, reserve_bytes=reserve), cand.planner, dict(space.planners[cand.planner]),
                   cand.training, fit, node=getattr(ctx, "node", None),
                   planner=get_planner(cand.planner, **dict(space.planners[cand.planner])), parallel=par)
    try:
        result = plan_pipeline(spec, stages)
    except InfeasibleBudgetError as exc:
        return infeasible_row(base, f"{ACTIVATIONS_DO_NOT_FIT}: planner {cand.planner}: {exc.reason}")
    if result.pipeline is None:
        return infeasible_row(base, f"{ACTIVATIONS_DO_NOT_FIT}: {result.reason}")
    comms = [price(layout_collectives(s.graph), par, ctx.topology, graph=s.graph) for s in result.stages]
    num_params, (param_b, grad_b, _, _) = stage_params[0][0], bytes_per_param(cand.training, model.dtype)
    times, plans, peaks, fits, reason = [], [], [], True, ""
    for s, comm, static in zip(result.stages, comms, statics, strict=True):
        t = stage_times(s.graph, s.fitted.result)
        opt = _optimizer_s(ctx, cand.training, stage_params[s.index][0])
        t = replace(t, forward_s=t.forward_s + (comm.forward_exposed_s or 0.0),
                    backward_s=t.backward_s + (comm.backward_exposed_s or 0.0), tail_s=opt)
        times.append(t)
        report = s.fitted.report
        frag = 0 if report is None else max(report.peak_reserved_bytes - s.fitted.result.peak_activation_bytes, 0)
        peak = static.total_bytes + space.reserve_bytes + buffers + s.peak_bytes + frag
        peaks.append(peak)
        if peak > hw.device_memory_bytes - space.margin_bytes and fits:
            fits, reason = False, (f"stage {s.index}: peak {peak / 2**30:.2f} GiB (reserved estimate) leaves less than "
                                   f"the margin {space.margin_bytes / 2**30:.2f} GiB")
        plans.append(StagePlan(s.index, cand.planner, s.in_flight, s.budget_bytes, peak, static.total_bytes,
                               t.forward_s, t.backward_s))
    pipe = simulate_pipeline(times, m, result.p2p_s, lay.schedule)
    dp_comm = step_communication(
        num_params=num_params, param_bytes=param_b, grad_bytes=grad_b, zero_stage=lay.zero_stage,
        gpus=lay.dp, shards=lay.zero_shards, topology=_strided(ctx.topology, lay.tp * lay.cp),
        forward_compute_s=times[0].forward_s, backward_compute_s=times[0].backward_s,
        units=model.num_layers // lay.pp + 1)
    # The overlapped part costs compute on a calibrated preset, as in the data-parallel rows (advise.py).
    # ZeRO-3 gathers the parameters in every micro-batch's forward and backward (`step_communication`,
    # as the data-parallel rows price it); stages 0-2 reduce the gradients once, under the last backward.
    per_micro = m if lay.zero_stage == 3 else 1
    dp_exposed = (per_micro * (dp_comm.forward_exposed_s + dp_comm.backward_exposed_s
                               + dp_comm.overlap_cost_s(hw.collective_overlap_slowdown))
                  + dp_comm.after_step_comm_s)
    step_s = pipe.step_s + dp_exposed
    layout_s = m * (comms[0].exposed_s or 0.0)
    tokens = m * cand.micro_batch * model.seq_len / (lay.tp * lay.cp * lay.pp)
    flops = m * sum(throughput.model_flops(s.graph) for s in result.stages) / lay.pp
    exposed = dp_exposed + layout_s
    recomputed = sum(s.fitted.result.recomputed_tensors for s in result.stages)
    swapped = sum(s.fitted.result.swapped_tensors for s in result.stages)
    slow = sum(s.fitted.result.recompute_s + s.fitted.result.stall_s for s in result.stages[:1]) * m
    bound = (COMMUNICATION_BOUND if exposed >= COMMUNICATION_BOUND_SHARE * step_s else
             "pipeline bubble" if pipe.bubble_fraction >= 0.1 and pipe.bubble_fraction * step_s >= max(slow, exposed)
             else "recompute/stall" if slow >= 0.01 * step_s and slow >= exposed else "compute")
    unpriced = "; ".join(sorted({c.unpriced for c in comms if c.unpriced} | ({result.p2p_unpriced} - {None})))
    peak = max(peaks)
    return Row(
        status="ok", reason=reason, fits_device=fits, tokens_per_s=throughput.tokens_per_s(tokens, step_s),
        mfu=throughput.mfu(flops, step_s, hw, model.dtype), step_s=step_s,
        micro_step_s=times[0].forward_s + times[0].backward_s, comm=dp_comm, comm_exposed_s=exposed, peak_bytes=peak,
        headroom_bytes=hw.device_memory_bytes - peak, peak_activation_bytes=max(s.peak_bytes for s in result.stages),
        peak_reserved_bytes=None, swapped=swapped, recomputed=recomputed,
        recompute_s=sum(s.fitted.result.recompute_s for s in result.stages),
        stall_s=sum(s.fitted.result.stall_s for s in result.stages), bound=bound, stages=tuple(plans),
        layout_comm_s=layout_s, **{**base, "optimizer_s": times[0].tail_s, "model_flops_per_step": flops,
                                   "layout_note": LAYOUT_NOTE + (f"; unpriced: {unpriced}" if unpriced else "")},
    )
