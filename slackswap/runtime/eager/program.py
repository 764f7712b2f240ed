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
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from slackswap.plan import Decision, Plan, StepKind
from slackswap.schedule.positions import PlanPositions

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
    #: The run copy this pack hands over (an offload or a recompute reads it), when this is the
    #: tensor's first pack; -1 otherwise.
    holds: int
    #: The offloads issued from the copy this pack hands over, at the pack, before `ops`: those whose
    #: position has passed (`_fold`).
    offloads: tuple[int, ...]
    #: The runtime holds the handed-over copy after the pack: a later operation or read uses it (a
    #: copy only offloaded at its pack is not held: autograd's forward has it until its last use, and
    #: an engine with transfers in flight holds the sources it reads).
    held: bool
    #: The operations that run at this pack, after `offloads`: offloads of the copy it hands over
    #: whose position has passed (when the copy is held), then those of the plan's actions due by the
    #: pack's position.
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
    #: (dtype, shape) of the copy this pack hands over, as the runtime holds it (`executor._whole`) when
    #: the pack is the recorded view: what the offloads issued from it move (None: it holds no copy).
    form: tuple[torch.dtype, torch.Size] | None = None


class UnpackEvent(NamedTuple):
    """The u-th read-back of the step: the tensor it must be (None: kept or not a graph tensor), the
    operations due before it (recomputes, prefetch issues, releases), the copy it reads (-1: none,
    autograd gets back what the pack returned) and whether it is that copy's last reader, which lets
    the copy go as it hands it over (the plan's release, folded in: `_fold`)."""

    name: str | None
    ops: tuple[tuple, ...]
    copy: int
    release: bool
    #: When every operation due is a prefetch (the common case), those prefetches as (offload it
    #: reads, whether it is that offload's last, the copy it makes), in order, and `ops` is empty: the
    #: unpack issues them itself, with no operation codes to test.
    prefetches: tuple[tuple[int, bool, int], ...] = ()


@dataclass(frozen=True)
class HookProgram:
    """Per pack k and per unpack u what a hook-only step needs, and the operations due after the
    last event (run when the step exits). `refusal`: why no hook-only step can run the plan (None:
    they can)."""

    packs: tuple[PackEvent, ...]
    unpacks: tuple[UnpackEvent, ...]
    tail: tuple[tuple, ...]
    refusal: str | None = None
    #: `_running_counts`, built with the program (`__post_init__`).
    _counts: tuple = field(init=False, repr=False, compare=False)

    def transfers(self, packs: int, unpacks: int, tail: bool) -> tuple[int, int]:
        """(offloads, prefetches) issued by the first `packs` packs, the first `unpacks` unpacks and,
        with `tail`, the tail: what a step that reached those events has issued, counted from the
        program (the hooks count nothing)."""
        pack_offloads, pack_prefetches = self._counts[0][packs]
        unpack_offloads, unpack_prefetches = self._counts[1][unpacks]
        tail_offloads, tail_prefetches = self._counts[2] if tail else (0, 0)
        return (pack_offloads + unpack_offloads + tail_offloads,
                pack_prefetches + unpack_prefetches + tail_prefetches)

    def __post_init__(self) -> None:
        # Built with the program (as the verified step exits), not by the first hook-only step that asks
        # for them inside its timed window (hf_gpt2_2l's slackswap plan at half its peak, 74 packs and 74
        # unpacks: 74 us).
        object.__setattr__(self, "_counts", self._running_counts())

    def _running_counts(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], tuple[int, int]]:
        """Running (offloads, prefetches) over the packs and over the unpacks (index n: the first n
        events), and the tail's."""
        def running(per_event) -> list[tuple[int, int]]:
            out = [(0, 0)]
            for offloads, prefetches in per_event:
                out.append((out[-1][0] + offloads, out[-1][1] + prefetches))
            return out

        packs = running((len(p.offloads) + _count(p.ops, OFFLOAD), _count(p.ops, PREFETCH)) for p in self.packs)
        unpacks = running((_count(u.ops, OFFLOAD), _count(u.ops, PREFETCH) + len(u.prefetches)) for u in self.unpacks)
        return packs, unpacks, (_count(self.tail, OFFLOAD), _count(self.tail, PREFETCH))


def _count(ops: tuple[tuple, ...], kind: int) -> int:
    return sum(op[0] == kind for op in ops)


def build_hook_program(
    recording, positions: PlanPositions, poll: bool, recompute_reads: dict[int, frozenset[str]],
    offload_devices: dict[int, torch.device],
) -> HookProgram:
    """`recording`: the verified step's `Recording`; `positions`: where the plan acts (the transfers
    after each step, the copies held and when they go, the prefetch that frees each host copy);
    `poll`: the copy engine needs a `poll` after the transfers of a step; `recompute_reads`: per
    recompute step, the graph tensors its recorded calls read; `offload_devices`: per offload, the
    device its source was on in the verified step. Which copy each read finds is resolved here, in
    event order, as the verified step found it."""
    plan, schedule = positions.plan, positions.schedule
    offloads_at, prefetches_at, release_after = positions.offloads_at, positions.prefetches_at, positions.release_after
    run_copy, held_copies = positions.run_copy, positions.held_copies
    # Step -1: the transfers the plan issues before its first step, due at the first event.
    action_steps = [-1, *positions.action_steps]
    actions = []
    for j in action_steps:
        ops: list[tuple] = []
        if j >= 0 and plan.steps[j].kind == StepKind.RECOMPUTE:
            ops.append((RECOMPUTE, j, recompute_reads.get(j, frozenset())))
        ops += [(OFFLOAD, k, schedule.offload_copy[k]) for k in offloads_at[j + 1]]
        for k in prefetches_at[j + 1]:
            offload = schedule.prefetch_offload[k]
            ops.append((PREFETCH, offload, positions.frees_host[k], schedule.prefetch_copy[k],
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
            dtype=r.dtype, shape=r.shape, name=r.name, holds=holds, offloads=(), held=holds >= 0, ops=ops,
            by_number=r.name is not None and r.decision != Decision.KEEP,
            reads_rng=k in recording.rng_events, stride=r.stride, offset=r.offset,
            whole=c >= 0 and _is_whole(r, schedule.copy_size[c]),
            form=_held_form(r, schedule.copy_size[c]) if holds >= 0 else None,
        ))
    unpacks = []
    for position, name in recording.unpacks:
        ops = placing.due(bisect_left(action_steps, position))
        unpacks.append(UnpackEvent(name, ops, -1 if name is None else placing.copy_of(name), False))
    tail = placing.due(len(actions))
    refusal = placing.refusal
    if placing.waiting:
        c = next(iter(placing.waiting))
        refusal = (f"the plan offloads the copy of {schedule.copies[c].tensor!r} that no saved-tensor hook hands "
                   "over before the offload's position: autograd does not save it")
    if refusal is None:
        packs, unpacks, tail = _fold(packs, unpacks, tail)
        unpacks = [_prefetches_apart(u) for u in unpacks]
    return HookProgram(tuple(packs), tuple(unpacks), tail, refusal)


def _prefetches_apart(event: UnpackEvent) -> UnpackEvent:
    """An unpack whose operations are all prefetches carries them as `prefetches` (its `ops` empty)."""
    if not event.ops or any(op[0] != PREFETCH for op in event.ops):
        return event
    return event._replace(ops=(), prefetches=tuple((op[1], op[2], op[3]) for op in event.ops))


def _fold(packs: list[PackEvent], unpacks: list[UnpackEvent], tail: tuple[tuple, ...]):
    """Fold the plan's operations on a copy into the events that hand it over and read it, where
    nothing else uses the copy in between: why, per saved tensor the hooks then do one dictionary
    operation less and run one operation tuple less, and an event left with no operation skips the
    loop (on a GPU the hooks' own code is what the CPU adds per saved tensor).

    - A run copy whose only uses are offloads at the pack that hands it over (no recompute reads it,
      no unpack reads it): the pack issues them from the tensor it is given (`PackEvent.offloads`)
      and does not hold the copy, so the plan's release of it goes (autograd's forward holds the
      tensor to its last use, the plan's release point, and a CUDA offload holds its source until
      the copy is done).
    - A copy's last reader, an unpack after which no recompute reads it and before the plan's
      release of it: the unpack lets it go as it hands it over (`UnpackEvent.release`), and the
      release goes (autograd holds what the unpack returns for as long as backward reads it).

    Events are in the order the hooks see them: the packs, then the unpacks, then the tail."""
    n_packs = len(packs)
    timeline = [ev.ops for ev in (*packs, *unpacks)] + [tail]
    recompute_reads: dict[int, int] = {}  # per copy: the last event index whose recompute reads it
    offload_events: dict[int, set[int]] = {}  # per copy: events holding an offload of it
    release_at: dict[int, int] = {}  # per copy: the event of its release
    for i, ops in enumerate(timeline):
        for op in ops:
            if op[0] == RECOMPUTE:
                for c in op[2].values():
                    recompute_reads[c] = i
            elif op[0] == OFFLOAD:
                offload_events.setdefault(op[2], set()).add(i)
            elif op[0] == RELEASE:
                release_at[op[1]] = i
    last_read = {}  # per copy: the last unpack (its event index) reading it
    for u, ev in enumerate(unpacks):
        if ev.copy >= 0:
            last_read[ev.copy] = n_packs + u
    dropped: set[int] = set()  # copies whose RELEASE op goes
    direct: dict[int, tuple[int, ...]] = {}  # pack index: offloads issued from its tensor
    for k, ev in enumerate(packs):
        c = ev.holds
        if (c < 0 or c in recompute_reads or c in last_read or offload_events.get(c, set()) != {k}
                or c not in release_at):
            continue
        direct[k] = tuple(op[1] for op in ev.ops if op[0] == OFFLOAD and op[2] == c)
        dropped.add(c)
    releasing: set[int] = set()  # unpack event indices that let their copy go
    for c, i in last_read.items():
        if c in dropped or c not in release_at or release_at[c] <= i or recompute_reads.get(c, -1) > i:
            continue
        releasing.add(i)
        dropped.add(c)

    def kept(ops: tuple[tuple, ...], k: int | None = None) -> tuple[tuple, ...]:
        c = packs[k].holds if k is not None and k in direct else None
        return tuple(op for op in ops if not (op[0] == RELEASE and op[1] in dropped)
                     and not (op[0] == OFFLOAD and op[2] == c))

    packs = [ev._replace(offloads=direct[k], held=False, ops=kept(ev.ops, k)) if k in direct
             else ev._replace(ops=kept(ev.ops)) for k, ev in enumerate(packs)]
    unpacks = [ev._replace(ops=kept(ev.ops), release=n_packs + u in releasing) for u, ev in enumerate(unpacks)]
    return packs, unpacks, kept(tail)


class _Placement:
    """Walks the plan's actions in event order: which operations run at each event, which copies
    are held (an offload whose source copy no event has handed over waits for the pack that does),
    and which copy of each tensor is current (what a read at that point finds)."""

    def __init__(self, actions: list[tuple[int, list[tuple]]], plan: Plan, schedule) -> None:
        self.actions, self.plan, self.schedule = actions, plan, schedule
        self.next = 0
        self.held_copies: set[int] = set()
        #: Per copy not yet held: the offloads waiting for it.
        self.waiting: dict[int, list[tuple]] = {}
        #: Per tensor: its current copy.
        self.current: dict[str, int] = {}
        self.refusal: str | None = None

    def hand_over(self, c: int, name: str | None) -> tuple[tuple, ...]:
        if c < 0:
            return ()
        self.held_copies.add(c)
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
                if kind == OFFLOAD and op[2] not in self.held_copies:
                    self.waiting.setdefault(op[2], []).append(op)
                    continue
                if kind == PREFETCH:
                    self.held_copies.add(op[3])
                    self.current[op[5]] = op[3]
                elif kind == RECOMPUTE:
                    op = (RECOMPUTE, j, {name: self.copy_of(name) for name in sorted(op[2])})
                    writes = self.schedule.step_writes[j]
                    self.held_copies.update(writes)
                    self.current.update(zip(self.plan.steps[j].outputs, writes, strict=True))
                elif kind == RELEASE:
                    self.held_copies.discard(op[1])
                out.append(op)
        self.next = max(self.next, until)
        return tuple(out)


def _held_form(record, storage_bytes: int) -> tuple[torch.dtype, torch.Size]:
    """(dtype, shape) of `executor._whole` of the recorded view of a storage of `storage_bytes`: the
    view itself when it is the whole storage, else the storage flat in the view's dtype, or as bytes."""
    if _is_whole(record, storage_bytes):
        return record.dtype, record.shape
    itemsize = record.dtype.itemsize
    if storage_bytes % itemsize == 0:
        return record.dtype, torch.Size((storage_bytes // itemsize,))
    return torch.uint8, torch.Size((storage_bytes,))


def _is_whole(record, storage_bytes: int) -> bool:
    """The pack's recorded view covers its tensor's storage (`storage_bytes`) exactly, contiguous from offset 0."""
    return (record.offset == 0 and record.shape.numel() * record.dtype.itemsize == storage_bytes
            and record.stride == torch.empty(record.shape, device="meta").stride())
