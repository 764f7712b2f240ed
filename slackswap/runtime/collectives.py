"""When a collective's buffers die: at the program's last reference, not the communication thread's.

A c10d collective (`torch.ops.c10d.*`: FSDP2's all-gather and reduce-scatter) returns a `Work` that
keeps its own views of the tensors it reads and writes (gloo chunks the flat all-gather output and
the reduce-scatter input into per-rank views). The backend's worker thread holds that `Work` while it
runs the collective and drops it a moment after marking it complete, so after `work.wait()` has
returned and the program has dropped its last reference to a buffer, the buffer's storage can still
be alive for a few milliseconds, held by a thread the program does not control. Measured on CPU with
two gloo ranks: after a synchronous `all_gather_into_tensor` and `del out`, the output storage was
still alive in 477 to 582 of 2,000 steps per rank, for at most 3.5 ms.

The capture and the verified step's ledger read storage lifetimes by weak reference at each new op,
so without this module such a buffer would live one op or several ops longer whenever the thread
ran late: a capture that predicts a later release, or a measured peak above the prediction (one
reduce-scatter or all-gather buffer too many), nondeterministically. `CollectiveReleases` holds every
collective's `Work` from its dispatch until it is complete and, at the next new op, drops it and
waits until the views the `Work` took of each buffer are gone, so that what is alive at each poll
is what the program itself holds: the release point is the program's, the same every step.

A `Work` is not settled inside the dispatch that issued it. The verified step's ledger polls at
the end of every dispatch, the collective's own included, while that dispatch still holds the op's
return value (the `Work`'s `ScriptObject`, on its way back to `all_gather_single`): waiting there
for the `Work`'s views to go waited for a reference that only the waiting code could drop, so the
settle ran into `SETTLE_TIMEOUT_S` (10 s on each rank, once per step, in FSDP2's backward prefetch
all-gather under Lightning) and counted the buffers alive all along. Such a `Work` stays held until
a later settle, after the dispatch has returned it.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

#: How long `settle` waits for a backend thread to drop a completed collective (it takes
#: milliseconds); past it the buffers count as alive, as they are.
SETTLE_TIMEOUT_S = 10.0


def _use_count(ref: StorageWeakRef) -> int:
    return 0 if ref.expired() else torch._C._storage_Use_Count(ref.cdata)


def _unboxed(work: object) -> object:
    import torch.distributed as dist

    return dist.distributed_c10d.Work.unbox(work)


def _held_by_program(work: object) -> bool:
    """Whether the program still holds the collective's `Work` (pybind hands out one Python object
    per `Work`: a reference the program keeps shows in its count; two here are this function's
    variable and `getrefcount`'s argument)."""
    unboxed = _unboxed(work)
    return sys.getrefcount(unboxed) > 2


def _refcount_at(items: list, index: int) -> int:
    return sys.getrefcount(items[index])


#: `_refcount_at` of an object only a list holds: the list's reference and the argument's (2 on
#: CPython 3.11), measured rather than assumed so that an interpreter's counting cannot shift it.
_LIST_ONLY_REFS = _refcount_at([object()], 0)


def _held_by_dispatch(works: list[object]) -> bool:
    """Whether something besides `works` holds one of the collective's `ScriptObject`s: the dispatch
    that issued it, which returns it to the caller (the pybind `Work` the program gets does not exist
    yet, so `_held_by_program` cannot see it)."""
    return any(_refcount_at(works, i) > _LIST_ONLY_REFS for i in range(len(works)))


def _completed(work: object) -> bool:
    return _unboxed(work).is_completed()


class CollectiveReleases:
    """The collectives dispatched and not yet settled: their `Work`s and, per storage they read or
    write, how many references the `Work` took to it (counted right after the call, while this
    object holds the `Work`, so the count cannot race the backend thread)."""

    def __init__(self) -> None:
        self._pending: list[tuple[list[object], list[tuple[StorageWeakRef, int]]]] = []
        #: Settles that reached `SETTLE_TIMEOUT_S` for a collective (its buffers then count as alive):
        #: 0 unless a backend thread stalls.
        self.timeouts = 0

    def call(self, func, args: tuple, kwargs: dict) -> object:
        """`func(*args, **kwargs)`; for a c10d collective, its `Work` held until `settle`."""
        if getattr(func, "namespace", None) != "c10d":
            return func(*args, **kwargs)
        storages = {t.untyped_storage()._cdata: t.untyped_storage()
                    for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        before = {key: torch._C._storage_Use_Count(key) for key in storages}
        out = func(*args, **kwargs)
        works = [x for x in tree_leaves(out) if isinstance(x, torch.ScriptObject)]
        taken = [(StorageWeakRef(s), torch._C._storage_Use_Count(key) - before[key]) for key, s in storages.items()]
        taken = [(ref, n) for ref, n in taken if n > 0]
        if works and taken:
            self._pending.append((works, taken))
        return out

    def settle(self) -> None:
        """Drop every completed collective's `Work` that the program no longer holds and wait until
        the references it took are gone; one still running, or held by the program (an async
        collective not waited for yet, or one whose dispatch has not returned yet), stays held."""
        still: list[tuple[list[object], list[tuple[StorageWeakRef, int]]]] = []
        for works, taken in self._pending:
            if _held_by_dispatch(works) or any(_held_by_program(w) for w in works):
                still.append((works, taken))
                continue
            # Dropped by the program: a synchronous collective whose wait returned can be marked
            # complete by the backend thread a moment later (seen once in 1,000 calls); an async one
            # dropped unwaited completes on its own. Either way its buffers live until then.
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while not all(_completed(w) for w in works) and time.monotonic() < deadline:
                time.sleep(0)
            complete = all(_completed(w) for w in works)
            targets = [(ref, _use_count(ref) - n) for ref, n in taken]
            works.clear()  # this object's reference: the backend thread's, if it has one, is the last
            for ref, target in targets:
                while _use_count(ref) > target and time.monotonic() < deadline:
                    time.sleep(0)
            if not complete or any(_use_count(ref) > target for ref, target in targets):
                self.timeouts += 1
        self._pending = still
