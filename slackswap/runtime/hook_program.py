"""What a hook-only step does at each saved-tensor event, computed once from the verified step.

A hook-only step (docs/runtime.md, "Hook-only steps") runs on `saved_tensors_hooks` alone, so its
cost is that of the hooks: per pack and per unpack, a few list reads, one comparison of shape and
dtype, and the plan's actions due at that event. Everything that does not change from step to step
is read here once, into flat tuples indexed by the event's number (pack k, unpack u) or by the
action's rank, instead of being looked up in dictionaries of records on every event: on a GPU the
step stays bound by its kernels only while the CPU spends a few microseconds per saved tensor.
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
    #: (prefetch index, the offload it reads, the copy it makes, its tensor).
    prefetches: tuple[tuple[int, int, int, str], ...]
    #: Copies the plan's last reader has finished with.
    releases: tuple[int, ...]


@dataclass(frozen=True)
class HookProgram:
    """Per pack k (`pack_*`), per unpack u (`unpack_*`) and per action, what a hook-only step needs."""

    pack_shape: tuple[torch.Size, ...]
    pack_dtype: tuple[torch.dtype, ...]
    pack_stride: tuple[tuple[int, ...], ...]
    pack_offset: tuple[int, ...]
    #: Graph tensor name (None: a weight or an input, returned as is).
    pack_name: tuple[str | None, ...]
    #: The tensor leaves autograd's hands (swap or recompute): the pack returns its number instead.
    pack_by_number: tuple[bool, ...]
    #: The RNG state at this pack is what a recomputed random call drew from.
    pack_reads_rng: tuple[bool, ...]
    #: Per graph tensor name: its run copy, and whether the runtime holds that copy (an offload
    #: or a recompute reads it).
    run_copy: dict[str, tuple[int, bool]]
    unpack_name: tuple[str | None, ...]
    actions: tuple[Action, ...]
    #: Per pack and per unpack: how many actions are due by then (those of steps before its
    #: position), so an event compares one number to know whether the plan acts.
    pack_actions_due: tuple[int, ...]
    unpack_actions_due: tuple[int, ...]


def build_hook_program(
    recording, plan: Plan, schedule, run_copy: dict[str, int], held_copies: set[int],
    release_after: dict[int, list[int]], offloads_at: list[list[int]], prefetches_at: list[list[int]],
    action_steps: list[int],
) -> HookProgram:
    """`recording`: the verified step's `Recording`; the rest: the `PlanRun`'s schedule facts."""
    packs = recording.packs
    keep = Decision.KEEP
    actions = tuple(
        Action(
            step=j,
            recompute=plan.steps[j].kind == StepKind.RECOMPUTE,
            offloads=tuple((k, schedule.offload_copy[k]) for k in offloads_at[j + 1]),
            prefetches=tuple((k, schedule.prefetch_offload[k], schedule.prefetch_copy[k], plan.prefetches[k].tensor)
                             for k in prefetches_at[j + 1]),
            releases=tuple(release_after.get(j, ())),
        )
        for j in action_steps
    )
    return HookProgram(
        pack_shape=tuple(r.shape for r in packs),
        pack_dtype=tuple(r.dtype for r in packs),
        pack_stride=tuple(r.stride for r in packs),
        pack_offset=tuple(r.offset for r in packs),
        pack_name=tuple(r.name for r in packs),
        pack_by_number=tuple(r.name is not None and r.decision != keep for r in packs),
        pack_reads_rng=tuple(k in recording.rng_events for k in range(len(packs))),
        run_copy={name: (c, c in held_copies) for name, c in run_copy.items()},
        unpack_name=tuple(name for _, name in recording.unpacks),
        actions=actions,
        pack_actions_due=tuple(bisect_left(action_steps, r.position) for r in packs),
        unpack_actions_due=tuple(bisect_left(action_steps, position) for position, _ in recording.unpacks),
    )
