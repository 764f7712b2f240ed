"""The planning half of the advise layout search (`slackswap.experiment.advise_layout`, step 3 of its
docstring): one configuration's stages planned under their budgets and its step priced, the row the
search ranks. Apart from the enumeration (`advise_layout_configs`) so that each stays readable."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from slackswap.communication import (
    expert_step_communication,
    not_modelled,
    rate_limited_all_gathers,
    step_communication,
)
from slackswap.errors import InfeasibleBudgetError
from slackswap.experiment import throughput
from slackswap.experiment.advise_layout_configs import (
    chunk_expert_params,
    comm_buffer_bytes,
    device_expert_params,
    device_moe_layers,
    device_param_counts,
    device_statics,
    graphs_key,
    layout_stage_graphs,
    optimizer_share_s,
    stage_floors,
    stage_param_counts,
)
from slackswap.experiment.advise_space import (
    ACTIVATIONS_DO_NOT_FIT,
    COMMUNICATION_BOUND,
    COMMUNICATION_BOUND_SHARE,
    Candidate,
    Row,
    StagePlan,
    numerics_change,
)
from slackswap.experiment.advise_step import infeasible_row
from slackswap.memory.recipe import FSDP1
from slackswap.memory.static import bytes_per_param

#: What the layout rows leave out (advice.json `layout_note`).
LAYOUT_NOTE = ("tp collectives on the critical path (no overlap), cp rings beyond the attention they overlap; "
               "dp x cp gradient reduce once per step overlapping the last backward (ZeRO-3: gathers per micro-batch; "
               "routed experts over their expert data-parallel group, gathered with their layer); "
               "ZeRO-2/3 with pp not searched; interleaved 1F1B: a device's chunks planned under one "
               "planning budget, their copies not contending across chunks; no host check of offloads")


def _planned_stages(ctx: Any, cand: Candidate, hw: Any) -> list[tuple]:
    """Per stage (interleaved: chunk): (graph, keep-all simulation, activation floor), cached per
    layout and micro-batch."""
    from slackswap.simulate.metrics import simulate_ideal

    lay = cand.layout
    key = graphs_key(lay, cand.micro_batch, cand.training, "stages")
    if key not in ctx.plan_cache:
        graphs = layout_stage_graphs(ctx, lay, cand.training, cand.micro_batch)
        floors = stage_floors(ctx, lay, cand.training, cand.micro_batch)
        ctx.plan_cache[key] = [(g, simulate_ideal(g, hw), f) for g, f in zip(graphs, floors, strict=True)]
    return ctx.plan_cache[key]


def evaluate_layout(ctx: Any, cand: Candidate) -> Row:
    """Plan every stage of one layout configuration and price its step (`advise_layout` docstring, step 3).
    Interleaved: every chunk of a device under one planning budget (`pipeline_run.plan_pipeline`, as
    `pipelines.run` plans it), the step over the p x v chunks."""
    from slackswap.budget import Budget
    from slackswap.experiment.fitting import FitOptions
    from slackswap.experiment.pipeline_run import device_stages, plan_pipeline
    from slackswap.experiment.spec import RunSpec
    from slackswap.memory.static import DeviceCapacity
    from slackswap.planners.registry import get_planner
    from slackswap.profile import layout_collectives
    from slackswap.profile.collectives import price
    from slackswap.simulate.pipeline import simulate_pipeline
    from slackswap.simulate.pipeline_stage import stage_times

    model, hw, space, lay = ctx.model, ctx.hardware, ctx.space, cand.layout
    rank_hw = ctx.rank_hardware.get(lay.gpus, hw)
    m = lay.microbatches if lay.pp > 1 else space.grad_accum
    p, v = lay.pp, lay.virtual_stages
    par = lay.parallel
    buffers = comm_buffer_bytes(ctx, lay, cand.micro_batch)
    reserve = space.reserve_bytes + space.margin_bytes + buffers
    params_by_chunk = stage_param_counts(ctx, lay.tp, p, v, lay.ep)
    params_by_device = device_param_counts(ctx, lay.tp, p, v, lay.ep)
    statics = device_statics(ctx, lay, cand.training)
    base: dict[str, Any] = dict(candidate=cand, optimizer_s=0.0, static_bytes=max(s.total_bytes for s in statics),
                                activation_capacity_bytes=hw.device_memory_bytes - reserve
                                - max(s.total_bytes for s in statics), model_flops_per_step=0.0,
                                numerics=numerics_change(cand.training), comm_buffer_bytes=buffers,
                                comm_not_modelled=not_modelled(hw.collective_overlap_slowdown),
                                layout_note=LAYOUT_NOTE)
    built = _planned_stages(ctx, cand, rank_hw)
    capacities = [DeviceCapacity(hw.device_memory_bytes, reserve, static) for static in statics]
    for c, (_, _, floor) in enumerate(built):
        room = capacities[c % p].activation_capacity_bytes
        if floor > room:
            where = f"stage {c}" if v == 1 else f"chunk {c} (stage {c % p})"
            return infeasible_row(base, f"{ACTIVATIONS_DO_NOT_FIT}: {where} activation floor "
                                  f"{floor / 2**30:.2f} GiB > capacity {room / 2**30:.2f} GiB")
    stages = device_stages(par, [b[0] for b in built], [b[1] for b in built], capacities)
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
    num_params, (param_b, grad_b, _, _) = params_by_device[0][0], bytes_per_param(cand.training, model.dtype)
    times = []
    expert_chunks = chunk_expert_params(model, lay)
    expert_training = replace(cand.training, zero_shards=lay.expert_shards)
    for s, comm in zip(result.stages, comms, strict=True):
        t = stage_times(s.graph, s.fitted.result)
        # the optimizer step over the dense parameters' shard and the routed experts' (Layout.expert_shards)
        e = expert_chunks[s.index]
        tail = optimizer_share_s(ctx, cand.training, params_by_chunk[s.index][0] - e)
        if e:
            tail += optimizer_share_s(ctx, expert_training, e)
        times.append(replace(t, forward_s=t.forward_s + (comm.forward_exposed_s or 0.0),
                             backward_s=t.backward_s + (comm.backward_exposed_s or 0.0), tail_s=tail))
    plans, peaks, fits, reason = [], [], True, ""
    for d, static in enumerate(statics):
        own = result.stages[d::p]  # the device's chunks, in model order (1F1B: its one stage)
        # Planned against the allocated peak, the allocator replay's fragmentation goes on top; against
        # the reserved peak `plan_pipeline` has added it already.
        frag = 0 if cand.plan_against == "reserved" else max(
            (max(s.fitted.report.peak_reserved_bytes - s.fitted.result.peak_activation_bytes, 0)
             for s in own if s.fitted.report is not None), default=0)
        peak = static.total_bytes + space.reserve_bytes + buffers + own[0].peak_bytes + frag
        peaks.append(peak)
        if peak > hw.device_memory_bytes - space.margin_bytes and fits:
            fits, reason = False, (f"stage {d}: peak {peak / 2**30:.2f} GiB (reserved estimate) leaves less than "
                                   f"the margin {space.margin_bytes / 2**30:.2f} GiB")
        plans.append(StagePlan(d, cand.planner, own[0].in_flight, own[0].budget_bytes, peak, static.total_bytes,
                               sum(times[s.index].forward_s for s in own),
                               sum(times[s.index].backward_s for s in own), tuple(s.index for s in own)))
    pipe = simulate_pipeline(times, m, result.p2p_s, lay.schedule, v)
    first = result.stages[::p]  # device 0's chunks
    experts = device_expert_params(model, lay)[0]
    # The dense parameters over the dp x cp ranks that hold them (`ParallelConfig.dp_cp`), tp GPUs apart
    # (Megatron-Core's rank order tp-cp-ep-dp-pp; torchtitan's mesh [pp, dp, cp, tp] likewise).
    dp_comm = step_communication(
        num_params=num_params - experts, param_bytes=param_b, grad_bytes=grad_b, zero_stage=lay.zero_stage,
        gpus=par.dp_cp, shards=lay.zero_shards, topology=ctx.topology.strided(lay.tp),
        forward_compute_s=plans[0].forward_s, backward_compute_s=plans[0].backward_s,
        units=model.num_layers // lay.pp + 1)
    if experts:
        # Routed experts over their expert data-parallel group (dp x cp / ep ranks, tp x ep GPUs apart in
        # Megatron-Core's expert rank order; torchtitan's efsdp mesh likewise): reduced once per step
        # after the dense gradients (stages 0-2), gathered with their layer per micro-batch (ZeRO-3).
        dp_comm = expert_step_communication(
            dp_comm, num_params=experts, param_bytes=param_b, grad_bytes=grad_b, gpus=par.dp_cp // lay.ep,
            topology=ctx.topology.strided(lay.tp * lay.ep), forward_compute_s=plans[0].forward_s,
            backward_compute_s=plans[0].backward_s, units=model.num_layers // lay.pp + 1,
            moe_layers=device_moe_layers(model, lay)[0])
    # The overlapped part costs compute on a calibrated preset, as in the data-parallel rows (advise.py).
    # ZeRO-3 gathers the parameters in every micro-batch's forward and backward (`step_communication`,
    # as the data-parallel rows price it); stages 0-2 reduce the gradients once, under the last backward.
    # FSDP1's rate limiter idles the GPU once per all-gather it holds (`rate_limited_all_gathers`).
    per_micro = m if lay.zero_stage == 3 else 1
    stalls = hw.rate_limited_all_gather_s * rate_limited_all_gathers(
        cand.training.fsdp_api == FSDP1, lay.zero_stage, lay.zero_shards, model.num_layers // lay.pp + 1)
    dp_exposed = (per_micro * (dp_comm.forward_exposed_s + dp_comm.backward_exposed_s
                               + dp_comm.overlap_cost_s(hw.collective_overlap_slowdown) + stalls)
                  + dp_comm.after_step_comm_s)
    step_s = pipe.step_s + dp_exposed
    layout_s = m * sum(comms[s.index].exposed_s or 0.0 for s in first)
    tokens = m * cand.micro_batch * model.seq_len / (lay.tp * lay.cp * lay.pp)
    flops = m * sum(throughput.model_flops(s.graph) for s in result.stages) / lay.pp
    exposed = dp_exposed + layout_s
    recomputed = sum(s.fitted.result.recomputed_tensors for s in result.stages)
    swapped = sum(s.fitted.result.swapped_tensors for s in result.stages)
    slow = sum(s.fitted.result.recompute_s + s.fitted.result.stall_s for s in first) * m
    bound = (COMMUNICATION_BOUND if exposed >= COMMUNICATION_BOUND_SHARE * step_s else
             "pipeline bubble" if pipe.bubble_fraction >= 0.1 and pipe.bubble_fraction * step_s >= max(slow, exposed)
             else "recompute/stall" if slow >= 0.01 * step_s and slow >= exposed else "compute")
    unpriced = "; ".join(sorted({c.unpriced for c in comms if c.unpriced} | ({result.p2p_unpriced} - {None})))
    peak = max(peaks)
    return Row(
        status="ok", reason=reason, fits_device=fits, tokens_per_s=throughput.tokens_per_s(tokens, step_s),
        mfu=throughput.mfu(flops, step_s, hw, model.dtype), step_s=step_s,
        micro_step_s=plans[0].forward_s + plans[0].backward_s, comm=dp_comm, comm_exposed_s=exposed,
        peak_bytes=peak, headroom_bytes=hw.device_memory_bytes - peak,
        peak_activation_bytes=max(s.peak_bytes for s in result.stages), peak_reserved_bytes=None, swapped=swapped,
        recomputed=recomputed, recompute_s=sum(s.fitted.result.recompute_s for s in result.stages),
        stall_s=sum(s.fitted.result.stall_s for s in result.stages), bound=bound, stages=tuple(plans),
        layout_comm_s=layout_s, **{**base, "optimizer_s": sum(times[s.index].tail_s for s in first),
                                   "model_flops_per_step": flops,
                                   "layout_note": LAYOUT_NOTE + (f"; unpriced: {unpriced}" if unpriced else "")},
    )
