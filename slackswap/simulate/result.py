"""What a simulated step produced: events on each stream, memory over time, and the totals.

Plain frozen dataclasses so results compare by value (the determinism tests rely on `==`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

STREAMS: tuple[str, ...] = ("compute", "d2h", "h2d")


class TraceEvent(NamedTuple):
    """One busy interval of one stream.

    A typed NamedTuple rather than a frozen dataclass: a step makes one per event (thousands), and a
    NamedTuple is as immutable and compares by value too, but costs a sixth of the time to build.

    Compute events: `kind` is "run" or "recompute", `index` the step index, `op` the op,
    `size_bytes` the bytes allocated when the step started, and the two waits say how long the step
    was held after the previous step finished (waiting for an input's prefetch, then for memory).
    Transfer events: `kind` is "offload" (stream d2h) or "prefetch" (stream h2d), `index` the index
    into `plan.offloads` / `plan.prefetches`, `tensor` and `size_bytes` what was moved.
    """

    stream: str
    kind: str
    index: int
    start_s: float
    end_s: float
    op: str = ""
    tensor: str = ""
    size_bytes: int = 0
    engine: int = 0
    wait_prefetch_s: float = 0.0
    wait_memory_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Infeasibility:
    """The allocation that could never be served: nothing in flight could free room for it."""

    #: "step" (a compute step's outputs) or "prefetch".
    request: str
    tensors: tuple[str, ...]
    #: The step that allocates (request "step") or the first step that reads the prefetched copy.
    step: int
    op: str
    needed_bytes: int
    in_use_bytes: int
    budget_bytes: int
    time_s: float


@dataclass(frozen=True)
class SimResult:
    planner: str
    feasible: bool
    #: None when feasible; otherwise a sentence naming tensor, op (step index), bytes needed, in use, budget.
    infeasible_reason: str | None
    infeasibility: Infeasibility | None
    #: End of the last event (the training step's duration); None when infeasible.
    step_s: float | None
    #: Time the simulation reached (the deadlock time when infeasible).
    end_s: float
    budget_bytes: int | None
    peak_activation_bytes: int
    #: All busy intervals, ordered by start time within each stream.
    events: tuple[TraceEvent, ...]
    #: Device activation bytes after every change, in time order (several samples may share a time).
    memory_times_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]
    compute_busy_s: float
    recompute_s: float
    stall_prefetch_s: float
    stall_memory_s: float
    #: Time during which at least one engine of that direction was busy.
    d2h_busy_s: float
    h2d_busy_s: float
    d2h_bytes: int
    h2d_bytes: int
    swapped_tensors: int
    recomputed_tensors: int
    bound_step_s: float | None = None

    @property
    def stall_s(self) -> float:
        """Time the compute stream was idle between steps (prefetch waits + memory waits)."""
        return self.stall_prefetch_s + self.stall_memory_s

    def stream_events(self, stream: str) -> tuple[TraceEvent, ...]:
        return tuple(e for e in self.events if e.stream == stream)
