"""What a hook-only step does at each saved-tensor event, computed once from the verified step.

A hook-only step (docs/runtime.md, "Hook-only steps") runs on `saved_tensors_hooks` alone, so its
cost is that of the hooks: per pack and per unpack, one tuple read, one comparison of shape and
dtype, and the plan's actions due at that event. Everything that does not change from step to step
is read here once, into one tuple per event (pack k, unpack u) and per action, instead of being
looked up in dictionaries of records on every event: on a GPU the step stays bound by its kernels
only while the CPU spends a few microseconds per saved tensor.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import NamedTuple

import torch

from slackswap.plan import Decision, Plan, StepKind


class Action(NamedTuple):
    """What the plan does at the end of one of its steps, resolved to copy ids (a tuple: the
    hook-only step unpacks it in its loop)."""

    step: int
    recompute: bool
    #: (offload index, the copy it reads).
    offloads: tuple[tuple[int, int], ...]
    #: (the offload it reads, whether it is that offload's last prefetch (the runtime then lets the
    #: host copy go), the copy it makes, its tensor).
    prefetches: tuple[tuple[int, bool, int, str], ...]
    #: Copies the plan's last reader has finished with.
    releases: tuple[int, ...]


class PackEvent(NamedTuple):
    """The k-th saved tensor of the step, as the pack hook reads it (one tuple unpacking per event)."""

    dtype: torch.dtype
    shape: torch.Size
    #: Graph tensor name (None: a weight or an input, returned as is).
    name: str | None
    #: The run copy the runtime holds from this pack on (an offload or a recompute reads it), when
    #: this is the tensor's first pack; -1 otherwise.
    holds: int
    #: How many actions are due by then (those of the plan steps before its position).
    due: int
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
    """The u-th read-back of the step: the tensor it must be (None: kept or not a graph tensor)."""

    name: str | None
    due: int


@dataclass(frozen=True)
class HookProgram:
    """Per pack k, per unpack u and per action, what a hook-only step needs."""

    packs: tuple[PackEvent, ...]
    unpacks: tuple[UnpackEvent, ...]
    actions: tuple[Action, ...]


def build_hook_program(
    recording, plan: Plan, schedule, run_copy: dict[str, int], held_copies: set[int],
    release_after: dict[int, list[int]], offloads_at: list[list[int]], prefetches_at: list[list[int]],
    action_steps: list[int],
) -> HookProgram:
    """`recording`: the verified step's `Recording`; the rest: the `PlanRun`'s schedule facts."""
    keep = Decision.KEEP
    order = [k for j in action_steps for k in prefetches_at[j + 1]]  # prefetches in the order issued
    last_prefetch = {schedule.prefetch_offload[k]: k for k in order}
    actions = tuple(
        Action(
            step=j,
            recompute=plan.steps[j].kind == StepKind.RECOMPUTE,
            offloads=tuple((k, schedule.offload_copy[k]) for k in offloads_at[j + 1]),
            prefetches=tuple((schedule.prefetch_offload[k], last_prefetch[schedule.prefetch_offload[k]] == k,
                              schedule.prefetch_copy[k], plan.prefetches[k].tensor) for k in prefetches_at[j + 1]),
            releases=tuple(release_after.get(j, ())),
        )
        for j in action_steps
    )
    packs, first_seen = [], set()
    for k, r in enumerate(recording.packs):
        c = run_copy.get(r.name, -1) if r.name is not None else -1
        first = r.name is not None and r.name not in first_seen
        first_seen.add(r.name)
        packs.append(PackEvent(
            dtype=r.dtype, shape=r.shape, name=r.name,
            holds=c if first and c in held_copies else -1,
            due=bisect_left(action_steps, r.position),
            by_number=r.name is not None and r.decision != keep,
            reads_rng=k in recording.rng_events,
            stride=r.stride, offset=r.offset,
            whole=c >= 0 and _is_whole(r, schedule.copy_size[c]),
        ))
    unpacks = tuple(UnpackEvent(name, bisect_left(action_steps, position)) for position, name in recording.unpacks)
    return HookProgram(tuple(packs), unpacks, actions)


def _is_whole(record, storage_bytes: int) -> bool:
    """The pack's recorded view covers its tensor's storage (`storage_bytes`) exactly, contiguous from offset 0."""
    return (record.offset == 0 and record.shape.numel() * record.dtype.itemsize == storage_bytes
            and record.stride == torch.empty(record.shape, device="meta").stride())
