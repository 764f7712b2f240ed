"""Discrete-event execution of a validated plan: one compute stream, copy engines, a byte-exact budget.

The semantics are in docs/simulation.md. This is a list scheduler, not a general event queue: every
stream runs a list in a fixed order (the compute steps; each direction's transfers, FIFO), so at any
time at most one step and one transfer per engine are in flight, and what can start next is always
the head of a list. The loop keeps those heads as plain integers and the few in-flight completions in
a tiny heapq, over flat lists indexed by step, copy and transfer, all in local variables of one
function (attribute and method lookups were most of the cost of the earlier object-per-event loop).

The rules come from `slackswap.schedule` (copy resolution, transfer durations, the free rule of
`schedule.memory`), as for the planners' replay. Facts of the plan that the schedule fixes are used
instead of being tracked at run time:
- a copy produced by a step is resident by the time any later step starts (steps finish in order),
  so a step only ever waits for the prefetched copies it reads;
- the readers of a copy finish in step order, so the free rule's "every reader has finished" holds
  when its *last* reader finishes: the copy is freed then, or when its offload completes if that is
  later (no per-copy reader counter). An alias copy (a view) owns no bytes and keeps the copy it
  holds alive: the resolver folds that into `copy_last_use` (the last step reading the copy or an
  alias of it) and `copy_wait_offloads` (its offload and its aliases'), so the loop stays the same.

Per time instant the loop first applies every completion at that time (frees, readiness), in the
order they were created, then starts what can start ("settle"): offloads in FIFO order, then the
memory requests that are ready, tried in plan order (step j has key (j, 0); a prefetch issued after
step i has key (i, 1, list index)); each one that fits is granted, one that does not waits without
holding back the others. A ready prefetch was issued after a finished step i < j (j the next step),
so it always comes first in plan order. If no event is left in flight while work remains, no waiting
request can ever be served: the run is infeasible, and the first of them in plan order is named.

tests/test_simulate_simpy.py checks this loop against an independent SimPy model of the same rules;
`benchmarks/bench_simulate.py` times the two side by side.
"""

from __future__ import annotations

import math
from heapq import heappop, heappush

from slackswap.errors import ConfigError, SlackSwapError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan, StepKind
from slackswap.schedule.transfer import d2h_s, h2d_s, transfer_s
from slackswap.schedule.validate import ResolvedSchedule, resolve_schedule
from slackswap.simulate.result import Infeasibility, SimResult, TraceEvent

_COMPUTE_END, _D2H_END, _H2D_END = 0, 1, 2


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


#: The one transfer formula (slackswap.schedule.transfer), under the name this module exported.
transfer_duration_s = transfer_s


def _execute(graph: Graph, plan: Plan, hardware: Hardware, budget_bytes: int | None, s: ResolvedSchedule) -> SimResult:
    budget = math.inf if budget_bytes is None else budget_bytes
    steps = plan.steps
    n_steps = len(steps)
    op_by_name = graph.op_by_name
    step_dur = [op_by_name[st.op].duration_s for st in steps]
    step_reads = s.step_reads
    step_writes = s.step_writes
    copy_size = s.copy_size
    copy_tensor = s.copy_tensor
    n_copies = len(copy_size)
    step_alloc = s.step_alloc_bytes
    last_reader = s.copy_last_use
    # Per step: the copies whose last use it is (they free when it ends, or when their offloads do),
    # in the order the step reads them, then copies kept alive by an alias the step reads.
    free_after: dict[int, list[int]] = {}
    for j, reads in enumerate(step_reads):
        for c in reads:
            if last_reader[c] == j:
                free_after.setdefault(j, []).append(c)
    for c, j in enumerate(last_reader):
        if j >= 0 and c not in step_reads[j]:
            free_after.setdefault(j, []).append(c)
    offloads_left = [len(w) for w in s.copy_wait_offloads]
    offload_waiters: list[list[int]] = [[] for _ in s.offload_copy]  # per offload: copies waiting for it
    for c, waits in enumerate(s.copy_wait_offloads):
        for k in waits:
            offload_waiters[k].append(c)
    # Per step: the prefetched copies it reads (the only inputs that can be late).
    waits_on: dict[int, list[int]] = {}
    for c, readers in zip(s.prefetch_copy, s.prefetch_readers, strict=True):
        for j in readers:
            waits_on.setdefault(j, []).append(c)
    produced = [False] * n_copies  # tracked for prefetched copies only
    ready_s = [0.0] * n_copies
    readers_done = [False] * n_copies  # producer and every reader have finished

    link = hardware.link
    off_copy = s.offload_copy
    n_off = len(off_copy)
    off_issue = [t.issue_after_step for t in plan.offloads]
    off_bytes = s.offload_bytes
    off_dur = [d2h_s(b, hardware) for b in off_bytes]
    off_finished = [False] * n_off
    pre_copy = s.prefetch_copy
    n_pre = len(pre_copy)
    pre_issue = [t.issue_after_step for t in plan.prefetches]
    pre_offload = s.prefetch_offload
    pre_dur = [h2d_s(b, hardware) for b in s.prefetch_bytes]

    recompute_kind = StepKind.RECOMPUTE  # compared with ==: a plan may carry plain strings
    heap: list[tuple[float, int, int, int, int]] = []
    seq = 0
    in_use = 0
    mem_t: list[float] = [0.0]
    mem_b: list[int] = [0]
    events: list[TraceEvent] = []
    make = tuple.__new__  # TraceEvent is a NamedTuple: build it without the Python-level __new__
    next_step = 0
    step_running = False
    last_done = -1  # highest finished step; steps finish in order
    prev_end = 0.0
    next_off = 0
    next_pre = 0
    d2h_free = list(range(link.d2h_engines))  # min-heaps of free engine ids
    h2d_free = list(range(link.h2d_engines))
    stall_prefetch = stall_memory = 0.0
    compute_busy = recompute_busy = 0.0
    end_s = 0.0
    now = 0.0
    while True:
        # -- settle: start everything that can start at `now` --------------------------------
        # Offloads first (nothing later in the settle can ready another one). Then, in plan order, the
        # head prefetch and the next step; only a started prefetch can make another request ready (the
        # next prefetch, on another free engine), so only then is the pair tried again.
        while next_off < n_off and d2h_free and off_issue[next_off] <= last_done:
            k = next_off
            c = off_copy[k]
            engine = heappop(d2h_free)
            end = now + off_dur[k]
            events.append(make(TraceEvent, ("d2h", "offload", k, now, end, "", copy_tensor[c], off_bytes[k],
                                            engine, 0.0, 0.0)))
            end_s = end if end > end_s else end_s
            next_off = k + 1
            heappush(heap, (end, seq, _D2H_END, k, engine))
            seq += 1
        prefetched = True
        while prefetched:
            prefetched = False
            k = next_pre
            if k < n_pre and h2d_free and pre_issue[k] <= last_done and off_finished[pre_offload[k]]:
                c = pre_copy[k]
                size = copy_size[c]
                if in_use + size <= budget:
                    engine = heappop(h2d_free)
                    if size:
                        in_use += size
                        mem_t.append(now)
                        mem_b.append(in_use)
                    end = now + pre_dur[k]
                    events.append(make(TraceEvent, ("h2d", "prefetch", k, now, end, "", copy_tensor[c], size,
                                                    engine, 0.0, 0.0)))
                    end_s = end if end > end_s else end_s
                    next_pre = k + 1
                    heappush(heap, (end, seq, _H2D_END, k, engine))
                    seq += 1
                    prefetched = True
            j = next_step
            if not step_running and j < n_steps:
                late = waits_on.get(j)
                if late is None or all(produced[c] for c in late):
                    size = step_alloc[j]
                    if in_use + size <= budget:
                        if late is None:
                            held_from = prev_end
                            wait_prefetch = 0.0
                        else:
                            inputs_ready = max([ready_s[c] for c in late])
                            held_from = prev_end if prev_end >= inputs_ready else inputs_ready
                            wait_prefetch = max(0.0, inputs_ready - prev_end)
                        wait_memory = now - held_from
                        stall_prefetch += wait_prefetch
                        stall_memory += wait_memory
                        if size:
                            in_use += size
                            mem_t.append(now)
                            mem_b.append(in_use)
                        end = now + step_dur[j]
                        step = steps[j]
                        recompute = step.kind == recompute_kind
                        kind_name = "recompute" if recompute else "run"
                        events.append(make(TraceEvent, ("compute", kind_name, j, now, end, step.op, "", size, 0,
                                                        wait_prefetch, wait_memory)))
                        compute_busy += end - now
                        if recompute:
                            recompute_busy += end - now
                        end_s = end if end > end_s else end_s
                        step_running = True
                        next_step = j + 1
                        heappush(heap, (end, seq, _COMPUTE_END, j, 0))
                        seq += 1
        if not heap:
            break
        # -- completions at the next instant, in creation order ----------------------------------
        now = heap[0][0]
        while heap and heap[0][0] == now:
            _, _, kind, index, engine = heappop(heap)
            if kind == _COMPUTE_END:
                step_running = False
                last_done = index
                prev_end = now
                for c in free_after.get(index, ()):
                    if offloads_left[c]:
                        readers_done[c] = True
                    else:
                        size = copy_size[c]
                        if size:
                            in_use -= size
                            mem_t.append(now)
                            mem_b.append(in_use)
                for c in step_writes[index]:
                    if last_reader[c] < 0:
                        if offloads_left[c]:
                            readers_done[c] = True  # freed when its offload completes
                        else:
                            size = copy_size[c]
                            if size:
                                in_use -= size
                                mem_t.append(now)
                                mem_b.append(in_use)
            elif kind == _D2H_END:
                off_finished[index] = True
                heappush(d2h_free, engine)
                for c in offload_waiters[index]:
                    offloads_left[c] -= 1
                    if readers_done[c] and not offloads_left[c]:
                        size = copy_size[c]
                        if size:
                            in_use -= size
                            mem_t.append(now)
                            mem_b.append(in_use)
            else:
                c = pre_copy[index]
                produced[c] = True
                ready_s[c] = now
                heappush(h2d_free, engine)
                if last_reader[c] < 0:
                    size = copy_size[c]
                    if size:
                        in_use -= size
                        mem_t.append(now)
                        mem_b.append(in_use)

    infeasibility = None
    if next_step < n_steps or next_off < n_off or next_pre < n_pre:
        # Nothing is in flight and work remains: name the first waiting request in plan order.
        if next_pre < n_pre and h2d_free and pre_issue[next_pre] <= last_done and off_finished[pre_offload[next_pre]]:
            c = pre_copy[next_pre]
            first_reader = s.prefetch_readers[next_pre][0]
            infeasibility = Infeasibility("prefetch", (copy_tensor[c],), first_reader, steps[first_reader].op,
                                          copy_size[c], in_use, budget_bytes, now)
        elif next_step < n_steps and not step_running and all(produced[c] for c in waits_on.get(next_step, ())):
            step = steps[next_step]
            infeasibility = Infeasibility("step", tuple(step.outputs), next_step, step.op, step_alloc[next_step],
                                          in_use, budget_bytes, now)
        else:
            raise SlackSwapError(
                f"simulator stalled at t={now} with no memory request pending (step {next_step}, "
                f"offload {next_off}, prefetch {next_pre}); validation should have rejected this plan"
            )
    d2h = [e for e in events if e.stream == "d2h"]
    h2d = [e for e in events if e.stream == "h2d"]
    return SimResult(
        planner=plan.planner,
        feasible=infeasibility is None,
        infeasible_reason=None if infeasibility is None else _reason(infeasibility),
        infeasibility=infeasibility,
        step_s=end_s if infeasibility is None else None,
        end_s=max(end_s, now),
        budget_bytes=budget_bytes,
        peak_activation_bytes=max(mem_b),
        events=tuple(events),
        memory_times_s=tuple(mem_t),
        memory_bytes=tuple(mem_b),
        compute_busy_s=compute_busy,
        recompute_s=recompute_busy,
        stall_prefetch_s=stall_prefetch,
        stall_memory_s=stall_memory,
        d2h_busy_s=_union_s(d2h),
        h2d_busy_s=_union_s(h2d),
        d2h_bytes=sum(e.size_bytes for e in d2h),
        h2d_bytes=sum(e.size_bytes for e in h2d),
        swapped_tensors=len(plan.tensors_with(Decision.SWAP)),
        recomputed_tensors=len(plan.tensors_with(Decision.RECOMPUTE)),
        bound_step_s=plan.bound_step_s,
    )


def _union_s(events: list[TraceEvent]) -> float:
    """Length of the union of the events' intervals (time at least one engine is busy)."""
    total = 0.0
    cur_start = cur_end = None
    for e in sorted(events, key=lambda e: e.start_s):
        if cur_end is None or e.start_s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = e.start_s, e.end_s
        else:
            cur_end = max(cur_end, e.end_s)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


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
