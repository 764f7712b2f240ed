"""Discrete-event execution of a validated plan: one compute stream, copy engines, a byte-exact budget.

The semantics are in docs/simulation.md. This is a list scheduler, not a general event queue: every
stream runs a list in a fixed order (the compute steps; each direction's transfers, FIFO), so at any
time at most one step and one transfer per engine are in flight, and what can start next is always
the head of a list. `_Run` holds one execution: the plan's tables as flat lists indexed by step,
copy and transfer, and the run's state over them (the heads of the lists as plain integers, the
running step's end and creation number, the few copies in flight in a tiny heapq), in `__slots__`.
`_Run.run` is the loop, one pass per time instant in three phases: settle (start the offloads, the
head prefetch and the next step that can start), the next instant (the running step's end or the
first copy's end), and that instant's completions in creation order. Each event it starts or
completes is one method: `_start_offloads`, `_start_prefetch` and `_issue_copy` (a transfer on a
free engine), `_start_step`, `_allocate`; `_offload_done`, `_prefetch_done`, `_step_done`, and the
free step `_free`. `_stalled` names what a stalled run waits for, `result` builds the SimResult.
What the run records per event is what it decides (start, end, a step's waits, a copy's engine),
stored by index into preallocated lists; `EventLog` makes TraceEvents of them on first use
(building one per event in the loop cost more than the scheduling). The busy time and bytes of each
copy direction are computed once after the loop from the recorded copy intervals (`_busy_s`).
The loop costs lookups and calls, not arithmetic: the phases are written in `run` with the names
they use bound to locals, the methods take the current time as an argument, and each is called
only once its cheap precondition holds (`benchmarks/bench_simulate.py` times this against the SimPy
peer).

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

A plan that names a tool offloader (`slackswap.schedule.offloader`) runs as `_ToolRun`: this loop with
`slackswap.simulate.tool_offload.ToolRules` (offload window, per-tensor pins) in front of `_Run`'s steps.

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
from slackswap.schedule.offloader import offloader_of
from slackswap.schedule.positions import plan_positions
from slackswap.schedule.transfer import d2h_s, h2d_s
from slackswap.schedule.validate import resolve_schedule
from slackswap.simulate.host_memory import host_peak_bytes
from slackswap.simulate.result import EventLog, Infeasibility, SimResult
from slackswap.simulate.tool_offload import ToolRules

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


def _execute(graph: Graph, plan: Plan, hardware: Hardware, budget_bytes: int | None, s: ResolvedSchedule) -> SimResult:
    """Run the resolved plan `s` to its end (or to the stall that makes it infeasible) and report it,
    its copies run as the plan's offloader runs them (`slackswap.simulate.tool_offload`)."""
    offloader = offloader_of(plan.notes)
    if offloader.is_ideal:
        run = _Run(graph, plan, hardware, budget_bytes, s)
    else:
        run = _ToolRun(graph, plan, hardware, budget_bytes, s, offloader)
    run.run()
    return run.result(plan, budget_bytes, s)


class _Run:
    """One execution: the plan's tables, indexed by step, copy and transfer, and the mutable state of
    the run over them, as slots (each attribute at a fixed offset, no instance dict to look it up in).
    `run` executes it once; `result` reports it."""

    __slots__ = (
        # The plan's tables, fixed for the run.
        "budget", "steps", "n_steps", "duration_of", "recompute_kind", "read_copies", "read_starts", "copy_size",
        "step_alloc", "last_use", "released_after", "offload_waiters", "late_steps", "late_copies",
        "n_off", "off_issue", "off_dur", "n_pre", "pre_copy", "pre_issue", "pre_offload", "pre_dur", "pre_code",
        # Where the run is: the time, the bytes in use, the heads of the lists, the running step.
        "now", "seq", "in_use", "next_step", "next_off", "next_pre", "next_late", "step_running", "step_end",
        "step_seq", "last_done", "prev_end",
        # Copies and transfers: the heap of copies in flight, the free engines, each copy's state.
        "transfers", "d2h_free", "h2d_free", "off_finished", "offloads_left", "readers_done", "produced", "ready_s",
        # What is recorded: the memory curve, the events as `EventLog` keeps them, the totals.
        "mem_t", "mem_b", "step_start", "step_stop", "step_wait_prefetch", "step_wait_memory",
        "off_start", "off_end", "off_engine", "pre_start", "pre_end", "pre_engine", "order",
        "stall_prefetch", "stall_memory", "compute_busy", "recompute_busy",
    )

    def __init__(self, graph: Graph, plan: Plan, hardware: Hardware, budget_bytes: int | None, s: ResolvedSchedule):
        self.budget = math.inf if budget_bytes is None else budget_bytes
        self.steps = steps = plan.steps
        self.n_steps = n_steps = len(steps)
        self.duration_of = graph.op_duration_s
        self.recompute_kind = StepKind.RECOMPUTE  # compared with ==: a plan may carry plain strings
        self.read_copies = s.read_copies
        self.read_starts = s.read_starts
        self.copy_size = s.copy_size
        n_copies = len(s.copy_size)
        self.step_alloc = s.step_alloc_bytes
        self.last_use = s.copy_last_use
        # When step j ends, the compute stream releases the copies it reads whose last use it is (found
        # from `last_use` as it ends), then `released_after[j]` (copies it does not read whose last use
        # it is, and its outputs nobody reads): each is freed, or marked to be freed by its offloads.
        # Per offload, the copies waiting for it (`offload_waiters`); per copy, the offloads still awaited.
        self.released_after = s.released_after
        self.offload_waiters = s.offload_waiters
        self.offloads_left = offloads_left = [0] * n_copies
        for waiting in s.offload_waiters:
            for c in waiting:
                offloads_left[c] += 1
        # The reads of prefetched copies (the only inputs that can be late), in step order, with a
        # sentinel step: the next step's are at `next_late` onwards, if any.
        self.late_steps = s.prefetched_read_steps + (n_steps,)
        self.late_copies = s.prefetched_read_copies
        self.next_late = 0
        self.produced = [False] * n_copies  # tracked for prefetched copies only
        self.ready_s = [0.0] * n_copies
        self.readers_done = [False] * n_copies  # producer and every reader have finished
        # Transfers, per direction, with a sentinel issuing step past the last one that no finished
        # step reaches. A prefetch's event code in `order` is `pre_code + k`, an offload's `n_steps + k`.
        self.n_off = n_off = len(s.offload_copy)
        self.off_issue = [t.issue_after_step for t in plan.offloads] + [n_steps]
        self.off_dur = [d2h_s(b, hardware) for b in s.offload_bytes]
        self.off_finished = [False] * n_off
        self.n_pre = n_pre = len(s.prefetch_copy)
        self.pre_copy = s.prefetch_copy
        self.pre_issue = [t.issue_after_step for t in plan.prefetches] + [n_steps]
        self.pre_offload = s.prefetch_offload
        self.pre_dur = [h2d_s(b, hardware) for b in s.prefetch_bytes]
        self.pre_code = n_steps + n_off
        # Heap of the copies in flight: (end, seq, stream, index, engine). The running step is kept
        # apart, with its end and creation number; `seq` numbers every event, steps included, so the
        # completions at one instant apply in creation order.
        self.transfers = []
        self.d2h_free = list(range(hardware.link.d2h_engines))  # min-heaps of free engine ids
        self.h2d_free = list(range(hardware.link.h2d_engines))
        self.now = 0.0
        self.seq = 0
        self.in_use = 0
        self.next_step = self.next_off = self.next_pre = 0
        self.step_running = False
        self.step_end = 0.0
        self.step_seq = 0
        self.last_done = -1  # highest finished step; steps finish in order
        self.prev_end = 0.0
        self.mem_t = [0.0]
        self.mem_b = [0]
        self.step_start = [0.0] * n_steps
        self.step_stop = [0.0] * n_steps
        self.step_wait_prefetch = [0.0] * n_steps
        self.step_wait_memory = [0.0] * n_steps
        self.off_start = [0.0] * n_off
        self.off_end = [0.0] * n_off
        self.off_engine = [0] * n_off
        self.pre_start = [0.0] * n_pre
        self.pre_end = [0.0] * n_pre
        self.pre_engine = [0] * n_pre
        self.order = []
        self.stall_prefetch = self.stall_memory = 0.0
        self.compute_busy = self.recompute_busy = 0.0

    def run(self) -> None:
        """The loop. Per instant: start everything that can start ("settle"), move to the next instant,
        apply every completion at it; until nothing is in flight (the run is complete, or stalled).

        The three phases are written here and call one method per event they start or complete, once
        its cheap precondition holds (a call that finds nothing to do would cost a call per instant);
        the names they use are bound to locals once."""
        transfers, n_steps = self.transfers, self.n_steps
        off_issue, d2h_free, pre_issue, h2d_free = self.off_issue, self.d2h_free, self.pre_issue, self.h2d_free
        start_offloads, start_prefetch, start_step = self._start_offloads, self._start_prefetch, self._start_step
        offload_done, prefetch_done, step_done = self._offload_done, self._prefetch_done, self._step_done
        now = 0.0
        while True:
            # -- settle: offloads first (nothing later in the settle can ready another one). Then, in plan
            # order, the head prefetch and the next step; only a started prefetch can make another request
            # ready (the next prefetch, on another free engine), so only then is the pair tried again.
            if d2h_free and off_issue[self.next_off] <= self.last_done:
                start_offloads(now)
            prefetched = True
            while prefetched:
                prefetched = False
                # A prefetch can start only on a free engine once its issuing step has finished.
                if h2d_free and pre_issue[self.next_pre] <= self.last_done:
                    prefetched = start_prefetch(now)
                if not self.step_running and self.next_step < n_steps:
                    start_step(now)
            # -- the next instant: the running step's end or the first copy's end, whichever is first.
            if self.step_running:
                now = self.step_end
                if transfers and transfers[0][0] < now:
                    now = transfers[0][0]
            elif transfers:
                now = transfers[0][0]
            else:
                self.now = now
                return
            # -- the completions at that instant, in creation order: the copies' ends come off the heap
            # in it, and the running step's end is applied when its creation number comes up.
            step_due = self.step_running and self.step_end == now
            while True:
                if transfers and transfers[0][0] == now and not (step_due and self.step_seq < transfers[0][1]):
                    _, _, stream, k, engine = heappop(transfers)
                    if stream == _D2H_END:
                        offload_done(k, engine, now)
                    else:
                        prefetch_done(k, engine, now)
                elif step_due:
                    step_due = False
                    step_done(now)
                else:
                    break

    # -- starting events ------------------------------------------------------------------------------

    def _start_offloads(self, now: float) -> None:
        """Issue, FIFO, every offload whose issuing step has finished while a d2h engine is free (an
        offload needs no device memory)."""
        off_issue, d2h_free = self.off_issue, self.d2h_free
        while off_issue[self.next_off] <= self.last_done and d2h_free:
            k = self.next_off
            self.next_off = k + 1
            end, engine = self._issue_copy(_D2H_END, k, now, self.off_dur[k], d2h_free, self.n_steps + k)
            self.off_start[k] = now
            self.off_end[k] = end
            self.off_engine[k] = engine

    def _start_prefetch(self, now: float) -> bool:
        """Issue the head prefetch, whose issuing step has finished, on a free h2d engine, if its offload
        has landed and its copy fits in the budget (if not, it waits without holding back the next step).
        Says whether it started."""
        k = self.next_pre
        if not self.off_finished[self.pre_offload[k]] or not self._allocate(self.copy_size[self.pre_copy[k]], now):
            return False
        self.next_pre = k + 1
        end, engine = self._issue_copy(_H2D_END, k, now, self.pre_dur[k], self.h2d_free, self.pre_code + k)
        self.pre_start[k] = now
        self.pre_end[k] = end
        self.pre_engine[k] = engine
        return True

    def _issue_copy(
        self, stream: int, k: int, now: float, duration_s: float, free_engines: list[int], code: int
    ) -> tuple[float, int]:
        """Put transfer `k` of `stream` on the lowest free engine at `now`: its end goes on the heap with
        the next creation number, its `code` into the start order. Returns its end and engine."""
        engine = heappop(free_engines)
        end = now + duration_s
        heappush(self.transfers, (end, self.seq, stream, k, engine))
        self.seq += 1
        self.order.append(code)
        return end, engine

    def _start_step(self, now: float) -> None:
        """Start the next step if the prefetched copies it reads have landed and its outputs fit (if
        not, it waits); record how long it was held after the previous step ended, first waiting for
        its inputs, then for memory."""
        j = self.next_step
        late_steps, next_late = self.late_steps, self.next_late
        if late_steps[next_late] == j:  # it reads prefetched copies: they must have landed
            late_stop = next_late + 1
            while late_steps[late_stop] == j:
                late_stop += 1
            late = self.late_copies[next_late:late_stop]
            produced = self.produced
            if not all(produced[c] for c in late):
                return
        else:
            late = None
        if not self._allocate(self.step_alloc[j], now):
            return
        prev_end = self.prev_end
        held_from = prev_end
        if late is not None:
            ready_s = self.ready_s
            inputs_ready = max([ready_s[c] for c in late])
            if inputs_ready > prev_end:
                held_from = inputs_ready
            wait_prefetch = max(0.0, inputs_ready - prev_end)
            self.stall_prefetch += wait_prefetch
            self.step_wait_prefetch[j] = wait_prefetch
            self.next_late = late_stop
        if now != held_from:  # it waited for memory (0.0 is already recorded)
            wait_memory = now - held_from
            self.stall_memory += wait_memory
            self.step_wait_memory[j] = wait_memory
        step = self.steps[j]
        end = now + self.duration_of[step.op]
        self.step_start[j] = now
        self.step_stop[j] = end
        self.order.append(j)
        if step.kind == self.recompute_kind:
            self.recompute_busy += end - now
        self.compute_busy += end - now
        self.step_running = True
        self.step_end = end
        self.step_seq = seq = self.seq
        self.seq = seq + 1
        self.next_step = j + 1

    def _allocate(self, size: int, now: float) -> bool:
        """Grant `size` bytes at `now` if they fit in the budget; the memory curve records the new total
        (a zero-byte request changes nothing). Says whether they were granted."""
        in_use = self.in_use + size
        if in_use > self.budget:
            return False
        if size:
            self.in_use = in_use
            self.mem_t.append(now)
            self.mem_b.append(in_use)
        return True

    # -- completing events ----------------------------------------------------------------------------

    def _offload_done(self, k: int, engine: int, now: float) -> None:
        """Offload `k` has landed on the host: its engine is free, its prefetch may start, and each copy
        that waited only for it (every reader done, no other offload pending) is freed."""
        self.off_finished[k] = True
        heappush(self.d2h_free, engine)
        offloads_left, readers_done = self.offloads_left, self.readers_done
        for c in self.offload_waiters[k]:
            offloads_left[c] -= 1
            if readers_done[c] and not offloads_left[c]:
                self._free(c, now)

    def _prefetch_done(self, k: int, engine: int, now: float) -> None:
        """Prefetch `k` has landed: its copy is resident (ready for its readers from `now`) and its
        engine free; a copy nobody reads is freed when it lands."""
        c = self.pre_copy[k]
        self.produced[c] = True
        self.ready_s[c] = now
        heappush(self.h2d_free, engine)
        if self.last_use[c] < 0:
            self._free(c, now)

    def _step_done(self, now: float) -> None:
        """The running step has ended: release the copies it reads whose last use it is, then the
        copies listed in `released_after` for it."""
        self.step_running = False
        j = self.last_done = self.next_step - 1
        self.prev_end = now
        last_use, offloads_left, free = self.last_use, self.offloads_left, self._free
        read_starts = self.read_starts
        for c in self.read_copies[read_starts[j]:read_starts[j + 1]]:
            if last_use[c] == j:
                if offloads_left[c]:
                    self.readers_done[c] = True  # freed when its offloads land
                else:
                    free(c, now)
        for c in self.released_after[j]:
            if offloads_left[c]:
                self.readers_done[c] = True
            else:
                free(c, now)

    def _free(self, c: int, now: float) -> None:
        """The free step: copy `c` gives its bytes back at `now`; the memory curve records the new total
        (a zero-byte copy, an alias, changes nothing)."""
        size = self.copy_size[c]
        if size:
            self.in_use = in_use = self.in_use - size
            self.mem_t.append(now)
            self.mem_b.append(in_use)

    # -- the result ---------------------------------------------------------------------------------

    def result(self, plan: Plan, budget_bytes: int | None, s: ResolvedSchedule) -> SimResult:
        """The SimResult of the finished run: its events as recorded, the memory curve, the totals, and
        why it stalled if work remains."""
        next_step, next_off, next_pre = self.next_step, self.next_off, self.next_pre
        infeasibility = None
        if next_step < self.n_steps or next_off < self.n_off or next_pre < self.n_pre:
            infeasibility = self._stalled(s, budget_bytes)
        off_start, off_end, pre_start, pre_end = self.off_start, self.off_end, self.pre_start, self.pre_end
        # The end of the last event: steps end in order, copies of a direction may not (several engines).
        end_s = max([self.step_stop[next_step - 1] if next_step else 0.0, *off_end[:next_off], *pre_end[:next_pre]])
        decided = Counter(plan.decisions.values())
        positions = plan_positions(plan, s)
        return SimResult(
            planner=plan.planner,
            feasible=infeasibility is None,
            infeasible_reason=None if infeasibility is None else _reason(infeasibility),
            infeasibility=infeasibility,
            step_s=end_s if infeasibility is None else None,
            end_s=max(end_s, self.now),
            budget_bytes=budget_bytes,
            peak_activation_bytes=max(self.mem_b),
            events=EventLog(
                steps=self.steps, step_bytes=self.step_alloc, step_start_s=self.step_start,
                step_end_s=self.step_stop, step_wait_prefetch_s=self.step_wait_prefetch,
                step_wait_memory_s=self.step_wait_memory, offloads=plan.offloads, offload_bytes=s.offload_bytes,
                offload_start_s=off_start, offload_end_s=off_end, offload_engine=self.off_engine,
                prefetches=plan.prefetches, prefetch_bytes=s.prefetch_bytes, prefetch_start_s=pre_start,
                prefetch_end_s=pre_end, prefetch_engine=self.pre_engine, order=self.order,
                step_wait_offload_s=getattr(self, "step_wait_offload", None),  # a _ToolRun's
            ),
            memory_times_s=tuple(self.mem_t),
            memory_bytes=tuple(self.mem_b),
            compute_busy_s=self.compute_busy,
            recompute_s=self.recompute_busy,
            stall_prefetch_s=self.stall_prefetch,
            stall_memory_s=self.stall_memory,
            d2h_busy_s=_busy_s(off_start[:next_off], off_end[:next_off]),
            h2d_busy_s=_busy_s(pre_start[:next_pre], pre_end[:next_pre]),
            d2h_bytes=sum(s.offload_bytes[:next_off]),
            h2d_bytes=sum(self.copy_size[self.pre_copy[k]] for k in range(next_pre)),
            host_peak_bytes=host_peak_bytes(positions, off_start, next_off, pre_end, next_pre, max(end_s, self.now)),
            host_pinned_bytes=positions.pinned_slab_bytes,
            swapped_tensors=decided[Decision.SWAP],
            recomputed_tensors=decided[Decision.RECOMPUTE],
            bound_step_s=plan.bound_step_s,
        )

    def _stalled(self, s: ResolvedSchedule, budget_bytes: int | None) -> Infeasibility:
        """Nothing is in flight and work remains: name the first waiting memory request in plan order
        (the head prefetch, if it is ready, else the next step if its inputs are there). Anything else
        means validation let a deadlocking plan through."""
        steps, copy_size, now, in_use = self.steps, self.copy_size, self.now, self.in_use
        next_step, next_pre = self.next_step, self.next_pre
        if (self.h2d_free and next_pre < self.n_pre and self.pre_issue[next_pre] <= self.last_done
                and self.off_finished[self.pre_offload[next_pre]]):
            c = self.pre_copy[next_pre]
            first_reader = s.prefetch_readers[next_pre][0]
            return Infeasibility("prefetch", (s.copy_tensor[c],), first_reader, steps[first_reader].op,
                                 copy_size[c], in_use, budget_bytes, now)
        if next_step < self.n_steps and not self.step_running and all(
            self.produced[c] for j, c in zip(self.late_steps, self.late_copies, strict=False) if j == next_step
        ):
            step = steps[next_step]
            return Infeasibility("step", tuple(step.outputs), next_step, step.op, self.step_alloc[next_step],
                                 in_use, budget_bytes, now)
        raise SlackSwapError(
            f"simulator stalled at t={now} with no memory request pending (step {next_step}, "
            f"offload {self.next_off}, prefetch {next_pre}); validation should have rejected this plan"
        )


class _ToolRun(ToolRules, _Run):
    """A run under a tool offloader (`slackswap.simulate.tool_offload`)."""

    __slots__ = ToolRules.SLOTS


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
