"""Discrete-event execution of a validated plan: one compute stream, copy engines, a byte-exact budget.

The loop is a plain heapq of completion events over flat Python lists, not SimPy: a step of an
80-layer model has ~10^4 events and must simulate in well under a second, and SimPy's generator
processes cost several times more per event. tests/test_simulate_simpy.py checks this loop against
an independent SimPy model of the same semantics. The semantics are in docs/simulation.md; the
rules it shares with the planners' replay (copy resolution, transfer durations, the in-order engine
queue, the free rule) come from `slackswap.schedule`, so the two cannot drift.

Per time instant the loop first applies every completion at that time (frees, readiness), then
starts what can start ("settle"): offloads in FIFO order, then the memory requests that are ready
(the next compute step whose inputs are resident; the head prefetch once it is issued, its offload
is done and an engine is free), tried in plan order (step j has key (j, 0); a prefetch issued
after step i has key (i, 1, list index)); each one that fits is granted, one that does not waits
without holding back the others. If no event is left in flight while work remains, no waiting
request can ever be served: the run is infeasible, and the first of them in plan order is named.
"""

from __future__ import annotations

import heapq
import math

from slackswap.errors import ConfigError, SlackSwapError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan, StepKind
from slackswap.schedule.memory import is_freeable
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
    return _Run(graph, plan, hardware, budget_bytes, schedule).run()


#: The one transfer formula (slackswap.schedule.transfer), under the name this module exported.
transfer_duration_s = transfer_s


class _Run:
    """State of one simulation. Flat lists indexed by step / copy / transfer for speed."""

    def __init__(self, graph: Graph, plan: Plan, hardware: Hardware, budget_bytes: int | None, s: ResolvedSchedule):
        self.plan = plan
        self.budget_bytes = budget_bytes
        self.budget = math.inf if budget_bytes is None else budget_bytes
        ops = graph.op_by_name
        self.n_steps = len(plan.steps)
        self.step_dur = [ops[st.op].duration_s for st in plan.steps]
        self.step_reads = s.step_reads
        self.step_writes = s.step_writes
        self.copy_size = [c.size_bytes for c in s.copies]
        self.step_alloc = [sum(self.copy_size[c] for c in w) for w in s.step_writes]
        n_copies = len(s.copies)
        self.copy_tensor = [c.tensor for c in s.copies]
        self.copy_readers = [c.readers for c in s.copies]
        self.remaining = [len(c.readers) for c in s.copies]
        self.has_offload = [c.offload is not None for c in s.copies]
        self.offload_done = [False] * n_copies
        self.produced = [False] * n_copies
        self.freed = [False] * n_copies
        self.holds = [c.holds for c in s.copies]
        self.aliases_left = [0] * n_copies
        for held in self.holds:
            if held is not None:
                self.aliases_left[held] += 1
        self.ready_s = [0.0] * n_copies

        link = hardware.link
        self.d2h_engines = link.d2h_engines
        self.h2d_engines = link.h2d_engines
        self.off_copy = s.offload_copy
        self.off_issue = [t.issue_after_step for t in plan.offloads]
        self.off_dur = [d2h_s(b, hardware) for b in s.offload_bytes]
        self.off_bytes = s.offload_bytes
        self.pre_bytes = s.prefetch_bytes
        self.off_finished = [False] * len(plan.offloads)
        self.pre_copy = s.prefetch_copy
        self.pre_issue = [t.issue_after_step for t in plan.prefetches]
        self.pre_offload = s.prefetch_offload
        self.pre_dur = [h2d_s(b, hardware) for b in s.prefetch_bytes]

        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.in_use = 0
        self.mem_t: list[float] = [0.0]
        self.mem_b: list[int] = [0]
        self.events: list[TraceEvent] = []
        self.next_step = 0
        self.step_running = False
        self.last_done = -1  # highest finished step; steps finish in order
        self.prev_end = 0.0
        self.next_off = 0
        self.next_pre = 0
        self.d2h_free = list(range(self.d2h_engines))  # min-heaps of free engine ids
        self.h2d_free = list(range(self.h2d_engines))
        self.stall_prefetch = 0.0
        self.stall_memory = 0.0

    # -- memory ---------------------------------------------------------------------------------
    def _record(self, now: float) -> None:
        self.mem_t.append(now)
        self.mem_b.append(self.in_use)

    def _maybe_free(self, c: int, now: float) -> None:
        if not self.freed[c] and is_freeable(
            self.produced[c], self.remaining[c], self.has_offload[c] and not self.offload_done[c], self.aliases_left[c]
        ):
            self.freed[c] = True
            if self.copy_size[c]:
                self.in_use -= self.copy_size[c]
                self._record(now)
            held = self.holds[c]
            if held is not None:
                self.aliases_left[held] -= 1
                self._maybe_free(held, now)

    def _allocate(self, size: int, now: float) -> None:
        if size:
            self.in_use += size
            self._record(now)

    def _push(self, time: float, kind: int, index: int, engine: int) -> None:
        heapq.heappush(self.heap, (time, self.seq, kind, index, engine))
        self.seq += 1

    # -- completions ----------------------------------------------------------------------------
    def _finish(self, now: float, kind: int, index: int, engine: int) -> None:
        if kind == _COMPUTE_END:
            self.step_running = False
            self.last_done = index
            self.prev_end = now
            writes = self.step_writes[index]
            for c in writes:
                self.produced[c] = True
                self.ready_s[c] = now
            for c in self.step_reads[index]:
                self.remaining[c] -= 1
                self._maybe_free(c, now)
            for c in writes:
                self._maybe_free(c, now)
        elif kind == _D2H_END:
            c = self.off_copy[index]
            self.offload_done[c] = True
            self.off_finished[index] = True
            heapq.heappush(self.d2h_free, engine)
            self._maybe_free(c, now)
        else:
            c = self.pre_copy[index]
            self.produced[c] = True
            self.ready_s[c] = now
            heapq.heappush(self.h2d_free, engine)
            self._maybe_free(c, now)

    # -- starts -----------------------------------------------------------------------------------
    def _compute_request(self) -> tuple[tuple[int, int, int], int] | None:
        j = self.next_step
        if self.step_running or j >= self.n_steps:
            return None
        produced = self.produced
        for c in self.step_reads[j]:
            if not produced[c]:
                return None
        return (j, 0, 0), self.step_alloc[j]

    def _prefetch_request(self) -> tuple[tuple[int, int, int], int] | None:
        k = self.next_pre
        if k >= len(self.pre_copy) or not self.h2d_free:
            return None
        if self.pre_issue[k] > self.last_done or not self.off_finished[self.pre_offload[k]]:
            return None
        return (self.pre_issue[k], 1, k), self.copy_size[self.pre_copy[k]]

    def _start_step(self, now: float) -> None:
        j = self.next_step
        reads = self.step_reads[j]
        inputs_ready = max((self.ready_s[c] for c in reads), default=0.0)
        held_from = max(self.prev_end, inputs_ready)
        wait_prefetch = max(0.0, inputs_ready - self.prev_end)
        wait_memory = now - held_from
        self.stall_prefetch += wait_prefetch
        self.stall_memory += wait_memory
        self._allocate(self.step_alloc[j], now)
        end = now + self.step_dur[j]
        step = self.plan.steps[j]
        self.events.append(
            TraceEvent(
                "compute",
                str(step.kind),
                j,
                now,
                end,
                op=step.op,
                size_bytes=self.step_alloc[j],
                wait_prefetch_s=wait_prefetch,
                wait_memory_s=wait_memory,
            )
        )
        self.step_running = True
        self.next_step = j + 1
        self._push(end, _COMPUTE_END, j, 0)

    def _start_prefetch(self, now: float) -> None:
        k = self.next_pre
        c = self.pre_copy[k]
        engine = heapq.heappop(self.h2d_free)
        self._allocate(self.copy_size[c], now)
        end = now + self.pre_dur[k]
        self.events.append(
            TraceEvent(
                "h2d", "prefetch", k, now, end, tensor=self.copy_tensor[c], size_bytes=self.pre_bytes[k], engine=engine
            )
        )
        self.next_pre = k + 1
        self._push(end, _H2D_END, k, engine)

    def _settle(self, now: float) -> None:
        progress = True
        while progress:
            progress = False
            while (
                self.next_off < len(self.off_copy) and self.d2h_free and self.off_issue[self.next_off] <= self.last_done
            ):
                k = self.next_off
                c = self.off_copy[k]
                engine = heapq.heappop(self.d2h_free)
                end = now + self.off_dur[k]
                self.events.append(
                    TraceEvent(
                        "d2h",
                        "offload",
                        k,
                        now,
                        end,
                        tensor=self.copy_tensor[c],
                        size_bytes=self.off_bytes[k],
                        engine=engine,
                    )
                )
                self.next_off = k + 1
                self._push(end, _D2H_END, k, engine)
                progress = True
            requests = [r for r in (self._compute_request(), self._prefetch_request()) if r is not None]
            requests.sort()
            for key, size in requests:
                if self.in_use + size > self.budget:
                    continue  # this allocation waits; it does not hold back the other stream's
                if key[1] == 0:
                    self._start_step(now)
                else:
                    self._start_prefetch(now)
                progress = True

    # -- main loop --------------------------------------------------------------------------------
    def run(self) -> SimResult:
        now = 0.0
        self._settle(now)
        heap = self.heap
        while heap:
            now = heap[0][0]
            while heap and heap[0][0] == now:
                _, _, kind, index, engine = heapq.heappop(heap)
                self._finish(now, kind, index, engine)
            self._settle(now)
        done = (
            self.next_step == self.n_steps
            and self.next_off == len(self.off_copy)
            and self.next_pre == len(self.pre_copy)
        )
        infeasibility = None if done else self._deadlock(now)
        return self._result(now, infeasibility)

    def _deadlock(self, now: float) -> Infeasibility:
        requests = sorted(r for r in (self._compute_request(), self._prefetch_request()) if r is not None)
        if not requests:
            raise SlackSwapError(
                f"simulator stalled at t={now} with no memory request pending (step {self.next_step}, "
                f"offload {self.next_off}, prefetch {self.next_pre}); validation should have rejected this plan"
            )
        key, size = requests[0]
        if key[1] == 0:
            j = key[0]
            step = self.plan.steps[j]
            return Infeasibility("step", tuple(step.outputs), j, step.op, size, self.in_use, self.budget_bytes, now)
        c = self.pre_copy[key[2]]
        first_reader = self.copy_readers[c][0]
        return Infeasibility(
            "prefetch",
            (self.copy_tensor[c],),
            first_reader,
            self.plan.steps[first_reader].op,
            size,
            self.in_use,
            self.budget_bytes,
            now,
        )

    def _result(self, now: float, inf: Infeasibility | None) -> SimResult:
        events = self.events
        compute = [e for e in events if e.stream == "compute"]
        d2h = [e for e in events if e.stream == "d2h"]
        h2d = [e for e in events if e.stream == "h2d"]
        end_s = max((e.end_s for e in events), default=0.0)
        plan = self.plan
        reason = None if inf is None else _reason(inf)
        return SimResult(
            planner=plan.planner,
            feasible=inf is None,
            infeasible_reason=reason,
            infeasibility=inf,
            step_s=end_s if inf is None else None,
            end_s=max(end_s, now),
            budget_bytes=self.budget_bytes,
            peak_activation_bytes=max(self.mem_b),
            events=tuple(events),
            memory_times_s=tuple(self.mem_t),
            memory_bytes=tuple(self.mem_b),
            compute_busy_s=sum(e.end_s - e.start_s for e in compute),
            recompute_s=sum(e.end_s - e.start_s for e in compute if e.kind == StepKind.RECOMPUTE.value),
            stall_prefetch_s=self.stall_prefetch,
            stall_memory_s=self.stall_memory,
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
