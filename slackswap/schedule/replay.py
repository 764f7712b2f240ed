"""A fast, analytical replay of a plan: compute and copy-engine times, and device memory over time.

Why this exists: planners try many candidate schedules (slackswap plans an 80-layer model in under
a second), so they cannot run the discrete-event simulator for each one. The replay computes the
same times in closed form, *without a budget*: nothing ever waits for memory. Its rules are the
simulator's, taken from this package: copy resolution and validation (`validate.resolve_schedule`),
transfer durations and the in-order engine queue (`transfer`), the free rule (`memory`). Whenever the
simulator's run never makes an allocation wait (no budget, or a budget at or above the replay's
peak), the two agree exactly on step time and peak; tests/test_schedule_differential.py checks that
on random graphs and plans with 1-3 engines per direction. A planner rejects a plan whose replayed
peak is above its budget, so every plan it hands over never waits for memory in the simulator
(the one exception, by design, is `swap_only` with `memory_waits: true`: vDNN as published waits,
and its plan is checked in the simulator instead).

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

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slackswap.errors import PlanValidationError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan, StepKind
from slackswap.schedule.free_rule import free_time_s
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
    #: The memory profile: each device copy's allocation and free instant and its bytes (the resolved
    #: schedule's copies, in its order); `peak_bytes` over them is `peak_bytes` above. A planner
    #: predicts what a change of decisions adds to it before building that schedule
    #: (`planners/support/unneeded_swaps.py`).
    copy_alloc_s: tuple[float, ...] = ()
    copy_free_s: tuple[float, ...] = ()
    copy_size_bytes: tuple[int, ...] = ()


#: The last replays, by identity of (plan, graph, hardware): all three are immutable, and a planner
#: replays the same plan object more than once (the probe that found it, then the comparison of
#: alternatives; the MILP planner replays its heuristics' plans again). Weak references, so a memo
#: entry never keeps a plan or graph alive; the id is only trusted while the object is.
_MEMO: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref, PlanTimeline]] = {}
_MEMO_SIZE = 64


def estimate_plan(graph: Graph, plan: Plan, hardware: Hardware) -> PlanTimeline:
    """Replay `plan` with no memory limit; see the module docstring for the rules.

    Raises `PlanValidationError` for a plan the simulator would reject."""
    hit = _MEMO.get(id(plan))
    if hit is not None and hit[0]() is plan and hit[1]() is graph and hit[2]() is hardware:
        return hit[3]
    timeline = _replay(graph, plan, hardware)
    if len(_MEMO) >= _MEMO_SIZE:
        del _MEMO[next(iter(_MEMO))]
    _MEMO[id(plan)] = (weakref.ref(plan), weakref.ref(graph), weakref.ref(hardware), timeline)
    return timeline


def peak_bytes(alloc_s: Sequence[float], free_s: Sequence[float], size_bytes: Sequence[int]) -> tuple[int, float]:
    """(peak bytes, the instant it is first reached) of copies alive from `alloc_s` to `free_s`; at
    one instant frees come before allocations; only an allocation can raise the peak (0 and 0.0 if
    none does). Zero-byte copies are left out.

    Why numpy: the event merge made two tuples per copy, and those GC-tracked objects (30,000 at 320
    layers) cost a collector pass as much as the merge itself. Sorted by (time, free before
    allocation); the order among equal events does not matter, since the bytes of one instant's
    allocations are all added before the next free and the running total only grows within them.
    """
    size = np.asarray(size_bytes, dtype=np.int64)
    held = size != 0
    n = int(held.sum())
    if n == 0:
        return 0, 0.0
    size = size[held]
    times = np.concatenate([np.asarray(free_s, dtype=float)[held], np.asarray(alloc_s, dtype=float)[held]])
    is_alloc = np.concatenate([np.zeros(n, dtype=bool), np.ones(n, dtype=bool)])
    order = np.lexsort((is_alloc, times))
    running = np.cumsum(np.concatenate([-size, size])[order])
    at_alloc = running[is_alloc[order]]
    first_max = int(np.argmax(at_alloc))
    if at_alloc[first_max] <= 0:
        return 0, 0.0
    return int(at_alloc[first_max]), float(times[order][is_alloc[order]][first_max])


def _replay(graph: Graph, plan: Plan, hardware: Hardware) -> PlanTimeline:
    s = resolve_schedule(graph, plan)
    duration_of = graph.op_duration_s
    n_steps = len(plan.steps)
    n_off, n_pre = len(plan.offloads), len(plan.prefetches)
    copy_size = s.copy_size
    off_dur = [d2h_s(b, hardware) for b in s.offload_bytes]
    pre_dur = [h2d_s(b, hardware) for b in s.prefetch_bytes]
    d2h = CopyQueue(hardware.link.d2h_engines)
    h2d = CopyQueue(hardware.link.h2d_engines)
    offload_end = [float("nan")] * n_off
    prefetch_start = [float("nan")] * n_pre
    prefetch_end = [float("nan")] * n_pre
    step_start = [0.0] * n_steps
    step_end = [0.0] * n_steps
    copy_ready = [float("nan")] * len(copy_size)
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

    # Only prefetched copies can be late: a copy a step produced is ready before any later step starts.
    waits_on: dict[int, list[int]] = {}
    for j, c in zip(s.prefetched_read_steps, s.prefetched_read_copies, strict=True):
        waits_on.setdefault(j, []).append(c)
    write_starts, write_stops = s.write_starts, s.write_stops
    off_issue = [t.issue_after_step for t in plan.offloads]
    pre_issue = [t.issue_after_step for t in plan.prefetches]
    start_transfers(-1)
    now = stall = recompute = 0.0
    recompute_kind = StepKind.RECOMPUTE
    for j, step in enumerate(plan.steps):
        ready = now
        late = waits_on.get(j)
        if late is not None:
            for c in late:
                if copy_ready[c] != copy_ready[c]:  # NaN: its prefetch has not started (validation prevents it)
                    raise PlanValidationError(
                        f"step {j} ({step.op}) reads {s.copy_tensor[c]!r} before its copy exists"
                    )
                ready = max(ready, copy_ready[c])
        duration = duration_of[step.op]
        stall += ready - now
        if step.kind == recompute_kind:
            recompute += duration
        step_start[j], step_end[j] = ready, ready + duration
        now = step_end[j]
        for c in range(write_starts[j], write_stops[j]):
            copy_ready[c] = now
        if (next_off < n_off and off_issue[next_off] <= j) or (next_pre < n_pre and pre_issue[next_pre] <= j):
            start_transfers(j)

    # Free instants. An alias copy owns no bytes but keeps the copy it holds alive; it is made after
    # that copy, so walking backwards settles every alias first. `copy_last_use` is the last step
    # reading the copy or an alias holding it: steps end in order and an alias is freed no earlier
    # than its own last reader ends, so the free instant is the same as with the copy's own last reader.
    last_use, source, source_index, offload_of, holds_of = (
        s.copy_last_use, s.copy_source, s.copy_source_index, s.copy_offload, s.copy_holds)
    n_copies = len(copy_size)
    alloc_s = [0.0] * n_copies
    free_s = [0.0] * n_copies
    aliases_freed: list[float | None] = [None] * n_copies
    for c in reversed(range(n_copies)):
        index, last, offload = source_index[c], last_use[c], offload_of[c]
        alloc_s[c] = prefetch_start[index] if source[c] == "prefetch" else step_start[index]
        last_read = step_end[last] if last >= 0 else None
        offloaded = None if offload is None else offload_end[offload]
        free = free_s[c] = free_time_s(copy_ready[c], last_read, offloaded, aliases_freed[c])
        holds = holds_of[c]
        if holds is not None:
            held = aliases_freed[holds]
            aliases_freed[holds] = free if held is None else max(held, free)
    peak, peak_time = peak_bytes(alloc_s, free_s, copy_size)
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
        copy_alloc_s=tuple(alloc_s),
        copy_free_s=tuple(free_s),
        copy_size_bytes=tuple(copy_size),
    )
