"""From one stage's single-stage simulation to what the pipeline step needs: op times and memory.

`stage_times(graph, result)` splits the simulated micro-batch step of a stage graph
(`slackswap.profile.stages`) at the end of its forward: the forward is [0, end of the last forward /
loss step], the backward up to the end of the last backward step, the tail the rest (optimizer
steps, trailing copies). The wait for prefetches before the first backward step (and for anything
before the first forward step) is the part the stage's idle time before the op can hide
(`slackswap.simulate.pipeline`).

`device_peak_bytes` walks a device's schedule order (interleaved 1F1B: several chunks per device)
with each chunk's resident bytes and peak. `stage_peak_bytes(result, in_flight)` is the stage's
activation peak with `in_flight` micro-batches held (1F1B: min(p - i, m)): (in_flight - 1) x the
bytes one micro-batch keeps on the device at the end of its forward, plus the single micro-batch's
peak. A plan planned within budget / in_flight (`slackswap.pipeline_stages.stage_budget_bytes`)
keeps it within the budget, since what a micro-batch keeps at the end of its forward is never above
its peak. What it leaves out: the resident micro-batches' offloads still in flight at that instant
are counted as on the device (conservative), and the copies of different micro-batches are not
placed on shared copy engines.
"""

from __future__ import annotations

from slackswap.graph import FORWARD_PHASES, Graph, OpClass, Phase
from slackswap.simulate.pipeline import StageTimes
from slackswap.simulate.result import SimResult


def forward_end_s(graph: Graph, result: SimResult) -> float:
    """The end of the last forward or loss step of the simulated micro-batch."""
    phase = {op.name: op.phase for op in graph.ops}
    ends = [e.end_s for e in result.events if e.stream == "compute" and e.kind == "run"
            and phase[e.op] in FORWARD_PHASES]
    return max(ends, default=0.0)


def stage_times(graph: Graph, result: SimResult) -> StageTimes:
    """The stage's forward, backward and tail seconds of one micro-batch, from its feasible simulation."""
    if not result.feasible or result.step_s is None:
        raise ValueError(f"stage {graph.name}: no times from an infeasible simulation")
    phase = {op.name: op.phase for op in graph.ops}
    fwd_end = forward_end_s(graph, result)
    compute = [e for e in result.events if e.stream == "compute"]
    backward = [e for e in compute if e.start_s >= fwd_end and phase[e.op] == Phase.BACKWARD]
    bwd_end = max((e.end_s for e in backward), default=fwd_end)
    first_fwd = compute[0] if compute else None
    fwd_hide = first_fwd.wait_prefetch_s if first_fwd is not None and phase[first_fwd.op] in FORWARD_PHASES else 0.0
    bwd_hide = backward[0].wait_prefetch_s if backward else 0.0
    # ZB-H1's W: half of each backward GEMM (dgrad and wgrad have the forward's FLOPs each, the profile's
    # backward = 2x forward); the attention core and elementwise ops have no weight gradient to split off.
    matmul = {op.name for op in graph.ops if op.phase == Phase.BACKWARD and op.op_class == OpClass.MATMUL}
    weight = sum(e.end_s - e.start_s for e in backward if e.kind == "run" and e.op in matmul) / 2
    return StageTimes(
        forward_s=fwd_end,
        backward_s=bwd_end - fwd_end,
        forward_hideable_s=min(fwd_hide, fwd_end),
        backward_hideable_s=min(bwd_hide, bwd_end - fwd_end),
        tail_s=max(0.0, result.step_s - bwd_end),
        weight_grad_s=min(weight, bwd_end - fwd_end - min(bwd_hide, bwd_end - fwd_end)),
    )


def resident_bytes(graph: Graph, result: SimResult) -> int:
    """Device activation bytes one micro-batch holds at the end of its forward: what it keeps while
    the stage runs other micro-batches. At that instant the simulator first frees what the last
    forward step released, then allocates for the first backward step, so it is the least of the
    samples at that instant and the last one before it."""
    fwd_end = forward_end_s(graph, result)
    before, at = 0, []
    for t, b in zip(result.memory_times_s, result.memory_bytes, strict=True):
        if t < fwd_end:
            before = b
        elif t == fwd_end:
            at.append(b)
        else:
            break
    return min([before, *at])


def stage_peak_bytes(graph: Graph, result: SimResult, in_flight: int) -> int:
    """The stage's activation peak with `in_flight` micro-batches held (module docstring)."""
    return (in_flight - 1) * resident_bytes(graph, result) + result.peak_activation_bytes


def device_peak_bytes(order: list[tuple[str, int, int]], resident: list[int], peak: list[int]) -> int:
    """A device's activation peak over its schedule `order` ((kind, local chunk, micro-batch), from
    `slackswap.pipeline_stages.schedule_order`): at each op, the bytes every other micro-batch chunk it
    holds keeps (`resident[chunk]`) plus the running chunk's own peak (`peak[chunk]`). Under 1F1B (one
    chunk) it is `stage_peak_bytes` with the schedule's in-flight count; interleaved, the chunks differ
    (the first holds the embedding, the last the head), so the walk takes the mix the order holds.
    ZB-H1: a micro-batch stays held after its B until its W (which reads its saved linear inputs and
    allocates only weight gradients, static memory): its B runs beside the others held, its W
    releases it."""
    held: dict[tuple[int, int], int] = {}
    most = 0
    split = any(kind == "W" for kind, _, _ in order)
    for kind, chunk, j in order:
        if kind == "W":
            held.pop((chunk, j), None)
            continue
        own = held.pop((chunk, j), None) if kind == "B" else None
        most = max(most, sum(held.values()) + peak[chunk])
        if kind == "F" or (split and own is not None):
            held[(chunk, j)] = resident[chunk]
    return most
