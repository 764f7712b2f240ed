"""The runtime's ledger of saved-tensor bytes resident on the device, measured from storage lifetimes.

Every device storage that holds a copy of a saved graph tensor (its run copy, a recomputed copy, a
prefetched copy) is tracked through a weak reference. `poll` drops the storages that PyTorch has
freed and records the sum of the rest; the runtime polls during every plan step (right after the
op's kernels returned, when its inputs and outputs are both alive, the simulator's in-step moment)
and after every transfer issue. So the peak is what was actually alive, whoever held it (autograd,
the runtime, or the model's own Python variables), at op granularity.

With `trace=True` it also keeps, per plan step, the set of live copies, so a difference from the
simulator can be attributed copy by copy (`slackswap.runtime.compare.explain_ledger`).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class SavedBytesLedger:
    def __init__(self, trace: bool = False) -> None:
        self._live: dict[int, tuple[StorageWeakRef, int, int]] = {}
        self.trace = trace
        self.in_use_bytes = 0
        self.peak_bytes = 0
        #: Plan step during which the peak was measured (-1: outside any step).
        self.peak_step = -1
        #: Copy ids (of the plan's resolved schedule) alive during each plan step, when tracing.
        self.live_by_step: dict[int, frozenset[int]] = {}
        self._grew = False

    def track(self, storage: torch.UntypedStorage, copy_id: int) -> None:
        self._grew = True
        key = storage.data_ptr()
        entry = self._live.get(key)
        if entry is None or entry[0].expired():  # a freed storage's address can be reused at once
            self._live[key] = (StorageWeakRef(storage), storage.nbytes(), copy_id)

    def poll(self, step: int) -> None:
        """Drop freed storages and update the peak. Between two `track` calls the sum can only fall, so
        without tracing a poll after no new storage is skipped: the peak is still exact, at O(1)."""
        if not self._grew and not self.trace:
            return
        self._grew = False
        for key in [k for k, (ref, _, _) in self._live.items() if ref.expired()]:
            del self._live[key]
        self.in_use_bytes = sum(n for _, n, _ in self._live.values())
        if self.in_use_bytes > self.peak_bytes:
            self.peak_bytes = self.in_use_bytes
            self.peak_step = step
        if self.trace and step >= 0:
            self.live_by_step[step] = self.live_by_step.get(step, frozenset()) | {c for _, _, c in self._live.values()}
