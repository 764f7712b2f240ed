"""A fast, analytical replay of a plan: compute and copy-engine times, and device memory over time.

Why this exists: planners try many candidate schedules (slackswap plans an 80-layer model in under
a second), so they cannot run the discrete-event simulator for each one. The replay computes the
same times in closed form, *without a budget*: nothing ever waits for memory. Its rules are the
simulator's, taken from this package: copy resolution and validation (`validate.resolve_schedule`),
transfer durations and the in-order engine queue (`transfer`), the free rule (`memory`). Whenever the
simulator's run never makes an allocation wait (no budget, or a budget at or above the replay's
peak), the two agree exactly on step time and peak; tests/test_schedule_differential.py checks that
on random graphs and plans with 1-3 engines per direction. A planner rejects a plan whose replayed
peak is above its budget, so every plan it hands over never waits for memory in the simulator.

- one compute stream runs `plan.steps` in order; a step starts when the previous one ends and every
  copy it reads is produced; it lasts its op's `duration_s` (a recompute step too);
- a transfer is ready when its issuing step has finished (and, for a prefetch, its tensor's offload
  has finished); each direction's queue starts it as `transfer.CopyQueue` says;
- a step allocates its outputs when it starts, a prefetch when it starts; frees follow `memory`.

Ties: the agreement is exact when every op has a positive duration. A zero-duration step allocates
and frees at the same instant; the simulator counts that copy at its peak, the replay (frees first)
does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from slackswap.errors import PlanValidationError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan, StepKind
from slackswap.schedule.memory import free_time_s
from slackswap.schedule.transfer import CopyQueue, d2h_s, h2d_s
from slackswap.schedule.validate import resolve_schedule


@dataclass(frozen=True)
class PlanTimeline:
    """What `estimate_plan` computes. Times in seconds from the start of the step."""

    step_s: float
    peak_bytes: int
    peak_time_s: float
    #: Compute time spent waiting for prefetches.
    stall_s: float
    recompute_s: float
    step_start_s: tuple[float, ...]
    step_end_s: tuple[float, ...]
    offload_end_s: tuple[float, ...]
    prefetch_start_s: tuple[float, ...]
    prefetch_end_s: tuple[float, ...]


def estimate_plan(graph: Graph, plan: Plan, hardware: Hardware) -> PlanTimeline:
    """Replay `plan` with no memory limit; see the module docstring for the rules.

    Raises `PlanValidationError` for a plan the simulator would reject."""
    s = resolve_schedule(graph, plan)
    ops = graph.op_by_name
    n_steps = len(plan.steps)
    n_off, n_pre = len(plan.offloads), len(plan.prefetches)
    off_dur = [d2h_s(b, hardware) for b in s.offload_bytes]
    pre_dur = [h2d_s(b, hardware) for b in s.prefetch_bytes]
    d2h = CopyQueue(hardware.link.d2h_engines)
    h2d = CopyQueue(hardware.link.h2d_engines)
    offload_end = [float("nan")] * n_off
    prefetch_start = [float("nan")] * n_pre
    prefetch_end = [float("nan")] * n_pre
    step_start = [0.0] * n_steps
    step_end = [0.0] * n_steps
    copies = s.copies
    copy_ready = [float("nan")] * len(copies)
    next_off = next_pre = 0

    def issued_at(issue_after_step: int) -> float:
        return 0.0 if issue_after_step < 0 else step_end[issue_after_step]

    def start_transfers(done_through: int) -> None:
        """Start, in list order, every transfer whose issuing step (and offload) is done."""
        nonlocal next_off, next_pre
        while next_off < n_off and plan.offloads[next_off].issue_after_step <= done_through:
            issued = issued_at(plan.offloads[next_off].issue_after_step)
            _, offload_end[next_off] = d2h.start(issued, off_dur[next_off])
            next_off += 1
        while (
            next_pre < n_pre
            and plan.prefetches[next_pre].issue_after_step <= done_through
            and s.prefetch_offload[next_pre] < next_off
        ):
            issued = issued_at(plan.prefetches[next_pre].issue_after_step)
            ready = max(issued, offload_end[s.prefetch_offload[next_pre]])
            prefetch_start[next_pre], prefetch_end[next_pre] = h2d.start(ready, pre_dur[next_pre])
            copy_ready[s.prefetch_copy[next_pre]] = prefetch_end[next_pre]
            next_pre += 1

    start_transfers(-1)
    now = stall = recompute = 0.0
    for j, step in enumerate(plan.steps):
        ready = now
        for c in s.step_reads[j]:
            if copy_ready[c] != copy_ready[c]:  # NaN: its prefetch has not started (validation prevents it)
                raise PlanValidationError(f"step {j} ({step.op}) reads {copies[c].tensor!r} before its copy exists")
            ready = max(ready, copy_ready[c])
        duration = ops[step.op].duration_s
        stall += ready - now
        if step.kind == StepKind.RECOMPUTE:
            recompute += duration
        step_start[j], step_end[j] = ready, ready + duration
        now = step_end[j]
        for c in s.step_writes[j]:
            copy_ready[c] = now
        start_transfers(j)

    events: list[tuple[float, int]] = []
    aliases_freed: list[float | None] = [None] * len(copies)
    # An alias copy is made after the copy it holds, so walking backwards settles every alias first.
    for c in reversed(range(len(copies))):
        copy = copies[c]
        starts = prefetch_start if copy.source == "prefetch" else step_start
        alloc = starts[copy.source_index]
        last_read = step_end[copy.readers[-1]] if copy.readers else None
        offloaded = None if copy.offload is None else offload_end[copy.offload]
        free = free_time_s(copy_ready[c], last_read, offloaded, aliases_freed[c])
        if copy.holds is not None:
            held = aliases_freed[copy.holds]
            aliases_freed[copy.holds] = free if held is None else max(held, free)
        events.append((alloc, copy.size_bytes))
        events.append((free, -copy.size_bytes))
    events.sort(key=lambda e: (e[0], e[1] > 0))
    current = peak = 0
    peak_time = 0.0
    for time_s, delta in events:
        current += delta
        if current > peak:
            peak, peak_time = current, time_s
    return PlanTimeline(
        step_s=max(now, *offload_end, *prefetch_end) if n_off or n_pre else now,
        peak_bytes=peak,
        peak_time_s=peak_time,
        stall_s=stall,
        recompute_s=recompute,
        step_start_s=tuple(step_start),
        step_end_s=tuple(step_end),
        offload_end_s=tuple(offload_end),
        prefetch_start_s=tuple(prefetch_start),
        prefetch_end_s=tuple(prefetch_end),
    )
