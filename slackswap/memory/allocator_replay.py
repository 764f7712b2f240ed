"""Replay one simulated step's allocations through the caching-allocator model.

The simulator grants memory byte-exactly against the budget (docs/simulation.md, section 4). A GPU
does not: every tensor is a block of PyTorch's caching allocator (`slackswap.memory.caching_allocator`),
rounded and placed in segments that fragment. The allocator never delays a kernel: it serves a
request at once or raises out-of-memory. So it changes no time of the simulated step, and this is a
pass over the step's own record, the same copies and the same free rule (`resolve_schedule`, whose
facts `slackswap.schedule.copies` computes once for every executor) and the same event times:

- a copy is allocated when its producer starts (a compute step, or a prefetch);
- it is freed when its producer, the step of its `last_use` (its last reader, or the last reader of
  a view still holding its storage, or the step the model's code holds it to) and every offload it
  waits for (its own and its aliases') have all finished;
- at one instant frees come before allocations (as in the engine), allocations in the engine's grant
  order (step j: (j, 0); prefetch k issued after step i: (i, 1, k)), a step's outputs in output
  order. A copy allocated and freed at the same instant (zero-duration op) is freed after it is
  allocated. This is the engine's order whenever ops take time (every profiled op does: it carries
  the launch overhead); with zero-duration ops the engine may interleave one instant's frees and
  allocations differently, and the replay's order within that instant is an approximation.

Two replays: one with no capacity (what `torch.cuda.memory_reserved` would peak at on a device with
room to spare) and one whose capacity is the activation budget, where a failed cudaMalloc first
releases the cached free segments, as PyTorch does, and a second failure is an out-of-memory error.
"""

from __future__ import annotations

from dataclasses import dataclass

from slackswap.graph import Graph
from slackswap.memory.caching_allocator import CachingAllocator, OutOfMemory
from slackswap.plan import Plan
from slackswap.schedule.validate import resolve_schedule
from slackswap.simulate.result import SimResult

_FREE_EARLIER, _ALLOC, _FREE_SAME_INSTANT = 0, 1, 2


@dataclass(frozen=True)
class MemoryOp:
    """One allocator call of the step: `size_bytes` > 0; `alloc` False is a free of that copy."""

    time_s: float
    alloc: bool
    copy: int
    tensor: str
    size_bytes: int


@dataclass(frozen=True)
class AllocatorReport:
    peak_allocated_bytes: int  # live bytes as requested (equals the simulator's peak)
    peak_reserved_bytes: int  # segments, with no capacity limit
    peak_block_bytes: int  # allocated blocks after rounding and unsplit slack
    fits: bool  # served within the capacity, releasing the cache when needed
    capacity_bytes: int | None
    oom_reason: str | None
    segments: int  # cudaMalloc calls with no capacity limit

    @property
    def fragmentation_share(self) -> float:
        """Share of the reserved peak that no live tensor uses at the activation peak: rounding,
        unsplit slack and cached free blocks. 0 when nothing was reserved."""
        if not self.peak_reserved_bytes:
            return 0.0
        return 1.0 - self.peak_allocated_bytes / self.peak_reserved_bytes

    def metrics(self) -> dict[str, object]:
        """The `allocator` group of `slackswap.metrics_table` (a run never replayed has them None)."""
        return {
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_block_bytes": self.peak_block_bytes,
            "fragmentation_share": self.fragmentation_share,
            "fits_reserved": self.fits,
            "allocator_oom_reason": self.oom_reason,
            "allocator_segments": self.segments,
        }


def memory_ops(graph: Graph, plan: Plan, result: SimResult) -> list[MemoryOp]:
    """The step's allocations and frees in the order the engine applied them (see the module doc)."""
    s = resolve_schedule(graph, plan)
    step_span: dict[int, tuple[float, float]] = {}
    pre_span: dict[int, tuple[float, float]] = {}
    off_end: dict[int, float] = {}
    for e in result.events:
        if e.stream == "compute":
            step_span[e.index] = (e.start_s, e.end_s)
        elif e.stream == "h2d":
            pre_span[e.index] = (e.start_s, e.end_s)
        else:
            off_end[e.index] = e.end_s
    keyed: list[tuple[tuple, MemoryOp]] = []
    for c, copy in enumerate(s.copies):
        if not copy.size_bytes:
            continue
        if copy.source == "prefetch":
            span = pre_span.get(copy.source_index)
            key = (plan.prefetches[copy.source_index].issue_after_step, 1, copy.source_index)
        else:
            span = step_span.get(copy.source_index)
            key = (copy.source_index, 0, c - s.write_starts[copy.source_index])
        if span is None:
            continue  # never allocated (the step deadlocked before it)
        start, end = span
        keyed.append(((start, _ALLOC, key, c), MemoryOp(start, True, c, copy.tensor, copy.size_bytes)))
        ends = [end]
        if copy.last_use >= 0:
            ends.append(step_span[copy.last_use][1] if copy.last_use in step_span else None)
        ends.extend(off_end.get(k) for k in copy.wait_offloads)
        if any(t is None for t in ends):
            continue  # still live when the run ended
        free_t = max(ends)
        phase = _FREE_SAME_INSTANT if free_t == start else _FREE_EARLIER
        keyed.append(((free_t, phase, (), c), MemoryOp(free_t, False, c, copy.tensor, copy.size_bytes)))
    keyed.sort(key=lambda item: item[0])
    return [op for _, op in keyed]


def replay(
    ops: list[MemoryOp], capacity_bytes: int | None
) -> tuple[CachingAllocator, OutOfMemory | None, MemoryOp | None]:
    """Run `ops` through a fresh allocator. Stops at the first out-of-memory error (a GPU would)."""
    allocator = CachingAllocator(capacity_bytes)
    blocks = {}
    for op in ops:
        if op.alloc:
            try:
                blocks[op.copy] = allocator.malloc(op.size_bytes)
            except OutOfMemory as exc:
                return allocator, exc, op
        else:
            allocator.free(blocks.pop(op.copy))
    return allocator, None, None


def allocator_report(graph: Graph, plan: Plan, result: SimResult, capacity_bytes: int | None) -> AllocatorReport:
    ops = memory_ops(graph, plan, result)
    live = peak = 0
    for op in ops:
        live += op.size_bytes if op.alloc else -op.size_bytes
        peak = max(peak, live)
    free_run, _, _ = replay(ops, None)
    oom_reason = None
    if capacity_bytes is not None:
        _, oom, at = replay(ops, capacity_bytes)
        if oom is not None:
            oom_reason = f"tensor {at.tensor!r} at t={at.time_s:.6g} s: {oom}"
    return AllocatorReport(
        peak_allocated_bytes=peak,
        peak_reserved_bytes=free_run.peak_reserved_bytes,
        peak_block_bytes=free_run.peak_allocated_bytes,
        fits=oom_reason is None,
        capacity_bytes=capacity_bytes,
        oom_reason=oom_reason,
        segments=free_run.cuda_mallocs,
    )
