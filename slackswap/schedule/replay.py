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


def _durations(graph: Graph) -> dict[str, float]:
    """Op name -> duration, cached on the graph (derived data of a frozen object): one lookup per
    step instead of the op record and its attribute."""
    cached = graph.__dict__.get("_replay_durations")
    if cached is None:
        cached = graph.__dict__["_replay_durations"] = {op.name: op.duration_s for op in graph.ops}
    return cached


def _replay(graph: Graph, plan: Plan, hardware: Hardware) -> PlanTimeline:
    s = resolve_schedule(graph, plan)
    duration_of = _durations(graph)
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
    for c in s.prefetch_copy:
        for j in s.copy_readers[c]:
            waits_on.setdefault(j, []).append(c)
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
        for c in s.step_writes[j]:
            copy_ready[c] = now
        if (next_off < n_off and off_issue[next_off] <= j) or (next_pre < n_pre and pre_issue[next_pre] <= j):
            start_transfers(j)

    # Peak: frees at an instant come before allocations. Allocations and frees are sorted apart (plain
    # tuple sorts, no key function) and merged: before each allocation, every free at or before its
    # instant is applied. Only an allocation can raise the peak. An alias copy owns no bytes but keeps
    # the copy it holds alive; it is made after that copy, so walking backwards settles every alias first.
    allocs: list[tuple[float, int]] = []
    frees: list[tuple[float, int]] = []
    aliases_freed: list[float | None] = [None] * len(copy_size)
    for c in reversed(range(len(copy_size))):
        index, readers, offload = s.copy_source_index[c], s.copy_readers[c], s.copy_offload[c]
        alloc = prefetch_start[index] if s.copy_source[c] == "prefetch" else step_start[index]
        last_read = step_end[readers[-1]] if readers else None
        offloaded = None if offload is None else offload_end[offload]
        free = free_time_s(copy_ready[c], last_read, offloaded, aliases_freed[c])
        holds = s.copy_holds[c]
        if holds is not None:
            held = aliases_freed[holds]
            aliases_freed[holds] = free if held is None else max(held, free)
        size = copy_size[c]
        if size:
            allocs.append((alloc, size))
            frees.append((free, size))
    allocs.sort()
    frees.sort()
    current = peak = 0
    peak_time = 0.0
    k, n_frees = 0, len(frees)
    for time_s, size in allocs:
        while k < n_frees and frees[k][0] <= time_s:
            current -= frees[k][1]
            k += 1
        current += size
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
