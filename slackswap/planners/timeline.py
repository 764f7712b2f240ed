"""A fast, analytical timeline of a plan: compute and copy-engine times, and device memory over time.

Why this exists: planners must try many candidate schedules (slackswap plans an 80-layer model in
under a second), so they cannot call the discrete-event simulator for each candidate. This module
replays a plan under the same rules the simulator follows (graph.py / plan.py docstrings) but
*without a budget*: nothing ever waits for memory. When the peak it reports is within the budget, the
simulator never has to make an allocation wait either, so the two agree; when it is above the budget,
the plan is rejected by the planner (a planner never hands over a plan it knows breaks the budget).

Rules replayed:
- one compute stream runs `plan.steps` in order; a step starts when the previous one ends and every
  prefetched input has arrived; it lasts its op's `duration_s` (a recompute step too);
- each direction's engines serve its transfer list in list order (FIFO); a transfer starts when its issuing
  step has finished, the previous transfer on that engine is done and, for a prefetch, the tensor's
  offload is done; it lasts `latency_s + bytes * engines / effective bandwidth`;
- a step reads the latest production of each input before it (its run step, a recompute step, or a
  prefetch issued after an earlier step);
- a step allocates its outputs when it starts, a prefetch when it starts; a copy is freed when its
  last reader has finished and, if it is offloaded, its offload has finished (a copy nobody reads is
  freed when its producer finishes). At equal times frees happen before allocations.
"""

from __future__ import annotations

from dataclasses import dataclass

from slackswap.errors import PlanValidationError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan, Transfer


def transfer_s(size_bytes: int, bytes_per_s: float, latency_s: float, engines: int = 1) -> float:
    """Time one copy occupies its engine: latency + bytes / (effective bandwidth / engines), since
    the engines of one direction share its bandwidth equally (as the simulator models them)."""
    return latency_s + size_bytes * engines / bytes_per_s


def d2h_s(size_bytes: int, hardware: Hardware) -> float:
    link = hardware.link
    return transfer_s(size_bytes, link.d2h_effective_bytes_per_s, link.latency_s, link.d2h_engines)


def h2d_s(size_bytes: int, hardware: Hardware) -> float:
    link = hardware.link
    return transfer_s(size_bytes, link.h2d_effective_bytes_per_s, link.latency_s, link.h2d_engines)


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


class _Engine:
    """A FIFO copy engine with `count` identical servers."""

    def __init__(self, count: int):
        self.free_at = [0.0] * count

    def start(self, ready_s: float, duration_s: float) -> tuple[float, float]:
        i = min(range(len(self.free_at)), key=self.free_at.__getitem__)
        start = max(ready_s, self.free_at[i])
        self.free_at[i] = start + duration_s
        return start, start + duration_s


def estimate_plan(graph: Graph, plan: Plan, hardware: Hardware) -> PlanTimeline:
    """Replay `plan` with no memory limit; see the module docstring for the rules."""
    link = hardware.link
    ops = graph.op_by_name
    sizes = {name: t.size_bytes for name, t in graph.tensors.items()}
    n_steps = len(plan.steps)
    offloads_by_issue = _by_issue(plan.offloads, n_steps, "offloads")
    prefetches_by_issue = _by_issue(plan.prefetches, n_steps, "prefetches")

    # Copies: parallel lists indexed by copy id.
    copy_size: list[int] = []
    copy_alloc: list[float | None] = []
    copy_produced_end: list[float | None] = []
    copy_last_read: list[float] = []
    copy_offload_end: list[float] = []
    prefetch_copy: dict[int, int] = {}  # prefetch index -> copy id
    copy_prefetch: dict[int, int] = {}  # copy id -> prefetch index
    latest: dict[str, int] = {}

    d2h = _Engine(link.d2h_engines)
    h2d = _Engine(link.h2d_engines)
    offload_end = [float("nan")] * len(plan.offloads)
    prefetch_start = [float("nan")] * len(plan.prefetches)
    prefetch_end = [float("nan")] * len(plan.prefetches)
    host_ready: dict[str, float] = {}  # tensor -> time its latest offload finished
    pending_offload_copy: dict[int, int] = {}  # offload index -> copy id
    next_d2h = 0
    next_h2d = 0
    step_end = [0.0] * n_steps
    step_start = [0.0] * n_steps

    def issue_time(issue_after_step: int) -> float:
        return 0.0 if issue_after_step < 0 else step_end[issue_after_step]

    def advance_engines(done_through: int) -> None:
        """Start every transfer whose issuing step (and FIFO predecessors) are done."""
        nonlocal next_d2h, next_h2d
        while next_d2h < len(plan.offloads) and plan.offloads[next_d2h].issue_after_step <= done_through:
            tr = plan.offloads[next_d2h]
            dur = d2h_s(sizes[tr.tensor], hardware)
            _, end = d2h.start(issue_time(tr.issue_after_step), dur)
            offload_end[next_d2h] = end
            copy_offload_end[pending_offload_copy[next_d2h]] = end
            host_ready[tr.tensor] = end
            next_d2h += 1
        while next_h2d < len(plan.prefetches) and plan.prefetches[next_h2d].issue_after_step <= done_through:
            tr = plan.prefetches[next_h2d]
            if tr.tensor not in host_ready:
                break  # its offload has not been started yet: FIFO blocks behind it
            dur = h2d_s(sizes[tr.tensor], hardware)
            ready = max(issue_time(tr.issue_after_step), host_ready[tr.tensor])
            start, end = h2d.start(ready, dur)
            prefetch_start[next_h2d], prefetch_end[next_h2d] = start, end
            cid = prefetch_copy[next_h2d]
            copy_alloc[cid] = start
            copy_produced_end[cid] = end
            next_h2d += 1

    def new_copy(size: int, alloc: float | None, produced_end: float | None) -> int:
        copy_size.append(size)
        copy_alloc.append(alloc)
        copy_produced_end.append(produced_end)
        copy_last_read.append(float("-inf"))
        copy_offload_end.append(float("-inf"))
        return len(copy_size) - 1

    def register_transfers(after_step: int) -> None:
        for j, tr in offloads_by_issue.get(after_step, ()):
            if tr.tensor not in latest:
                raise PlanValidationError(
                    f"offload of {tr.tensor!r} is issued after step {after_step} before any step produced it"
                )
            pending_offload_copy[j] = latest[tr.tensor]
        for j, tr in prefetches_by_issue.get(after_step, ()):
            cid = new_copy(sizes[tr.tensor], None, None)
            prefetch_copy[j] = cid
            copy_prefetch[cid] = j
            latest[tr.tensor] = cid

    register_transfers(-1)
    advance_engines(-1)
    now = 0.0
    stall = 0.0
    recompute = 0.0
    for i, step in enumerate(plan.steps):
        op = ops[step.op]
        ready = now
        read_copies = []
        for t in op.inputs:
            if t not in latest:
                raise PlanValidationError(f"step {i} ({step.op}) reads {t!r} before any copy of it exists")
            cid = latest[t]
            read_copies.append(cid)
            if cid in copy_prefetch:
                j = copy_prefetch[cid]
                if j >= next_h2d:
                    raise PlanValidationError(
                        f"step {i} ({step.op}) waits for the prefetch of {t!r}, which cannot start before it "
                        "(its offload or an earlier prefetch in the FIFO is issued later)"
                    )
                ready = max(ready, prefetch_end[j])
        stall += ready - now
        end = ready + op.duration_s
        if step.kind == "recompute":
            recompute += op.duration_s
        step_start[i], step_end[i] = ready, end
        for cid in read_copies:
            copy_last_read[cid] = max(copy_last_read[cid], end)
        for t in step.outputs:
            latest[t] = new_copy(sizes[t], ready, end)
        now = end
        register_transfers(i)
        advance_engines(i)
    if next_d2h < len(plan.offloads) or next_h2d < len(plan.prefetches):
        raise PlanValidationError("a transfer never starts: its FIFO predecessor or its offload is never issued")

    events: list[tuple[float, int]] = []
    for cid, size in enumerate(copy_size):
        alloc = copy_alloc[cid]
        produced_end = copy_produced_end[cid]
        assert alloc is not None and produced_end is not None
        last_read = copy_last_read[cid] if copy_last_read[cid] > float("-inf") else produced_end
        free = max(last_read, copy_offload_end[cid])
        events.append((alloc, size))
        events.append((free, -size))
    events.sort(key=lambda e: (e[0], e[1] > 0))
    current = peak = 0
    peak_time = 0.0
    for time_s, delta in events:
        current += delta
        if current > peak:
            peak, peak_time = current, time_s
    return PlanTimeline(
        step_s=now,
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


def _by_issue(transfers: tuple[Transfer, ...], n_steps: int, field: str) -> dict[int, list[tuple[int, Transfer]]]:
    out: dict[int, list[tuple[int, Transfer]]] = {}
    for j, tr in enumerate(transfers):
        if not -1 <= tr.issue_after_step < n_steps:
            raise PlanValidationError(
                f"{field}[{j}] ({tr.tensor}): issue_after_step={tr.issue_after_step} is outside [-1, {n_steps})"
            )
        out.setdefault(tr.issue_after_step, []).append((j, tr))
    return out
