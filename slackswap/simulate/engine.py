"""Discrete-event execution of a validated plan: one compute stream, copy engines, a byte-exact budget.

The semantics are in docs/simulation.md. This is a list scheduler, not a general event queue: every
stream runs a list in a fixed order (the compute steps; each direction's transfers, FIFO), so at any
time at most one step and one transfer per engine are in flight, and what can start next is always
the head of a list. The loop keeps those heads as plain integers, the running step's end in a local,
and the few copies in flight in a tiny heapq, over flat lists indexed by step, copy and transfer, all
in local variables of one function (attribute and method lookups were most of the cost of the earlier
object-per-event loop). What it records per event is what the run decides (start, end, a step's
waits, a copy's engine), stored by index into preallocated lists; `EventLog` makes TraceEvents of
them on first use (building one per event in the loop cost more than the scheduling). The busy time
and bytes of each copy direction are computed once after the loop from the recorded copy intervals
(`_busy_s`). The loop's steps are named in it: settle (start the offloads, the head prefetch and the
next step that can start), advance to the next instant, and apply that instant's completions (a
copy's or the running step's end); the free step is `_free`, and naming what a stalled run waits
for is `_stalled`.

The rules come from `slackswap.schedule` (the copy resolver's facts in `ResolvedSchedule`, transfer
durations), as for the planners' replay. Facts of the plan that the schedule fixes are used instead
of being tracked at run time:
- a copy produced by a step is resident by the time any later step starts (steps finish in order),
  so a step only ever waits for the prefetched copies it reads;
- the readers of a copy finish in step order, so the free rule's "every reader has finished" holds
  when its *last* reader finishes: the copy is freed then, or when its offload completes if that is
  later (no per-copy reader counter). An alias copy (a view) owns no bytes and keeps the copy it
  holds alive, and a copy the model's code holds lives until the step it holds it to: the resolver
  folds both into `copy_last_use`, lists the copies a step releases without reading them in
  `released_after`, and the copies waiting for each offload in `offload_waiters` (the copy it moved
  and every copy up its `copy_holds` chain), so the loop stays the same.

Per time instant the loop first applies every completion at that time (frees, readiness), in the
order they were created (the running step carries its creation number), then starts what can start
("settle"): offloads in FIFO order, then the memory requests that are ready, tried in plan order
(step j has key (j, 0); a prefetch issued after step i has key (i, 1, list index)); each one that
fits is granted, one that does not waits without holding back the others. A ready prefetch was
issued after a finished step i < j (j the next step), so it always comes first in plan order. If no
event is left in flight while work remains, no waiting request can ever be served: the run is
infeasible, and the first of them in plan order is named.

tests/test_simulate_simpy.py checks this loop against an independent SimPy model of the same rules;
`benchmarks/bench_simulate.py` times the two side by side.
"""

from __future__ import annotations

import math
from collections import Counter
from heapq import heappop, heappush

from slackswap.errors import ConfigError, SlackSwapError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan, StepKind
from slackswap.schedule.copies import ResolvedSchedule
from slackswap.schedule.transfer import d2h_s, h2d_s
from slackswap.schedule.validate import resolve_schedule
from slackswap.simulate.result import EventLog, Infeasibility, SimResult

_D2H_END, _H2D_END = 1, 2


def simulate(graph: Graph, plan: Plan, hardware: Hardware, budget_bytes: int | None) -> SimResult:
    """Validate `plan` and execute it under `budget_bytes` of device activation memory (None: no limit).

    Raises `PlanValidationError` for an inconsistent plan and `ConfigError` for a bad budget. An
    infeasible budget is not an error: the result has `feasible=False` and `infeasible_reason`.
    """
    if budget_bytes is not None and (
        not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0
    ):
        raise ConfigError("budget_bytes", budget_bytes, "must be a non-negative integer or None (no limit)")
    schedule = resolve_schedule(graph, plan)
    return _execute(graph, plan, hardware, budget_bytes, schedule)


def _free(size: int, now: float, in_use: int, mem_t: list[float], mem_b: list[int]) -> int:
    """The free step: a copy gives its `size` bytes back at `now`; the memory curve records the new
    total (a zero-byte copy, an alias, changes nothing). Returns the bytes in use."""
    if size:
        in_use -= size
        mem_t.append(now)
        mem_b.append(in_use)
    return in_use


def _execute(graph: Graph, plan: Plan, hardware: Hardware, budget_bytes: int | None, s: ResolvedSchedule) -> SimResult:
    budget = math.inf if budget_bytes is None else budget_bytes
    steps = plan.steps
    n_steps = len(steps)
    duration_of = graph.op_duration_s
    read_copies = s.read_copies
    read_starts = s.read_starts
    copy_size = s.copy_size
    n_copies = len(copy_size)
    step_alloc = s.step_alloc_bytes
    last_use = s.copy_last_use
    # When step j ends, the compute stream releases the copies it reads whose last use it is (found
    # from `last_use` as it ends), then `released_after[j]` (copies it does not read whose last use it
    # is, and its outputs nobody reads): each is freed, or marked to be freed by its offloads. Per
    # offload, the copies waiting for it (`offload_waiters`); per copy, the offloads still awaited.
    released_after = s.released_after
    offload_waiters = s.offload_waiters
    offloads_left = [0] * n_copies
    for waiting in offload_waiters:
        for c in waiting:
            offloads_left[c] += 1
    # The reads of prefetched copies (the only inputs that can be late), in step order, with a sentinel
    # step: the next step's are at `next_late` onwards, if any.
    late_steps = s.prefetched_read_steps + (n_steps,)
    late_copies = s.prefetched_read_copies
    next_late = 0
    produced = [False] * n_copies  # tracked for prefetched copies only
    ready_s = [0.0] * n_copies
    readers_done = [False] * n_copies  # producer and every reader have finished

    link = hardware.link
    off_copy = s.offload_copy
    n_off = len(off_copy)
    # Issuing steps, with a sentinel past the last transfer that no finished step reaches.
    off_issue = [t.issue_after_step for t in plan.offloads] + [n_steps]
    off_bytes = s.offload_bytes
    off_dur = [d2h_s(b, hardware) for b in off_bytes]
    off_finished = [False] * n_off
    pre_copy = s.prefetch_copy
    n_pre = len(pre_copy)
    pre_issue = [t.issue_after_step for t in plan.prefetches] + [n_steps]
    pre_offload = s.prefetch_offload
    pre_dur = [h2d_s(b, hardware) for b in s.prefetch_bytes]

    recompute_kind = StepKind.RECOMPUTE  # compared with ==: a plan may carry plain strings
    # Heap of the copies in flight: (end, seq, stream, index, engine). The running step is kept apart.
    transfers: list[tuple[float, int, int, int, int]] = []
    seq = 0  # creation order of every event, compute steps included: completions at one instant apply in it
    in_use = 0
    mem_t: list[float] = [0.0]
    mem_b: list[int] = [0]
    # The events, as `EventLog` keeps them: per stream, when each started and ended (a step's waits, a
    # copy's engine), and the order in which they started.
    step_start = [0.0] * n_steps
    step_stop = [0.0] * n_steps
    step_wait_prefetch = [0.0] * n_steps
    step_wait_memory = [0.0] * n_steps
    off_start = [0.0] * n_off
    off_end = [0.0] * n_off
    off_engine = [0] * n_off
    pre_start = [0.0] * n_pre
    pre_end = [0.0] * n_pre
    pre_engine = [0] * n_pre
    order: list[int] = []
    pre_code = n_steps + n_off
    next_step = 0
    step_running = False
    step_end = 0.0  # end and creation order of the running step
    step_seq = 0
    last_done = -1  # highest finished step; steps finish in order
    prev_end = 0.0
    next_off = 0
    next_pre = 0
    d2h_free = list(range(link.d2h_engines))  # min-heaps of free engine ids
    h2d_free = list(range(link.h2d_engines))
    stall_prefetch = stall_memory = 0.0
    compute_busy = recompute_busy = 0.0
    now = 0.0
    while True:
        # -- settle: start everything that can start at `now` --------------------------------
        # Offloads first (nothing later in the settle can ready another one). Then, in plan order, the
        # head prefetch and the next step; only a started prefetch can make another request ready (the
        # next prefetch, on another free engine), so only then is the pair tried again.
        while off_issue[next_off] <= last_done and d2h_free:
            k = next_off
            engine = heappop(d2h_free)
            end = now + off_dur[k]
            off_start[k] = now
            off_end[k] = end
            off_engine[k] = engine
            order.append(n_steps + k)
            next_off = k + 1
            heappush(transfers, (end, seq, _D2H_END, k, engine))
            seq += 1
        prefetched = True
        while prefetched:
            prefetched = False
            k = next_pre
            if pre_issue[k] <= last_done and h2d_free and off_finished[pre_offload[k]]:
                c = pre_copy[k]
                size = copy_size[c]
                if in_use + size <= budget:
                    engine = heappop(h2d_free)
                    if size:
                        in_use += size
                        mem_t.append(now)
                        mem_b.append(in_use)
                    end = now + pre_dur[k]
                    pre_start[k] = now
                    pre_end[k] = end
                    pre_engine[k] = engine
                    order.append(pre_code + k)
                    next_pre = k + 1
                    heappush(transfers, (end, seq, _H2D_END, k, engine))
                    seq += 1
                    prefetched = True
            j = next_step
            if not step_running and j < n_steps:
                if late_steps[next_late] == j:
                    late_stop = next_late + 1
                    while late_steps[late_stop] == j:
                        late_stop += 1
                    late = late_copies[next_late:late_stop]
                else:
                    late = None
                if late is None or all(produced[c] for c in late):
                    size = step_alloc[j]
                    if in_use + size <= budget:
                        if late is None:
                            held_from = prev_end
                        else:
                            inputs_ready = max([ready_s[c] for c in late])
                            held_from = prev_end if prev_end >= inputs_ready else inputs_ready
                            wait_prefetch = max(0.0, inputs_ready - prev_end)
                            stall_prefetch += wait_prefetch
                            step_wait_prefetch[j] = wait_prefetch
                            next_late = late_stop
                        if now != held_from:  # it waited for memory (0.0 is already recorded)
                            wait_memory = now - held_from
                            stall_memory += wait_memory
                            step_wait_memory[j] = wait_memory
                        if size:
                            in_use += size
                            mem_t.append(now)
                            mem_b.append(in_use)
                        step = steps[j]
                        end = now + duration_of[step.op]
                        step_start[j] = now
                        step_stop[j] = end
                        order.append(j)
                        if step.kind == recompute_kind:
                            recompute_busy += end - now
                        compute_busy += end - now
                        step_running = True
                        step_end = end
                        step_seq = seq
                        seq += 1
                        next_step = j + 1
        # -- the next instant: the running step's end or the first copy's end ---------------------
        if step_running:
            now = step_end
            if transfers and transfers[0][0] < now:
                now = transfers[0][0]
        elif transfers:
            now = transfers[0][0]
        else:
            break
        # -- completions at that instant, in creation order ----------------------------------------
        step_due = step_running and step_end == now
        while True:
            if transfers and transfers[0][0] == now and not (step_due and step_seq < transfers[0][1]):
                _, _, kind, index, engine = heappop(transfers)
                if kind == _D2H_END:
                    off_finished[index] = True
                    heappush(d2h_free, engine)
                    for c in offload_waiters[index]:
                        offloads_left[c] -= 1
                        if readers_done[c] and not offloads_left[c]:
                            in_use = _free(copy_size[c], now, in_use, mem_t, mem_b)
                else:
                    c = pre_copy[index]
                    produced[c] = True
                    ready_s[c] = now
                    heappush(h2d_free, engine)
                    if last_use[c] < 0:  # nobody reads it: freed when it lands
                        in_use = _free(copy_size[c], now, in_use, mem_t, mem_b)
            elif step_due:
                step_due = step_running = False
                j = last_done = next_step - 1
                prev_end = now
                for c in read_copies[read_starts[j]:read_starts[j + 1]]:
                    if last_use[c] == j:
                        if offloads_left[c]:
                            readers_done[c] = True  # freed when its offloads complete
                        else:
                            in_use = _free(copy_size[c], now, in_use, mem_t, mem_b)
                for c in released_after[j]:
                    if offloads_left[c]:
                        readers_done[c] = True
                    else:
                        in_use = _free(copy_size[c], now, in_use, mem_t, mem_b)
            else:
                break

    infeasibility = None
    if next_step < n_steps or next_off < n_off or next_pre < n_pre:
        infeasibility = _stalled(
            s, steps, budget_bytes, now, in_use, next_step=next_step, next_off=next_off, next_pre=next_pre,
            step_running=step_running, prefetch_ready=bool(h2d_free) and next_pre < n_pre
            and pre_issue[next_pre] <= last_done and off_finished[pre_offload[next_pre]],
            late_steps=late_steps, late_copies=late_copies, produced=produced,
        )
    # The end of the last event: steps end in order, copies of a direction may not (several engines).
    end_s = max([step_stop[next_step - 1] if next_step else 0.0, *off_end[:next_off], *pre_end[:next_pre]])
    decided = Counter(plan.decisions.values())
    return SimResult(
        planner=plan.planner,
        feasible=infeasibility is None,
        infeasible_reason=None if infeasibility is None else _reason(infeasibility),
        infeasibility=infeasibility,
        step_s=end_s if infeasibility is None else None,
        end_s=max(end_s, now),
        budget_bytes=budget_bytes,
        peak_activation_bytes=max(mem_b),
        events=EventLog(
            steps=steps, step_bytes=step_alloc, step_start_s=step_start, step_end_s=step_stop,
            step_wait_prefetch_s=step_wait_prefetch, step_wait_memory_s=step_wait_memory,
            offloads=plan.offloads, offload_bytes=off_bytes, offload_start_s=off_start, offload_end_s=off_end,
            offload_engine=off_engine, prefetches=plan.prefetches, prefetch_bytes=s.prefetch_bytes,
            prefetch_start_s=pre_start, prefetch_end_s=pre_end, prefetch_engine=pre_engine, order=order,
        ),
        memory_times_s=tuple(mem_t),
        memory_bytes=tuple(mem_b),
        compute_busy_s=compute_busy,
        recompute_s=recompute_busy,
        stall_prefetch_s=stall_prefetch,
        stall_memory_s=stall_memory,
        d2h_busy_s=_busy_s(off_start[:next_off], off_end[:next_off]),
        h2d_busy_s=_busy_s(pre_start[:next_pre], pre_end[:next_pre]),
        d2h_bytes=sum(off_bytes[:next_off]),
        h2d_bytes=sum(copy_size[pre_copy[k]] for k in range(next_pre)),
        swapped_tensors=decided[Decision.SWAP],
        recomputed_tensors=decided[Decision.RECOMPUTE],
        bound_step_s=plan.bound_step_s,
    )


def _stalled(
    s: ResolvedSchedule, steps, budget_bytes: int | None, now: float, in_use: int, *, next_step: int,
    next_off: int, next_pre: int, step_running: bool, prefetch_ready: bool, late_steps, late_copies, produced,
) -> Infeasibility:
    """Nothing is in flight and work remains: name the first waiting memory request in plan order (the
    head prefetch, if it is ready, else the next step if its inputs are there). Anything else means
    validation let a deadlocking plan through."""
    copy_size = s.copy_size
    if prefetch_ready:
        c = s.prefetch_copy[next_pre]
        first_reader = s.prefetch_readers[next_pre][0]
        return Infeasibility("prefetch", (s.copy_tensor[c],), first_reader, steps[first_reader].op,
                             copy_size[c], in_use, budget_bytes, now)
    if next_step < len(steps) and not step_running and all(
        produced[c] for j, c in zip(late_steps, late_copies, strict=False) if j == next_step
    ):
        step = steps[next_step]
        return Infeasibility("step", tuple(step.outputs), next_step, step.op, s.step_alloc_bytes[next_step],
                             in_use, budget_bytes, now)
    raise SlackSwapError(
        f"simulator stalled at t={now} with no memory request pending (step {next_step}, "
        f"offload {next_off}, prefetch {next_pre}); validation should have rejected this plan"
    )


def _busy_s(starts: list[float], ends: list[float]) -> float:
    """The length of the union of one direction's copy intervals. A direction starts its copies in
    time order, so one pass merging into the current interval suffices (no sort)."""
    busy = 0.0
    merged_from = merged_to = -1.0
    for start, end in zip(starts, ends, strict=True):
        if start > merged_to:
            busy += merged_to - merged_from
            merged_from, merged_to = start, end
        elif end > merged_to:
            merged_to = end
    return busy + (merged_to - merged_from)


def _reason(inf: Infeasibility) -> str:
    names = ", ".join(repr(t) for t in inf.tensors)
    if inf.request == "step":
        what = f"step {inf.step} (op {inf.op!r}) cannot allocate its output tensor(s) {names}"
    else:
        what = f"the prefetch of tensor {names} (read by step {inf.step}, op {inf.op!r}) cannot allocate"
    return (
        f"infeasible: {what}: needs {inf.needed_bytes} bytes with {inf.in_use_bytes} bytes in use "
        f"against a budget of {inf.budget_bytes} bytes, and nothing in flight can free room (t={inf.time_s:.6g} s)"
    )
