"""How `benchmarks/runtime_overhead.py` measures a step: one training step and its gradient reset, a
copy engine that moves no data (to time the runtime without its copies), the peak of CPU bytes a
step allocates, and the paired ratio of a variant's round times to eager's (that module's docstring,
"Timing", says why paired)."""

from __future__ import annotations

import statistics


class NoDataCopies:
    """A copy engine that moves no data: the offload keeps the device storage, the prefetch returns
    it (values unchanged, so the step stays exact; memory is not saved). Timing attribution only.
    Like the CPU stand-in (`CpuCopies`) it has nothing in flight, so the runtime does not poll it."""

    needs_poll = False

    def offload(self, source, key=None):
        return source  # arrived at issue, as an inline copy is

    def prefetch(self, offloaded, device):
        return offloaded

    def poll(self) -> None:
        return None

    def close(self) -> None:
        return None


def peak_cpu_bytes(step) -> int:
    """The peak of CPU bytes allocated while `step()` runs, above what was allocated before it.

    The allocator's own record: one `[memory]` event per CPU allocation (bytes > 0) and per free
    (bytes < 0), summed in time order. Read from the profiler's raw results (`kineto_results`, which
    `torch.profiler`'s memory profiler reads too): `prof.events()` builds the op tree first, 2 s per
    step at 32 layers, and attributing bytes to ops through it dropped the allocations no op
    encloses (64-80 KiB of the checkpoint and offload_hooks steps)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    cpu = torch.autograd.DeviceType.CPU
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == cpu)
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def paired_ratio(times_s: list[float], eager_times_s: list[float]) -> float:
    """The median over rounds of a variant's time over eager's in the same round (both lists in round
    order): a ratio of two steps timed in one machine state, where the quotient of two leasts pairs
    states far apart when the machine's speed drifts within a run (module docstring, "Timing")."""
    return statistics.median(t / e for t, e in zip(times_s, eager_times_s, strict=True))


def train_step(w) -> None:
    w.loss_fn(w.model(w.batch)).backward()


def identity(x):
    return x


def zero_grads(w) -> None:
    for p in w.model.parameters():
        p.grad = None
