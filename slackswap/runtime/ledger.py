"""The runtime's ledger of the step's device bytes, measured from storage lifetimes.

Every device storage that holds a copy of a graph tensor is tracked through a weak reference: run
copies of every tensor (activations, the model's temporaries, activation gradients), recomputed
copies and prefetched copies. Two sums are kept: every tracked storage (`device_peak_bytes`, what
the simulator's `peak_activation_bytes` predicts) and the copies of saved tensors only
(`peak_bytes`, what the saved-bytes simulation of `runtime.compare` predicts). Weights, their
gradients, optimizer state and the input batch are not graph tensors and are not in either sum
(docs/memory.md: one definition of an activation). The weight gradients the step makes are model
state, measured apart (`track_weight_grad`, `weight_grad_peak_bytes`: the graph's
`WEIGHT_GRADS_KEY` bytes). `poll`
drops the storages that PyTorch has freed and records the sums of the rest; the runtime polls
during every plan step (right after the op's kernels returned, when its inputs and outputs are both
alive, the simulator's in-step moment) and after every transfer issue. So the peak is what was
actually alive, whoever held it (autograd, the runtime, or the model's own Python variables), at op
granularity. A collective's buffers are alive until the program's last reference goes, not the
backend thread's (`settle`: `slackswap.runtime.collectives`).

With `trace=True` it also keeps, per plan step, the set of live copies, so a difference from the
simulator can be attributed copy by copy (`slackswap.runtime.compare.explain_ledger`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class SavedBytesLedger:
    def __init__(self, trace: bool = False, settle: Callable[[], None] | None = None) -> None:
        #: Called before each sum (`CollectiveReleases.settle`): no collective's `Work` left in a
        #: backend thread keeps a buffer alive that the program has let go.
        self._settle = settle
        self._live: dict[int, tuple[StorageWeakRef, int, int, bool]] = {}
        self.trace = trace
        self.in_use_bytes = 0
        self.peak_bytes = 0
        #: Every tracked storage, saved or not: the step's device bytes of graph tensors.
        self.device_in_use_bytes = 0
        self.device_peak_bytes = 0
        #: Plan step during which `device_peak_bytes` was measured (-1: outside any step).
        self.device_peak_step = -1
        #: Plan step during which the peak was measured (-1: outside any step).
        self.peak_step = -1
        #: Copy ids (of the plan's resolved schedule) alive during each plan step, when tracing: of
        #: saved tensors, and of every tensor.
        self.live_by_step: dict[int, frozenset[int]] = {}
        self.device_live_by_step: dict[int, frozenset[int]] = {}
        self._grew = False
        #: The weight gradients' storages (model state): live ones by weak reference, their peak sum.
        self._weight_grads: dict[int, tuple[StorageWeakRef, int]] = {}
        self.weight_grad_peak_bytes = 0

    def track_weight_grad(self, storage: torch.UntypedStorage) -> None:
        """Count `storage` (a parameter's gradient the step made) as model state while it lives."""
        key = storage.data_ptr()
        entry = self._weight_grads.get(key)
        if entry is None or entry[0].expired():
            self._weight_grads[key] = (StorageWeakRef(storage), storage.nbytes())
        live = sum(n for ref, n in self._weight_grads.values() if not ref.expired())
        self.weight_grad_peak_bytes = max(self.weight_grad_peak_bytes, live)

    def track(self, storage: torch.UntypedStorage, copy_id: int, saved: bool = True) -> None:
        """Count `storage` (a copy of graph tensor copy `copy_id`; `saved`: of a saved tensor) while it lives."""
        self._grew = True
        key = storage.data_ptr()
        entry = self._live.get(key)
        if entry is None or entry[0].expired():  # a freed storage's address can be reused at once
            self._live[key] = (StorageWeakRef(storage), storage.nbytes(), copy_id, saved)

    def poll(self, step: int) -> None:
        """Drop freed storages and update the peak. Between two `track` calls the sum can only fall, so
        without tracing a poll after no new storage is skipped: the peak is still exact, at O(1)."""
        if not self._grew and not self.trace:
            return
        self._grew = False
        if self._settle is not None:
            self._settle()
        for key in [k for k, (ref, _, _, _) in self._live.items() if ref.expired()]:
            del self._live[key]
        self.in_use_bytes = sum(n for _, n, _, saved in self._live.values() if saved)
        self.device_in_use_bytes = sum(n for _, n, _, _ in self._live.values())
        if self.in_use_bytes > self.peak_bytes:
            self.peak_bytes = self.in_use_bytes
            self.peak_step = step
        if self.device_in_use_bytes > self.device_peak_bytes:
            self.device_peak_bytes = self.device_in_use_bytes
            self.device_peak_step = step
        if self.trace and step >= 0:
            live = {c for _, _, c, saved in self._live.values() if saved}
            self.live_by_step[step] = self.live_by_step.get(step, frozenset()) | live
            every = {c for _, _, c, _ in self._live.values()}
            self.device_live_by_step[step] = self.device_live_by_step.get(step, frozenset()) | every
