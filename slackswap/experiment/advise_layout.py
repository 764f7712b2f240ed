"""The layout half of the advise search: tensor, pipeline and context parallelism (`advise.tp`, `pp`,
`cp`, with sequence parallelism on tp > 1, micro-batches per pipeline and its schedule: 1F1B, or
interleaved 1F1B with v chunks per device, `advise.pipeline_schedule` / `advise.virtual_stages`),
dp = GPUs / (tp pp cp); on an MoE model expert parallelism too (`advise.ep`, carved out of dp x cp:
a rank's E / ep experts, their optimizer state over the expert data-parallel group dp cp / ep, the
all-to-alls among the stage's collectives, `advise_layout_configs.device_statics`).

Coarse to fine, so that a 70B model on 64 GPUs answers in seconds:

1. **enumerate and prune without graphs**: a (tp, pp, cp) whose product does not divide the GPU count
   is not a layout of it (skipped); one that does not divide the model (`ParallelConfig.check_model`:
   tp the heads, KV heads and MLP width, pp the layers, cp the sequence) or puts a tp group across
   nodes is a rejected region, as is an interleaved (pp, v, m) Megatron refuses (pp x v not dividing
   the layers, m not a multiple of pp: `pipeline_variants`); ZeRO over the dp x cp group: stages 0 and 1
   with a pipeline (Megatron's DDP and distributed optimizer), every searched stage on a pp = 1
   layout (`zero_stages`); a (layout, recipe) whose static memory on its fullest stage (its own
   parameters, interleaved all its chunks',
   `slackswap.profile.stages.stage_parameter_counts`; under ZeRO-k over the dp x cp group, the ZeRO
   paper's per-rank terms of that stage's parameters, `slackswap.memory.static.static_memory`) leaves
   no activation capacity is a region **static memory does not fit**;
2. **rank by an optimistic estimate**: the full model's keep-all compute of one micro-batch split
   evenly over tp x cp x pp ranks, times m + (pp - 1) / v micro-batch slots (1F1B: v = 1; the
   interleaved bubble is (pp - 1) / (v m) of the ideal, Narayanan et al. 2021), plus the tp
   all-reduces' ring time at the bus bandwidth (4 per layer, Megatron) and the optimizer step on the
   rank's shard. Every term is at most what the planned step costs, so its tokens/s is an upper bound;
3. **plan best-first**: the stages of each configuration are built (`build_stage_graph`), their
   activation floors checked against their capacity (a floor over it: **activations do not fit**, and
   every larger micro-batch of the layout is skipped), planned per stage under its own budget
   (`slackswap.experiment.pipeline_run.device_stages` and `plan_pipeline`, as `pipelines.run` plans
   them: interleaved, a device's chunks under one planning budget, its in-flight micro-batch chunks
   and peak as its order holds them) and run through the pipeline's step model
   (`slackswap.simulate.pipeline`), with the exposed part of the stage's tp / cp collectives added to
   its forward and backward (`slackswap.profile.collectives.price`: tp in full, a cp ring beyond the
   attention it overlaps) and its optimizer step as its tail, plus the data-parallel gradient
   reduction once per step, overlapping the last backward (`step_communication` over the dp x cp
   ranks that hold the same dense parameters, `ParallelConfig.dp_cp`, tp GPUs apart). A
   configuration whose optimistic estimate cannot beat the best configuration planned so far
   (data-parallel ones included; for a numerics-preserving recipe, the best such) is not planned,
   nor any beyond `advise.layout_top_n`: region **not planned**.

Planned against the reserved peak (when `advise.plan_against` lists it) with the search's first
planner, then its others unless that plan keeps every activation (every planner would then give the
same step). A stage's peak on the device: static + reserve + communication buffers + its activation
peak with its in-flight micro-batches, plus the fragmentation (reserved - allocated) the allocator
replay of one micro-batch shows (planned against the reserved peak, `plan_pipeline` counts it in the
activation peak already). Communication buffers: under sp, one full-sequence activation (the
all-gather's output, not a graph tensor).

The enumeration and pruning (steps 1 and 2) are `advise_layout_configs`, the planning of one
configuration (step 3) `advise_layout_eval`; this module runs the best-first search over them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from slackswap.experiment.advise_layout_configs import (
    LayoutConfig,
    LayoutSearch,
    comm_buffer_bytes,
    graphs_key,
    layout_configs,
)
from slackswap.experiment.advise_layout_eval import LAYOUT_NOTE, evaluate_layout
from slackswap.experiment.advise_space import (
    ACTIVATIONS_DO_NOT_FIT,
    NOT_PLANNED,
    Candidate,
    Region,
    Row,
    numerics_change,
)
from slackswap.experiment.parallel_map import effective_n_jobs, ordered_map


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
        configs = sorted(layout_configs(ctx, gpus, out, (best, faithful)), key=lambda c: -c.bound_tokens_per_s)
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
                                          {"gpus": gpus, "layout": "tp/pp/cp/ep layouts"}, n))
                out.pruned += n
    return out


def _shape_key(cfg: LayoutConfig) -> tuple:
    """A configuration less its micro-batch: where one micro-batch's activation floor is over the
    capacity, every larger micro-batch of the same key is too."""
    lay = cfg.layout
    return (lay.tp, lay.pp, lay.cp, lay.ep, lay.virtual_stages, lay.zero_stage, cfg.recipe)


def _skip(cfg: LayoutConfig, too_big: dict, bar: tuple[float, float], planned: int, top_n: int) -> str | None:
    """Why the best-first search does not plan `cfg` now (`search_layouts`), None if it does."""
    if cfg.micro_batch >= too_big.get(_shape_key(cfg), 1 << 30):
        return "floor"
    if cfg.bound_tokens_per_s < bar[0] and (numerics_change(cfg.training) or cfg.bound_tokens_per_s < bar[1]):
        return "bound"
    return "top_n" if planned >= top_n else None


def _task_context(ctx: Any, cfg: LayoutConfig) -> Any:
    """What planning `cfg` needs of `ctx`: its layout's cached parameter counts, floors and stage graphs, not
    every graph the search built, nor the graph source (a worker is sent the task's context)."""
    lay = cfg.layout
    keep = {("params", lay.tp, lay.pp, lay.virtual_stages, lay.ep), graphs_key(lay, cfg.micro_batch, cfg.training),
            graphs_key(lay, cfg.micro_batch, cfg.training, "stages"),
            graphs_key(lay, cfg.micro_batch, cfg.training, "floors")}
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



__all__ = ["LAYOUT_NOTE", "LayoutSearch", "comm_buffer_bytes", "evaluate_layout", "search_layouts"]
