"""What a hook-only step does at each saved-tensor event, computed once from the verified step.

A hook-only step (docs/runtime.md, "Hook-only steps") runs on `saved_tensors_hooks` alone, so its
cost is that of the hooks: per pack and per unpack, one tuple read, one comparison of shape and
dtype, and the operations of the plan due at that event. Everything that does not change from step
to step is resolved here once: which of the plan's actions run at which event, in which order, on
which copies, including the offloads whose source no hook has handed over yet at their position
(moved to the pack that hands it over). The hooks then run a flat tuple of operations per event and
look nothing up: on a GPU the step stays bound by its kernels only while the CPU spends a few
microseconds per saved tensor.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import NamedTuple

import torch

from slackswap.plan import Decision, Plan, StepKind

#: Operation codes, the first field of each operation tuple (numbered by how often a step runs them:
#: the hooks test them in this order).
#: (RELEASE, a copy its last reader has finished with)
RELEASE = 0
#: (OFFLOAD, offload index, the copy it reads)
OFFLOAD = 1
#: (PREFETCH, the offload it reads, whether it is that offload's last prefetch (the host copy then
#: goes), the copy it makes, the device it goes to, its tensor)
PREFETCH = 2
#: (RECOMPUTE, plan step, {tensor the step reads: the copy it reads})
RECOMPUTE = 3
#: (POLL,): let an engine with transfers in flight release what has finished (`needs_poll`)
POLL = 4


class PackEvent(NamedTuple):
    """The k-th saved tensor of the step, as the pack hook reads it (one tuple unpacking per event)."""

    dtype: torch.dtype
    shape: torch.Size
    #: Graph tensor name (None: a weight or an input, returned as is).
    name: str | None
    #: The run copy the runtime holds from this pack on (an offload or a recompute reads it), when
    #: this is the tensor's first pack; -1 otherwise.
    holds: int
    #: The operations that run at this pack: offloads of the copy it hands over whose position has
    #: passed, then those of the plan's actions due by the pack's position.
    ops: tuple[tuple, ...]
    #: The tensor leaves autograd's hands (swap or recompute): the pack returns its number instead.
    by_number: bool
    #: The RNG state at this pack is what a recomputed random call drew from.
    reads_rng: bool
    stride: tuple[int, ...]
    offset: int
    #: The recorded view is exactly the tensor's storage (contiguous from offset 0): the runtime holds
    #: the packed tensor itself as the copy (`executor._whole`), no view of it to make.
    whole: bool


class UnpackEvent(NamedTuple):
    """The u-th read-back of the step: the tensor it must be (None: kept or not a graph tensor), the
    operations due before it (recomputes, prefetch issues, releases) and the copy it reads (-1: none,
    autograd gets back what the pack returned)."""

    name: str | None
    ops: tuple[tuple, ...]
    copy: int


@dataclass(frozen=True)
class HookProgram:
    """Per pack k and per unpack u what a hook-only step needs, and the operations due after the
    last event (run when the step exits). `refusal`: why no hook-only step can run the plan (None:
    they can)."""

    packs: tuple[PackEvent, ...]
    unpacks: tuple[UnpackEvent, ...]
    tail: tuple[tuple, ...]
    refusal: str | None = None


def build_hook_program(
    recording, plan: Plan, schedule, run_copy: dict[str, int], held_copies: set[int],
    release_after: dict[int, list[int]], offloads_at: list[list[int]], prefetches_at: list[list[int]],
    action_steps: list[int], poll: bool, recompute_reads: dict[int, frozenset[str]],
    offload_devices: dict[int, torch.device],
) -> HookProgram:
    """`recording`: the verified step's `Recording`; `poll`: the copy engine needs a `poll` after the
    transfers of a step; `recompute_reads`: per recompute step, the graph tensors its recorded calls
    read; `offload_devices`: per offload, the device its source was on in the verified step; the
    rest: the `PlanRun`'s schedule facts. Which copy each read finds is resolved here, in event
    order, as the verified step found it."""
    order = [k for j in action_steps for k in prefetches_at[j + 1]]  # prefetches in the order issued
    last_prefetch = {schedule.prefetch_offload[k]: k for k in order}
    # Step -1: the transfers the plan issues before its first step, due at the first event.
    action_steps = [-1, *action_steps]
    actions = []
    for j in action_steps:
        ops: list[tuple] = []
        if j >= 0 and plan.steps[j].kind == StepKind.RECOMPUTE:
            ops.append((RECOMPUTE, j, recompute_reads.get(j, frozenset())))
        ops += [(OFFLOAD, k, schedule.offload_copy[k]) for k in offloads_at[j + 1]]
        for k in prefetches_at[j + 1]:
            offload = schedule.prefetch_offload[k]
            ops.append((PREFETCH, offload, last_prefetch[offload] == k, schedule.prefetch_copy[k],
                        offload_devices[offload], plan.prefetches[k].tensor))
        if poll and (offloads_at[j + 1] or prefetches_at[j + 1]):
            ops.append((POLL,))
        ops += [(RELEASE, c) for c in release_after.get(j, ())]
        actions.append((j, ops))
    placing = _Placement(actions, plan, schedule)
    packs, first_seen = [], set()
    for k, r in enumerate(recording.packs):
        c = run_copy.get(r.name, -1) if r.name is not None else -1
        first = r.name is not None and r.name not in first_seen
        first_seen.add(r.name)
        holds = c if first and c in held_copies else -1
        ops = placing.hand_over(holds, r.name) + placing.due(bisect_left(action_steps, r.position))
        packs.append(PackEvent(
            dtype=r.dtype, shape=r.shape, name=r.name, holds=holds, ops=ops,
            by_number=r.name is not None and r.decision != Decision.KEEP,
            reads_rng=k in recording.rng_events, stride=r.stride, offset=r.offset,
            whole=c >= 0 and _is_whole(r, schedule.copy_size[c]),
        ))
    unpacks = []
    for position, name in recording.unpacks:
        ops = placing.due(bisect_left(action_steps, position))
        unpacks.append(UnpackEvent(name, ops, -1 if name is None else placing.copy_of(name)))
    tail = placing.due(len(actions))
    refusal = placing.refusal
    if placing.waiting:
        c = next(iter(placing.waiting))
        refusal = (f"the plan offloads the copy of {schedule.copies[c].tensor!r} that no saved-tensor hook hands "
                   "over before the offload's position: autograd does not save it")
    return HookProgram(tuple(packs), tuple(unpacks), tail, refusal)


class _Placement:
    """Walks the plan's actions in event order: which operations run at each event, which copies
    are held (an offload whose source copy no event has handed over waits for the pack that does),
    and which copy of each tensor is current (what a read at that point finds)."""

    def __init__(self, actions: list[tuple[int, list[tuple]]], plan: Plan, schedule) -> None:
        self.actions, self.plan, self.schedule = actions, plan, schedule
        self.next = 0
        self.held: set[int] = set()
        #: Per copy not yet held: the offloads waiting for it.
        self.waiting: dict[int, list[tuple]] = {}
        #: Per tensor: its current copy.
        self.current: dict[str, int] = {}
        self.refusal: str | None = None

    def hand_over(self, c: int, name: str | None) -> tuple[tuple, ...]:
        if c < 0:
            return ()
        self.held.add(c)
        self.current[name] = c
        return tuple(self.waiting.pop(c, ()))

    def copy_of(self, name: str) -> int:
        c = self.current.get(name)
        if c is None and self.refusal is None:
            self.refusal = f"tensor {name!r} is read with no copy of it held at that point in a hook-only step"
        return -1 if c is None else c

    def due(self, until: int) -> tuple[tuple, ...]:
        out: list[tuple] = []
        for j, ops in self.actions[self.next:until]:
            for op in ops:
                kind = op[0]
                if kind == OFFLOAD and op[2] not in self.held:
                    self.waiting.setdefault(op[2], []).append(op)
                    continue
                if kind == PREFETCH:
                    self.held.add(op[3])
                    self.current[op[5]] = op[3]
                elif kind == RECOMPUTE:
                    op = (RECOMPUTE, j, {name: self.copy_of(name) for name in sorted(op[2])})
                    writes = self.schedule.step_writes[j]
                    self.held.update(writes)
                    self.current.update(zip(self.plan.steps[j].outputs, writes, strict=True))
                elif kind == RELEASE:
                    self.held.discard(op[1])
                out.append(op)
        self.next = max(self.next, until)
        return tuple(out)


def _is_whole(record, storage_bytes: int) -> bool:
    """The pack's recorded view covers its tensor's storage (`storage_bytes`) exactly, contiguous from offset 0."""
    return (record.offset == 0 and record.shape.numel() * record.dtype.itemsize == storage_bytes
            and record.stride == torch.empty(record.shape, device="meta").stride())
