"""The configurations of the advise layout search (`slackswap.experiment.advise_layout`, steps 1 and 2
of its docstring): the (tp, pp, cp) shapes of a GPU count, the ZeRO stages each is searched under,
the (layout, recipe, micro-batch) configurations left once static memory and activation floors are
checked, each with its optimistic tokens/s; and the per-layout caches (stage parameter counts and
graphs) the planning half (`advise_layout_eval`) reads too."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from slackswap.communication import all_reduce_s
from slackswap.errors import ConfigError
from slackswap.experiment.advise_space import (
    ACTIVATIONS_DO_NOT_FIT,
    LAYOUT_DOES_NOT_DIVIDE,
    STATIC_DOES_NOT_FIT,
    Layout,
    Region,
    Row,
    numerics_change,
)
from slackswap.experiment.advise_step import activation_floor_bytes, optimizer_step_s, recipe_for_layout
from slackswap.memory.static import StaticMemory, static_memory
from slackswap.parallel import ParallelConfig
from slackswap.profile.stages import chunk_units, routed_expert_params


@dataclass
class LayoutSearch:
    """What a layout search found: planned rows, rejected regions and the configurations they hold."""

    rows: list[Row] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    pruned: int = 0


@dataclass(frozen=True)
class LayoutConfig:
    """One configuration of a layout search: layout, recipe, micro-batch and its optimistic tokens/s."""

    layout: Layout
    recipe: str
    training: Any
    micro_batch: int
    bound_tokens_per_s: float


def layout_shapes(ctx: Any, gpus: int, out: LayoutSearch) -> list[tuple[int, int, int, int]]:
    """The (tp, pp, cp, ep) shapes of `gpus` GPUs to search: ep > 1 only on an MoE model (a dense
    model has no experts to split: not a layout of it, skipped as a product not dividing the GPUs is);
    one that does not divide the model or puts a tp group across nodes is a rejected region."""
    space, model = ctx.space, ctx.model
    shapes = []
    eps = space.ep if model.moe is not None else (1,)
    for tp in space.tp:
        for pp in space.pp:
            for cp in space.cp:
                for ep in eps:
                    if (tp, pp, cp, ep) == (1, 1, 1, 1) or gpus % (tp * pp * cp):
                        continue
                    where = {"gpus": gpus, "tp": tp, "pp": pp, "cp": cp, "ep": ep,
                             "layout": f"tp{tp} pp{pp} cp{cp}" + (f" ep{ep}" if ep > 1 else "")}
                    per = len(space.recipes) * len(space.micro_batches)
                    try:
                        ParallelConfig(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp, ep=ep,
                                       sp=space.sp and tp > 1).check_model(model)
                    except ConfigError as exc:
                        out.regions.append(Region(LAYOUT_DOES_NOT_DIVIDE, str(exc), where, per))
                        out.pruned += per
                        continue
                    if tp > ctx.topology.gpus_per_node:
                        out.regions.append(Region(LAYOUT_DOES_NOT_DIVIDE, f"parallel.tp={tp}: a tp group spans "
                                                  f"nodes of {ctx.topology.gpus_per_node} GPUs", where, per))
                        out.pruned += per
                        continue
                    shapes.append((tp, pp, cp, ep))
    return shapes


def zero_stages(searched: tuple[int, ...], dp_cp: int, pp: int, ep: int = 1) -> list[int]:
    """The ZeRO stages a layout is searched under, over its dp x cp ranks (`ParallelConfig.dp_cp`: they
    hold the same dense parameters): 0 alone when one rank holds them; 0 and 1 (Megatron's DDP and
    distributed optimizer) with a pipeline, as Megatron and DeepSpeed run it (DeepSpeed refuses
    ZeRO-2/3 with pipeline parallelism: its gradient partitions would be reduced once per
    micro-batch); every searched stage otherwise, expert parallelism included (tp / cp x ZeRO-3 is
    FSDP over the dp x cp group on tp-sharded parameters; with ep the routed experts are sharded over
    the expert data-parallel group, as DeepSpeed-MoE's ZeRO-2, Megatron-Core's distributed optimizer
    and torchtitan's FSDP2 over its `efsdp` mesh do: `device_statics`,
    `slackswap.communication.expert_step_communication`). `ep` no longer restricts the stages; it
    stays in the signature for the callers that pass it."""
    del ep
    if dp_cp == 1:
        return [0]
    stages = sorted({z for z in searched if pp == 1 or z <= 1})
    return stages or [1]


def chunk_parallel(tp: int, pp: int, cp: int = 1, sp: bool = False, virtual_stages: int = 1,
                   ep: int = 1) -> ParallelConfig:
    """The layout the stage (chunk) graphs are built under. Their graphs do not depend on the number of
    micro-batches (any the schedule takes, 2 under 1F1B, pp interleaved, builds the same chunks) nor on
    dp (set to ep, the least that holds an ep group)."""
    if virtual_stages > 1:
        return ParallelConfig(dp=ep, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, microbatches=pp,
                              pipeline_schedule="interleaved", virtual_stages=virtual_stages)
    return ParallelConfig(dp=ep, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, microbatches=2 if pp > 1 else 1)


def stage_param_counts(ctx: Any, tp: int, pp: int, virtual_stages: int = 1, ep: int = 1) -> list[tuple[int, int]]:
    """(parameters, largest group) of each chunk (1F1B: each stage), in chunk order, cached per layout
    (under ep, a rank's own experts only)."""
    from slackswap.profile.stages import stage_parameter_counts

    key = ("params", tp, pp, virtual_stages, ep)
    if key not in ctx.plan_cache:
        par = chunk_parallel(tp, pp, virtual_stages=virtual_stages, ep=ep)
        ctx.plan_cache[key] = [stage_parameter_counts(ctx.model, par, i) for i in range(par.chunks)]
    return ctx.plan_cache[key]


def device_param_counts(ctx: Any, tp: int, pp: int, virtual_stages: int = 1, ep: int = 1) -> list[tuple[int, int]]:
    """(parameters, largest group) each device holds over its chunks (chunk c on device c mod pp)."""
    chunks = stage_param_counts(ctx, tp, pp, virtual_stages, ep)
    return [(sum(n for n, _ in chunks[d::pp]), max(u for _, u in chunks[d::pp])) for d in range(pp)]


def chunk_expert_params(model: Any, layout: Layout) -> list[int]:
    """Routed-expert parameters each chunk (1F1B: stage) holds on a rank: per MoE layer of it, its
    E / ep experts' gate, up and down weights, 3 h f_e each (`slackswap.profile.moe`; shared experts
    and the router are replicated, dense parameters)."""
    chunks = layout.pp * layout.virtual_stages
    moe = model.moe
    if moe is None:
        return [0] * chunks
    per = model.num_layers // chunks
    each = routed_expert_params(model, layout.ep)
    return [each * sum(moe.is_moe_layer(i) for i in range(c * per, (c + 1) * per)) for c in range(chunks)]


def device_moe_layers(model: Any, layout: Layout) -> list[int]:
    """MoE layers each device holds over its chunks: ZeRO-3's expert gathers per phase (one per layer)."""
    chunks = layout.pp * layout.virtual_stages
    per = model.num_layers // chunks
    moe = model.moe
    layers = [0 if moe is None else sum(moe.is_moe_layer(i) for i in range(c * per, (c + 1) * per))
              for c in range(chunks)]
    return [sum(layers[d::layout.pp]) for d in range(layout.pp)]


def device_expert_params(model: Any, layout: Layout) -> list[int]:
    """Routed-expert parameters each device holds over its chunks (chunk c on device c mod pp)."""
    chunks = chunk_expert_params(model, layout)
    return [sum(chunks[d::layout.pp]) for d in range(layout.pp)]


def device_units(ctx: Any, layout: Layout) -> list[tuple[int, int]]:
    """(largest dense parameter group, largest routed-expert group) each device holds over its chunks
    (`slackswap.profile.stages.chunk_units`), cached per layout: ZeRO-3's gather units."""
    key = ("units", layout.tp, layout.pp, layout.virtual_stages, layout.ep)
    if key not in ctx.plan_cache:
        par = chunk_parallel(layout.tp, layout.pp, virtual_stages=layout.virtual_stages, ep=layout.ep)
        units = [chunk_units(ctx.model, par, c) for c in range(layout.pp * layout.virtual_stages)]
        ctx.plan_cache[key] = [(max(u[0] for u in units[d::layout.pp]), max(u[1] for u in units[d::layout.pp]))
                               for d in range(layout.pp)]
    return ctx.plan_cache[key]


def device_statics(ctx: Any, layout: Layout, training: Any) -> list[StaticMemory]:
    """Each device's static memory: its dense parameters' under ZeRO over the dp x cp group (`training`), its
    routed experts' over the expert data-parallel group (`Layout.expert_shards`), term by term summed.
    Under ZeRO-3 each part gathers two of its own units (`device_units`; the current and the prefetched
    one, `slackswap.memory.static`): two layers' dense parameters and, where the expert group has more
    than one rank, two MoE layers' experts, transient bytes held beside the shards."""
    model = ctx.model
    per_device = device_param_counts(ctx, layout.tp, layout.pp, layout.virtual_stages, layout.ep)
    experts = device_expert_params(model, layout)
    out = []
    for (n, unit), e, (dense_unit, expert_unit) in zip(per_device, experts, device_units(ctx, layout), strict=True):
        if not e:
            out.append(static_memory(n, unit, training, model.dtype))
            continue
        dense = static_memory(n - e, dense_unit, training, model.dtype)
        expert = static_memory(e, expert_unit, replace(training, zero_shards=layout.expert_shards), model.dtype)
        out.append(replace(dense, num_params=n, **{k: v + expert.terms()[k] for k, v in dense.terms().items()}))
    return out


def pipeline_variants(ctx: Any, gpus: int, shape: tuple[int, int, int, int], out: LayoutSearch
                      ) -> list[tuple[int, str, int]]:
    """The (micro-batches, schedule, chunks per device) a (tp, pp, cp, ep) shape is searched under: one
    (1, 1f1b, 1) without a pipeline; else each of `advise.pipeline_microbatches` under each of
    `SearchSpace.pipeline_variants`, less those Megatron's interleaved schedule refuses
    (`ParallelConfig`: pp x v must divide the layers, the micro-batches be a multiple of pp), each a
    rejected region **layout does not divide the model** naming the field."""
    tp, pp, cp, ep = shape
    space = ctx.space
    if pp == 1:
        return [(1, "1f1b", 1)]
    out_variants = []
    per = len(space.recipes) * len(space.micro_batches)
    for schedule, v in space.pipeline_variants():
        for m in space.pipeline_microbatches:
            try:
                ParallelConfig(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp, ep=ep, sp=space.sp and tp > 1,
                               microbatches=m, pipeline_schedule=schedule, virtual_stages=v).check_model(ctx.model)
            except ConfigError as exc:
                where = {"gpus": gpus, "tp": tp, "pp": pp, "cp": cp,
                         "layout": f"tp{tp} pp{pp} cp{cp} x {m} mb {schedule}{f' v{v}' if v > 1 else ''}"}
                out.regions.append(Region(LAYOUT_DOES_NOT_DIVIDE, str(exc), where, per))
                out.pruned += per
                continue
            out_variants.append((m, schedule, v))
    return out_variants


def comm_buffer_bytes(ctx: Any, layout: Layout, micro_batch: int) -> int:
    """Bytes of communication buffers outside the graph: under sp, the all-gather's full-sequence output."""
    if not layout.sp:
        return 0
    m = ctx.model
    return micro_batch * (m.seq_len // layout.cp) * m.hidden_size * m.bytes_per_element


def keep_all_compute_s(ctx: Any, mb: int, ep: int = 1) -> float:
    """The keep-all compute of one micro-batch of the whole model on one rank; under ep > 1 of the
    analytic rank graph with E / ep experts (each sized for its ep x T tokens' load percentile, at most
    its share of ep = 1's: a tighter percentile over more tokens), tp = cp = 1 so that split over the
    tp x cp x pp ranks it stays a lower bound of every stage's."""
    key = ("compute", mb, ep)
    if key not in ctx.plan_cache:
        if ep == 1:
            graph = ctx.graph_for(mb)
        else:
            from slackswap.profile import build_graph

            model = replace(ctx.model, micro_batch_size=mb, include_optimizer=False)
            graph = build_graph(model, ctx.hardware, parallel=chunk_parallel(1, 1, ep=ep))
        ctx.plan_cache[key] = float(sum(op.duration_s for op in graph.ops))
    return ctx.plan_cache[key]


def optimizer_share_s(ctx: Any, training: Any, params: int) -> float:

    key = (training, ctx.model.num_layers)
    if key not in ctx.optimizer_cache:
        ctx.optimizer_cache[key] = optimizer_step_s(ctx.model, ctx.hardware, training)
    from slackswap.profile import parameter_counts

    return ctx.optimizer_cache[key] * params / parameter_counts(ctx.model)[0]


def optimistic_tokens_per_s(ctx: Any, layout: Layout, training: Any, mb: int, params: int) -> float:
    """Optimistic tokens/s per GPU (`slackswap.experiment.advise_layout` docstring, step 2): m slots and
    the pipeline's bubble of (pp - 1) / v slots (1F1B: v = 1; interleaved, Narayanan et al. 2021
    section 2.2.2: bubble / ideal = (p - 1) / (v m); ZB-H1: no bubble assumed), plus the optimizer step
    of `params`."""
    m, space = ctx.model, ctx.space
    ranks = layout.tp * layout.cp * layout.pp
    slot = keep_all_compute_s(ctx, mb, layout.ep) / ranks
    if layout.tp > 1:
        size = mb * (m.seq_len // layout.cp) * m.hidden_size * m.bytes_per_element
        slot += 4 * (m.num_layers // layout.pp) * all_reduce_s(size, layout.tp, ctx.topology.intra_node)
    micro = layout.microbatches if layout.pp > 1 else space.grad_accum
    # ZB-H1's bubble depends on the W share of the backward: none is assumed (still a lower bound)
    bubble = 0.0 if layout.schedule == "zb_h1" else (layout.pp - 1) / layout.virtual_stages
    step = (micro + bubble) * slot + optimizer_share_s(ctx, training, params)
    return micro * mb * m.seq_len / ranks / step


def layout_configs(ctx: Any, gpus: int, out: LayoutSearch, incumbents: tuple[float, float]) -> list[LayoutConfig]:

    space, model, hw = ctx.space, ctx.model, ctx.hardware
    configs = []
    n_planners = len([p for p in space.planners if p != "milp"])
    for tp, pp, cp, ep in layout_shapes(ctx, gpus, out):
        # ZeRO over the dp x cp ranks that hold the same dense parameters (`ParallelConfig.dp_cp`)
        dp_cp = ParallelConfig(dp=gpus // (tp * pp * cp), cp=cp).dp_cp
        variants = pipeline_variants(ctx, gpus, (tp, pp, cp, ep), out)
        for zero in zero_stages(space.zero_stages, dp_cp, pp, ep):
            for m, schedule, v in variants:
                layout = Layout(gpus, zero, dp_cp if zero else 1, tp, pp, cp, space.sp and tp > 1, m, schedule, v,
                                ep)
                for name, recipe in space.recipes.items():
                    try:
                        recipe.check_model_dtype(model.dtype)
                    except ConfigError:
                        continue  # the data-parallel search reports the recipe's region
                    training = recipe_for_layout(recipe, layout)
                    per_stage = device_param_counts(ctx, tp, pp, v, ep)
                    statics = device_statics(ctx, layout, training)
                    worst = max(range(pp), key=lambda i: statics[i].total_bytes)
                    room = (hw.device_memory_bytes - space.reserve_bytes - space.margin_bytes
                            - statics[worst].total_bytes - comm_buffer_bytes(ctx, layout, space.micro_batches[0]))
                    if room <= 0:
                        n = len(space.micro_batches) * n_planners
                        experts = (f" (its routed experts' state over their {layout.expert_shards} expert "
                                   "data-parallel GPU(s))" if ep > 1 and zero else "")
                        detail = (f"stage {worst}: {statics[worst].describe()}{experts}; with reserve and margin "
                                  f"{-room / 2**30:.2f} GiB over {hw.device_memory_bytes / 2**30:.2f} GiB")
                        out.regions.append(Region(STATIC_DOES_NOT_FIT, detail, {"gpus": gpus, "layout": layout.label,
                                                                                "recipe": name}, n))
                        out.pruned += n
                        continue
                    bounds = [optimistic_tokens_per_s(ctx, layout, training, mb, per_stage[worst][0])
                              for mb in space.micro_batches]
                    where = {"gpus": gpus, "layout": layout.label, "recipe": name}
                    if max(bounds) < incumbents[0] and (numerics_change(training) or max(bounds) < incumbents[1]):
                        configs += [LayoutConfig(layout, name, training, mb, b)
                                    for mb, b in zip(space.micro_batches, bounds, strict=True)]
                        continue  # not planned (search_layouts counts them): no floors needed
                    fit = fitting_micro_batches(ctx, layout, training, statics)
                    if fit < len(space.micro_batches):
                        n = (len(space.micro_batches) - fit) * n_planners
                        detail = (f"from micro-batch {space.micro_batches[fit]} up: a stage's activation floor "
                                  "exceeds its capacity (device - reserve - margin - static - buffers)")
                        out.regions.append(Region(ACTIVATIONS_DO_NOT_FIT, detail, where, n))
                        out.pruned += n
                    configs += [LayoutConfig(layout, name, training, mb, b)
                                for mb, b in zip(space.micro_batches[:fit], bounds[:fit], strict=True)]
    return configs


def stage_floors(ctx: Any, layout: Layout, training: Any, mb: int) -> list[int]:
    """Each stage's (chunk's) activation floor at micro-batch `mb` (`activation_floor_bytes`), cached.

    Why not every chunk's graph: a chunk's graph depends on its index only through whether it is the
    first (embedding) or the last (head and loss) chunk; its layers are emitted with their local
    indices (`slackswap.profile.stages`), so every interior chunk has the same ops and tensors (only its
    name and meta differ) and the same floor. Three graphs give all the floors of a pp 8 x v 2 layout
    (16 chunks); the pruning of a 70B search built ~650 stage graphs for ~130 layouts before. The full
    graphs, when already built for planning, give the floors directly."""
    key = graphs_key(layout, mb, training, "floors")
    if key not in ctx.plan_cache:
        full = ctx.plan_cache.get(graphs_key(layout, mb, training))
        chunks = layout.pp * layout.virtual_stages
        if full is not None:
            floors = [activation_floor_bytes(g) for g in full]
        else:
            kinds = sorted({0, min(1, chunks - 1), chunks - 1})
            floor_of = {i: activation_floor_bytes(_chunk_graph(ctx, layout, training, mb, i)) for i in kinds}
            floors = [floor_of[min(c, 1) if c < chunks - 1 else chunks - 1] for c in range(chunks)]
        ctx.plan_cache[key] = floors
    return ctx.plan_cache[key]


def _chunk_graph(ctx: Any, lay: Layout, training: Any, mb: int, chunk: int) -> Any:
    """Chunk `chunk`'s graph at micro-batch `mb`, as `layout_stage_graphs` builds it (not cached: the
    floors are)."""
    from slackswap.profile.stages import build_stage_graph

    hw = ctx.rank_hardware.get(lay.gpus, ctx.hardware)
    model = replace(ctx.model, micro_batch_size=mb, include_optimizer=False)
    par = chunk_parallel(lay.tp, lay.pp, lay.cp, lay.sp, lay.virtual_stages, lay.ep)
    return build_stage_graph(model, hw, training, par, chunk)


def fitting_micro_batches(ctx: Any, layout: Layout, training: Any, statics: list) -> int:
    """How many of the listed micro-batches (a prefix: floors grow with the micro-batch) have every
    chunk's floor within its device's capacity (`statics`: per device); bisection, so few stage
    graphs are built."""
    space, hw = ctx.space, ctx.hardware

    def fits(i: int) -> bool:
        mb = space.micro_batches[i]
        room = hw.device_memory_bytes - space.reserve_bytes - space.margin_bytes - comm_buffer_bytes(ctx, layout, mb)
        floors = stage_floors(ctx, layout, training, mb)
        return all(f <= room - statics[c % layout.pp].total_bytes for c, f in enumerate(floors))

    lo, hi = 0, len(space.micro_batches)  # fits(i) for i < lo; not for i >= hi
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def layout_stage_graphs(ctx: Any, lay: Layout, training: Any, mb: int) -> list:
    """Each stage's (interleaved: chunk's, in model order) graph at micro-batch `mb` on the rank's
    hardware, cached per layout and micro-batch."""
    from slackswap.profile.stages import build_stage_graph

    hw = ctx.rank_hardware.get(lay.gpus, ctx.hardware)
    key = graphs_key(lay, mb, training)
    if key not in ctx.plan_cache:
        model = replace(ctx.model, micro_batch_size=mb, include_optimizer=False)
        par = chunk_parallel(lay.tp, lay.pp, lay.cp, lay.sp, lay.virtual_stages, lay.ep)
        ctx.plan_cache[key] = [build_stage_graph(model, hw, training, par, i) for i in range(par.chunks)]
    return ctx.plan_cache[key]


def graphs_key(lay: Layout, mb: int, training: Any, kind: str = "graphs") -> tuple:
    """The cache key of a layout's stage graphs (`graphs`) or planned-stage inputs (`stages`)."""
    return (kind, lay.tp, lay.pp, lay.cp, lay.sp, lay.virtual_stages, lay.ep, mb, training.fp8_linear_inputs)

