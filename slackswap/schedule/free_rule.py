"""The free rule: when a device copy of a tensor gives its bytes back.

A copy is allocated when the step that produces it starts (a run or recompute step) or when its
prefetch starts. It is freed once four things hold: it has been produced (its step or prefetch
finished), every step that reads it has finished, its offload (if any) has finished, and every alias
copy that shares its storage (a view of it, the new version an in-place op wrote) has been freed.
A copy nobody reads is freed when its producer finishes. At one instant, frees happen before
allocations.

Which step and which offloads a copy waits for is resolved once per plan
(`slackswap.schedule.copies`: `copy_last_use`, `copy_wait_offloads`); the simulator's engine applies
the rule event by event from those facts, the replays compute the instant from them
(`free_time_s`).
"""

from __future__ import annotations


def free_time_s(
    produced_end_s: float,
    last_read_end_s: float | None,
    offload_end_s: float | None,
    aliases_freed_s: float | None = None,
) -> float:
    """The instant the free rule first holds, given when each of its conditions is met (None: never
    constrains: no reader, no offload, no alias).

    The latest of the given instants, compared as `max` compares (a later value replaces the one
    kept only if strictly greater); written out because the replay calls it once per copy."""
    free_s = produced_end_s
    if last_read_end_s is not None and last_read_end_s > free_s:
        free_s = last_read_end_s
    if offload_end_s is not None and offload_end_s > free_s:
        free_s = offload_end_s
    if aliases_freed_s is not None and aliases_freed_s > free_s:
        free_s = aliases_freed_s
    return free_s
