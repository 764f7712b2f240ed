"""Copy engines: device -> host offloads and host -> device prefetches, off the compute stream.

`CudaCopies` puts each direction on its own CUDA stream (one copy engine per direction, FIFO, as
the simulator models them) with pinned host buffers and events. `CpuCopies` is the CPU stand-in:
synchronous by default (the copy has arrived when it is issued), or asynchronous on one worker
thread per direction with an optional artificial delay, which is how the tests make a prefetch late.

What an engine moves is a tensor that is exactly its storage (contiguous from offset 0; the runtime
hands a view's storage over as its bytes, `byte_view`), and each copy's destination is a tensor of
the same shape and dtype. Why: on the hook-only path the unpack of a swapped tensor then returns the
arrived copy itself, and an offload or a prefetch is one ATen call, where copying storages costs five
(`UntypedStorage.copy_` wraps both sides in tensors) and every unpack two more to rebuild the view.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from slackswap.schedule.positions import HOST_BUFFER_ALIGNMENT_BYTES


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class InFlight:
    """One transfer in flight (not a device copy of the plan: that is `slackswap.schedule.copies.Copy`):
    `tensor` is its destination, a contiguous tensor of the source's shape
    and dtype (on the host, for an offload from a pinned slab, a view of the slab); `arrived()` /
    `wait()` tell whether it has landed. A copy that lands when it is issued (the CPU stand-in's inline
    copies) is returned as its destination tensor itself: no object to make, nothing to wait for."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @property
    def storage(self) -> torch.UntypedStorage:
        """The destination's storage (for a buffer of the pinned slab: the whole slab's)."""
        return self.tensor.untyped_storage()

    def arrived(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        """Make the compute stream wait for the copy (the host blocks only on CPU)."""
        raise NotImplementedError


class _FutureInFlight(InFlight):
    def __init__(self, tensor: torch.Tensor, future: Future):
        super().__init__(tensor)
        self.future = future

    def arrived(self) -> bool:
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


class HostPool:
    """Host buffers reused across steps, one per offload of the plan (its index `key`): sized from the
    plan up front with `reserve` (one slab for all of them, pinned once), or else at first use from
    the tensor the plan offloads. Why: allocating (and on CUDA pinning) a buffer per tensor per step
    costs about 3 ms each and serialises the streams (pytorch/pytorch#186162,
    pytorch/torchtune#2076). Safe to reuse because a run closes its copies (waits for every
    transfer) before the next step, and within a step each offload has its own buffer."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._buffers: dict[int, torch.Tensor] = {}
        #: Per key, the buffer as the tensor an offload last wrote, with its dtype and shape: read on
        #: every offload, so the views are made once, not per step.
        self._typed: dict[object, tuple[torch.dtype, torch.Size, torch.Tensor]] = {}
        self.allocations = 0

    def get(self, key: object, nbytes: int) -> torch.Tensor:
        """The buffer of `key` as `nbytes` uint8 (a new one when its size differs; none kept for key None)."""
        buf = None if key is None else self._buffers.get(key)
        if buf is None or buf.numel() != nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
            self.allocations += 1
            if key is not None:
                self._buffers[key] = buf
                self._typed.pop(key, None)
        return buf

    def like(self, key: object, source: torch.Tensor) -> torch.Tensor:
        """The buffer of `key` as a contiguous tensor of `source`'s shape and dtype: the destination
        an offload of `source` copies into."""
        return self.typed(key, source.dtype, source.shape)

    def typed(self, key: object, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """The buffer of `key` as a contiguous tensor of `dtype` and `shape`."""
        found = self._typed.get(key)
        if found is not None and found[0] == dtype and found[1] == shape:
            return found[2]
        typed = self.get(key, shape.numel() * dtype.itemsize).view(dtype).view(shape)
        if key is not None:
            self._typed[key] = (typed.dtype, typed.shape, typed)
        return typed

    def reserve(self, sizes: Mapping[int, int], alignment_bytes: int = HOST_BUFFER_ALIGNMENT_BYTES) -> None:
        """One allocation (one pinning) for every buffer: `sizes` maps each offload's key to its bytes.
        Buffers start at multiples of `alignment_bytes` (so any dtype can view them); they are views
        of the slab, whose storage they share."""
        offsets, total = {}, 0
        for key, nbytes in sizes.items():
            offsets[key] = total
            total += -(-nbytes // alignment_bytes) * alignment_bytes
        if total == 0:
            return
        slab = torch.empty(total, dtype=torch.uint8, pin_memory=self.pinned)
        self.allocations += 1
        for key, nbytes in sizes.items():
            self._buffers[key] = slab.narrow(0, offsets[key], nbytes)
            self._typed.pop(key, None)

    @property
    def bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())


class CpuCopies:
    """CPU copies: inline (`delay_s=None`), or on one thread per direction after `delay_s` seconds.

    `measure=True` adds up the CPU time of the inline copies in `copy_s` (two clock reads per copy,
    so only for attribution runs)."""

    #: Inline copies have nothing in flight to release: the runtime does not call `poll` per transfer.
    needs_poll = False

    def __init__(self, delay_s: float | None = None, measure: bool = False):
        self.delay_s = delay_s
        self.measure = measure
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self.host = HostPool(pinned=False)
        #: With `measure`: CPU time spent in inline copies (allocation and memcpy), work a GPU's copy
        #: engines do, which the CPU stand-in does on the compute thread; the benchmarks report it apart.
        self.copy_s = 0.0

    def _pool(self, direction: str) -> ThreadPoolExecutor:
        with self._lock:
            if direction not in self._pools:
                self._pools[direction] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"slackswap-{direction}")
            return self._pools[direction]

    def offload(self, source: torch.Tensor, key: int | None = None) -> InFlight | torch.Tensor:
        """Copy `source` (a tensor that is exactly its storage) into the host buffer of offload `key`
        (inline: the buffer, arrived)."""
        host = self.host.like(key, source)
        if self.delay_s is None:
            if not self.measure:
                return host.copy_(source)
            t0 = time.process_time()
            host.copy_(source)
            self.copy_s += time.process_time() - t0
            return host
        holder = [source]

        def run() -> None:
            time.sleep(self.delay_s)
            # A worker thread records autograd history by default (the hooks run with it off).
            with torch.no_grad():
                host.copy_(holder.pop())  # the device copy is released when the copy is done

        return _FutureInFlight(host, self._pool("d2h").submit(run))

    def prefetch(self, offloaded: InFlight | torch.Tensor, device: torch.device) -> InFlight | torch.Tensor:
        """A new device tensor with the offloaded copy's values (its allocation is the prefetch's
        memory; inline: that tensor, arrived)."""
        host = offloaded.tensor if isinstance(offloaded, InFlight) else offloaded
        if self.delay_s is None:
            if not self.measure:
                # One call: the allocation and the copy (a clone is the cheaper call where no device differs).
                return host.clone() if device.type == "cpu" else host.to(device, copy=True)
            t0 = time.process_time()
            target = host.clone() if device.type == "cpu" else host.to(device, copy=True)
            self.copy_s += time.process_time() - t0
            return target
        target = torch.empty_like(host, device=device)

        def run() -> None:
            if isinstance(offloaded, InFlight):
                offloaded.wait()
            time.sleep(self.delay_s)
            with torch.no_grad():
                target.copy_(host)

        return _FutureInFlight(target, self._pool("h2d").submit(run))

    def offloader(self, key: int, dtype: torch.dtype, shape: torch.Size) -> Callable[[torch.Tensor], object]:
        """`offload` of plan offload `key` for sources the caller guarantees are contiguous tensors of
        `dtype` and `shape` (`bind_offload`): for inline copies the host buffer's own `copy_`, so the
        offload costs its one ATen call and no Python frame of ours."""
        if not self._inline():
            return partial(self.offload, key=key)
        return self.host.typed(key, dtype, shape).copy_

    def prefetcher(self, device: torch.device) -> Callable[[object], object]:
        """`prefetch` to `device` as one callable of the offloaded copy (`bind_prefetch`): for inline
        copies `Tensor.clone` (or `Tensor.to` for another device) itself."""
        if not self._inline():
            return partial(self.prefetch, device=device)
        if device.type == "cpu":
            return torch.Tensor.clone
        return partial(torch.Tensor.to, device=device, copy=True)

    def _inline(self) -> bool:
        """The copies are inline, unmeasured and this class's own (a subclass that overrides `offload`
        or `prefetch` has them called for every transfer)."""
        return (self.delay_s is None and not self.measure and type(self).offload is CpuCopies.offload
                and type(self).prefetch is CpuCopies.prefetch)

    def poll(self) -> None:
        return None

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()


class _EventInFlight(InFlight):
    """A CUDA copy and the stream that consumes it. `wait` makes *that* stream wait, not whatever
    `current_stream()` is at the call: inside `with torch.cuda.stream(s)` it is `s`, and waiting on
    the wrong stream let compute read a buffer still being written (pytorch/torchtitan issue 2581;
    a missing reload wait gave NaN losses, deepspeedai/DeepSpeed issue 8186)."""

    def __init__(self, tensor: torch.Tensor, event: object, consumer: object):
        super().__init__(tensor)
        self.event = event
        self.consumer = consumer

    def arrived(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.consumer.wait_event(self.event)


class CudaCopies:
    """CUDA copies on one side stream per direction; pinned host buffers from a pool; events for arrival.

    Stream rules: the compute stream is the one current when the engine is made (the step's stream),
    held explicitly; an offload waits (on the GPU) for an event recorded on it at issue, so it reads
    the finished producer output; its device source is `record_stream`ed on the offload stream and
    held until the copy's event completes, so the allocator cannot hand it out while it is read. A
    prefetch allocates its device buffer on the compute stream (`record_stream`ed on the prefetch
    stream, which writes it), waits for the offload's event, and the unpack makes the compute stream
    (not `current_stream()`) wait on the prefetch's event."""

    #: `poll` releases the device sources of finished offloads: called after each issue.
    needs_poll = True

    def __init__(self, offload_bytes: Mapping[int, int] | None = None) -> None:
        """`offload_bytes`: per offload of the plan, its bytes (`offload_sizes`): the pinned buffers
        are then one slab, allocated and pinned here, before the first step."""
        self.compute = torch.cuda.current_stream()
        self.d2h = torch.cuda.Stream()
        self.h2d = torch.cuda.Stream()
        self.host = HostPool(pinned=True)
        if offload_bytes:
            self.host.reserve(offload_bytes)
        #: Device sources of offloads in flight, released once their event has completed.
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []

    def offload(self, source: torch.Tensor, key: int | None = None) -> InFlight | torch.Tensor:
        if source.device.type != "cuda":  # a host-side saved tensor (e.g. flash attention's RNG state)
            return CpuCopies().offload(source)
        issued = self.compute.record_event()
        host = self.host.like(key, source)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(issued)  # the producer kernel has run before the copy reads it
            host.copy_(source, non_blocking=True)
            done = self.d2h.record_event()
        source.record_stream(self.d2h)  # the allocator must not reuse it before the copy has read it
        self._in_flight.append((done, source))
        return _EventInFlight(host, done, self.compute)

    def prefetch(self, offloaded: InFlight | torch.Tensor, device: torch.device) -> InFlight | torch.Tensor:
        if device.type != "cuda":
            return CpuCopies().prefetch(offloaded, device)
        host = offloaded.tensor
        with torch.cuda.stream(self.compute):  # allocated on the stream that will read it
            target = torch.empty_like(host, device=device)
        issued = self.compute.record_event()
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(issued)
            if isinstance(offloaded, _EventInFlight):
                self.h2d.wait_event(offloaded.event)
            target.copy_(host, non_blocking=True)
            done = self.h2d.record_event()
        target.record_stream(self.h2d)
        return _EventInFlight(target, done, self.compute)

    def poll(self) -> None:
        self._in_flight = [(e, s) for e, s in self._in_flight if not e.query()]

    def close(self) -> None:
        self.d2h.synchronize()
        self.h2d.synchronize()
        self._in_flight.clear()


def bind_offload(engine, key: int, dtype: torch.dtype, shape: torch.Size) -> Callable[[torch.Tensor], object]:
    """`engine.offload(source, key)` as one callable of `source`, for sources of `dtype` and `shape`:
    the engine's own `offloader` where it has one (the per-transfer Python an engine can spare),
    else its `offload` with the key bound. Why: on the hook-only path an offload is then one call."""
    offloader = getattr(engine, "offloader", None)
    return partial(engine.offload, key=key) if offloader is None else offloader(key, dtype, shape)


def bind_prefetch(engine, device: torch.device) -> Callable[[object], object]:
    """`engine.prefetch(offloaded, device)` as one callable of `offloaded` (the engine's `prefetcher`
    where it has one)."""
    prefetcher = getattr(engine, "prefetcher", None)
    return partial(engine.prefetch, device=device) if prefetcher is None else prefetcher(device)


def offload_sizes(schedule) -> dict[int, int]:
    """Per offload of a resolved schedule (its index, the key the runtime passes), the bytes it copies:
    the storage of the copy it reads."""
    return {k: schedule.copy_size[c] for k, c in enumerate(schedule.offload_copy)}
