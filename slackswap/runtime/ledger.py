"""The runtime's ledger of saved-tensor bytes resident on the device, measured from storage lifetimes.

Every device storage that holds a copy of a saved graph tensor (its run copy, a recomputed copy, a
prefetched copy) is tracked through a weak reference. `poll` drops the storages that PyTorch has
freed and records the sum of the rest; the runtime polls after every ATen call, recompute and
transfer. So the peak is what was actually alive, whoever held it (autograd, the runtime, the
model's Python locals), sampled at op granularity.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class SavedBytesLedger:
    def __init__(self) -> None:
        self._live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.in_use_bytes = 0
        self.peak_bytes = 0
        #: (label of the moment, bytes in use) at the peak, for explaining a difference.
        self.peak_at = ""
        #: Tensors alive at the peak.
        self.peak_tensors: list[str] = []

    def track(self, storage: torch.UntypedStorage, tensor: str) -> None:
        key = storage.data_ptr()
        if key not in self._live:
            self._live[key] = (StorageWeakRef(storage), storage.nbytes(), tensor)

    def poll(self, moment: str) -> None:
        for key in [k for k, (ref, _, _) in self._live.items() if ref.expired()]:
            del self._live[key]
        self.in_use_bytes = sum(n for _, n, _ in self._live.values())
        if self.in_use_bytes > self.peak_bytes:
            self.peak_bytes = self.in_use_bytes
            self.peak_at = moment
            self.peak_tensors = self.live_tensors()

    def live_tensors(self) -> list[str]:
        return sorted(name for _, _, name in self._live.values())
