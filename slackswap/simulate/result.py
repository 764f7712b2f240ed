"""What a simulated step produced: events on each stream, memory over time, and the totals.

Plain frozen dataclasses so results compare by value (the determinism tests rely on `==`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple, overload

from slackswap.plan import ComputeStep, StepKind, Transfer

STREAMS: tuple[str, ...] = ("compute", "d2h", "h2d")


class TraceEvent(NamedTuple):
    """One busy interval of one stream.

    A typed NamedTuple rather than a frozen dataclass: a step makes one per event (thousands), and a
    NamedTuple is as immutable and compares by value too, but costs a sixth of the time to build.

    Compute events: `kind` is "run" or "recompute", `index` the step index, `op` the op,
    `size_bytes` the bytes allocated when the step started, and the two waits say how long the step
    was held after the previous step finished (waiting for an input's prefetch, then for memory);
    `wait_offload_s` is the part held for offloads still in flight, under an offloader that makes the
    compute stream wait for them (`slackswap.schedule.offloader`; 0 under the ideal one).
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
    wait_offload_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class EventLog(Sequence[TraceEvent]):
    """The events of one run: a read-only sequence of `TraceEvent` in the order they started, kept as the
    engine recorded them (a few numbers per event, by stream) and turned into TraceEvents on first use.

    Why: building an 11-field NamedTuple per event was the largest single cost of the engine's loop
    (more than the scheduling itself, with the cyclic GC's passes over thousands of new tuples), and
    many results are read only for their totals (the keep-all ideal of every job, a planner's check).
    What the engine records is the part of each event that the run decides: when it started and
    ended, a step's waits, a copy's engine. The rest (op, kind, tensor, bytes) is the plan's, read from
    it when the events are built. Compares and hashes by its events.
    """

    __slots__ = ("_columns", "_order", "_events")

    def __init__(
        self,
        *,
        steps: Sequence[ComputeStep],
        step_bytes: Sequence[int],
        step_start_s: Sequence[float],
        step_end_s: Sequence[float],
        step_wait_prefetch_s: Sequence[float],
        step_wait_memory_s: Sequence[float],
        offloads: Sequence[Transfer],
        offload_bytes: Sequence[int],
        offload_start_s: Sequence[float],
        offload_end_s: Sequence[float],
        offload_engine: Sequence[int],
        prefetches: Sequence[Transfer],
        prefetch_bytes: Sequence[int],
        prefetch_start_s: Sequence[float],
        prefetch_end_s: Sequence[float],
        prefetch_engine: Sequence[int],
        order: Sequence[int],
        step_wait_offload_s: Sequence[float] | None = None,
    ):
        """Columns are indexed by step / offload / prefetch index (entries of what never started are
        not read); `order` lists the events as they started, step j as j, offload k as
        len(steps) + k, prefetch k as len(steps) + len(offloads) + k."""
        self._columns = (
            steps, step_bytes, step_start_s, step_end_s, step_wait_prefetch_s, step_wait_memory_s,
            offloads, offload_bytes, offload_start_s, offload_end_s, offload_engine,
            prefetches, prefetch_bytes, prefetch_start_s, prefetch_end_s, prefetch_engine, step_wait_offload_s,
        )
        self._order = order
        self._events: tuple[TraceEvent, ...] | None = None

    def _built(self) -> tuple[TraceEvent, ...]:
        if self._events is None:
            (steps, step_bytes, step_start, step_end, wait_prefetch, wait_memory,
             offloads, offload_bytes, offload_start, offload_end, offload_engine,
             prefetches, prefetch_bytes, prefetch_start, prefetch_end, prefetch_engine, wait_offload) = self._columns
            recompute = StepKind.RECOMPUTE  # compared with ==: a plan may carry plain strings
            make = tuple.__new__  # TraceEvent is a NamedTuple: built without its Python-level __new__
            events = list(map(make, repeat(TraceEvent), zip(
                repeat("compute"), ["recompute" if st.kind == recompute else "run" for st in steps],
                range(len(steps)), step_start, step_end, [st.op for st in steps], repeat(""), step_bytes,
                repeat(0), wait_prefetch, wait_memory, repeat(0.0) if wait_offload is None else wait_offload,
            )))
            events += map(make, repeat(TraceEvent), zip(
                repeat("d2h"), repeat("offload"), range(len(offloads)), offload_start, offload_end, repeat(""),
                [t.tensor for t in offloads], offload_bytes, offload_engine, repeat(0.0), repeat(0.0), repeat(0.0),
            ))
            events += map(make, repeat(TraceEvent), zip(
                repeat("h2d"), repeat("prefetch"), range(len(prefetches)), prefetch_start, prefetch_end, repeat(""),
                [t.tensor for t in prefetches], prefetch_bytes, prefetch_engine, repeat(0.0), repeat(0.0), repeat(0.0),
            ))
            self._events = tuple(map(events.__getitem__, self._order))
        return self._events

    def __len__(self) -> int:
        return len(self._order)

    @overload
    def __getitem__(self, index: int) -> TraceEvent: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[TraceEvent, ...]: ...

    def __getitem__(self, index):
        return self._built()[index]

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self._built())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EventLog):
            return self._built() == other._built()
        if isinstance(other, tuple):
            return self._built() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._built())

    def __repr__(self) -> str:
        return f"EventLog({list(self._built())!r})"


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
    #: All busy intervals, in the order they started (so by start time within each stream).
    events: EventLog
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
    #: The most pinned host bytes live at once: host copies from their offload's start to the end of
    #: the prefetch that frees them (`slackswap.simulate.host_memory`).
    host_peak_bytes: int
    #: The pinned host bytes the runtime holds for the plan (`PlanPositions.pinned_slab_bytes`: a
    #: buffer per offload); what the node's pinned check reads.
    host_pinned_bytes: int
    swapped_tensors: int
    recomputed_tensors: int
    bound_step_s: float | None = None
    #: The offloader the plan's copies were priced as (`slackswap.schedule.offloader`).
    offloader: str = "ideal"
    #: Compute idle time waiting for offloads in flight (only under a tool offloader that waits for them).
    stall_offload_s: float = 0.0
    #: Host time spent pinning a buffer per offload, inside the compute steps that issue them
    #: (counted in `compute_busy_s`; only under a tool offloader that pins per tensor).
    pin_s: float = 0.0

    @property
    def stall_s(self) -> float:
        """Time the compute stream was idle between steps (prefetch, offload and memory waits)."""
        return self.stall_prefetch_s + self.stall_memory_s + self.stall_offload_s

    def stream_events(self, stream: str) -> tuple[TraceEvent, ...]:
        return tuple(e for e in self.events if e.stream == stream)
