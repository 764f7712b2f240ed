"""Copy engines: device -> host offloads and host -> device prefetches, off the compute stream.

`CudaCopies` puts each direction on its own CUDA stream (one copy engine per direction, FIFO, as
the simulator models them) with pinned host buffers and events. `CpuCopies` is the CPU stand-in:
synchronous by default (the copy has arrived when it is issued), or asynchronous on one worker
thread per direction with an optional artificial delay, which is how the tests make a prefetch late.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class Copy:
    """One transfer: `storage` is its destination; `arrived()` / `wait()` tell whether it has landed."""

    def __init__(self, storage: torch.UntypedStorage):
        self.storage = storage

    def arrived(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        """Make the compute stream wait for the copy (the host blocks only on CPU)."""
        raise NotImplementedError


class _DoneCopy(Copy):
    def arrived(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _FutureCopy(Copy):
    def __init__(self, storage: torch.UntypedStorage, future: Future):
        super().__init__(storage)
        self.future = future

    def arrived(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


class CpuCopies:
    """CPU copies: inline (`delay_s=None`), or on one thread per direction after `delay_s` seconds."""

    def __init__(self, delay_s: float | None = None):
        self.delay_s = delay_s
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def _pool(self, direction: str) -> ThreadPoolExecutor:
        with self._lock:
            if direction not in self._pools:
                self._pools[direction] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"slackswap-{direction}")
            return self._pools[direction]

    def offload(self, source: torch.UntypedStorage) -> Copy:
        host = torch.UntypedStorage(source.nbytes())
        if self.delay_s is None:
            host.copy_(source)
            return _DoneCopy(host)
        holder = [source]

        def run() -> None:
            time.sleep(self.delay_s)
            host.copy_(holder.pop())  # the device copy is released when the copy is done

        return _FutureCopy(host, self._pool("d2h").submit(run))

    def prefetch(self, offloaded: Copy, device: torch.device) -> Copy:
        target = torch.UntypedStorage(offloaded.storage.nbytes(), device=device)
        if self.delay_s is None:
            target.copy_(offloaded.storage)
            return _DoneCopy(target)

        def run() -> None:
            offloaded.wait()
            time.sleep(self.delay_s)
            target.copy_(offloaded.storage)

        return _FutureCopy(target, self._pool("h2d").submit(run))

    def poll(self) -> None:
        return None

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()


class _EventCopy(Copy):
    def __init__(self, storage: torch.UntypedStorage, event: torch.cuda.Event):
        super().__init__(storage)
        self.event = event

    def arrived(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class CudaCopies:
    """CUDA copies on one side stream per direction; pinned host buffers; events for arrival."""

    def __init__(self) -> None:
        self.d2h = torch.cuda.Stream()
        self.h2d = torch.cuda.Stream()
        #: Device sources of offloads in flight, released once their event has completed.
        self._in_flight: list[tuple[torch.cuda.Event, torch.UntypedStorage]] = []

    def offload(self, source: torch.UntypedStorage) -> Copy:
        if source.device.type != "cuda":  # a host-side saved tensor (e.g. flash attention's RNG state)
            return CpuCopies().offload(source)
        issued = torch.cuda.current_stream().record_event()
        host = torch.empty(source.nbytes(), dtype=torch.uint8, pin_memory=True)
        src = byte_view(source)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(issued)  # the producer kernel has run before the copy reads it
            host.copy_(src, non_blocking=True)
            done = self.d2h.record_event()
        src.record_stream(self.d2h)  # the allocator must not reuse it before the copy has read it
        self._in_flight.append((done, source))
        return _EventCopy(host.untyped_storage(), done)

    def prefetch(self, offloaded: Copy, device: torch.device) -> Copy:
        if device.type != "cuda":
            return CpuCopies().prefetch(offloaded, device)
        target = torch.empty(offloaded.storage.nbytes(), dtype=torch.uint8, device=device)
        issued = torch.cuda.current_stream().record_event()
        host = byte_view(offloaded.storage)
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(issued)
            if isinstance(offloaded, _EventCopy):
                self.h2d.wait_event(offloaded.event)
            target.copy_(host, non_blocking=True)
            done = self.h2d.record_event()
        target.record_stream(self.h2d)
        return _EventCopy(target.untyped_storage(), done)

    def poll(self) -> None:
        self._in_flight = [(e, s) for e, s in self._in_flight if not e.query()]

    def close(self) -> None:
        self.d2h.synchronize()
        self.h2d.synchronize()
        self._in_flight.clear()
