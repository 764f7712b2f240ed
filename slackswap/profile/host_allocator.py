"""Keep the host allocator's freed memory in the process between steps, as a GPU's caching allocator does.

Why: on the CPU a tensor's memory comes from the C library's `malloc`. glibc's, left as it is, gives
freed memory at the top of its heap back to the kernel once more than its trim threshold is free there,
and serves blocks over its mmap threshold (both adjusted as the process runs) by fresh mappings, so a
later step that needs that memory again takes a page fault for every 4 KiB page it touches first. Which
steps do depends on the heap's state, not on the step: timing hf_gpt2_2l's plain step (one thread, CPU
time of the thread, 40 steps after 10 warm-up, three processes each way) read hundreds of minor faults in
10 to 18 of the 40 steps (interquartile ranges 8.99-9.83, 7.94-9.10 and 8.18-10.17 ms; in another script,
a step with about 1,100 faults ran 1.3 ms, 15 %, over one with none); with freed memory kept, at most one
such step and ranges of 9.74-10.11, 7.97-8.14 and 8.38-8.56 ms (the level moves between processes either
way). A CUDA device's caching allocator keeps freed blocks for the next step (PyTorch's docs, "CUDA
semantics", "Memory management"), and the simulator charges no page faults: keeping freed memory makes
the CPU device what the prediction models, and a step's time a property of the step. Setting glibc's two
thresholds (mallopt(3): `M_TRIM_THRESHOLD`, `M_MMAP_THRESHOLD`) does it from inside a running process,
with no other library. PyTorch's CPU guidance gets the same by swapping the allocator at process start
with `LD_PRELOAD`: "for deep learning workloads, Jemalloc or TCMalloc can get better performance by
reusing memory as much as possible than default malloc function" (Performance Tuning Guide, "Switch
Memory allocator", https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html).

What it costs: the process keeps its heap's high-water mark (as CUDA's allocator keeps its reserved
memory); a block over the mmap threshold set (2 GiB less a byte, or 32 MiB on a glibc that refuses that)
is still mapped afresh. On a C library other than glibc nothing is changed, and the setting says so. It
is process-wide: once applied, it holds until the process ends (mallopt has no way to read a threshold
back).
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

#: mallopt(3)'s parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Free memory at the heap's top above which glibc trims it: the largest value mallopt takes (an int).
KEPT_TRIM_THRESHOLD_BYTES = 2**31 - 1
#: Blocks up to the mmap threshold come from the heap, and stay there when freed: the largest value
#: mallopt takes (glibc 2.36 takes and honours it: a 256 MiB block freed and asked for again took 0 page
#: faults, 65,537 at 32 MiB), then, where a glibc refuses that, 32 MiB, the largest its manual gives
#: (DEFAULT_MMAP_THRESHOLD_MAX on a 64-bit system, 4 MiB x sizeof(long)).
KEPT_MMAP_THRESHOLDS_BYTES = (2**31 - 1, 32 * 1024 * 1024)
#: What `host_allocator_label` says of a process whose host allocator runs as the C library set it up.
SYSTEM_DEFAULT_ALLOCATOR = "system default"


@dataclass(frozen=True)
class HostAllocatorSetting:
    """What `keep_freed_memory` did in this process."""

    #: True when both thresholds were set (glibc accepted them).
    applied: bool
    #: One line for a console or a record: what was set, or why nothing was.
    detail: str


_applied: HostAllocatorSetting | None = None


def keep_freed_memory() -> HostAllocatorSetting:
    """Set glibc's trim and mmap thresholds so that freed memory stays in the process (module docstring);
    idempotent. On another C library, or when glibc refuses the trim threshold, nothing is changed; when it
    refuses every mmap threshold, only the trim threshold is; `detail` says which."""
    global _applied
    if _applied is not None:
        return _applied
    library, version = platform.libc_ver()
    if library != "glibc":
        return HostAllocatorSetting(False, f"the C library is {library or 'not identified'}, not glibc: "
                                           "the host allocator left as it is")
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD_BYTES) != 1:
        return HostAllocatorSetting(False, f"glibc {version} refused mallopt(M_TRIM_THRESHOLD, "
                                           f"{KEPT_TRIM_THRESHOLD_BYTES}): the host allocator left as it is")
    mmap_threshold = next((v for v in KEPT_MMAP_THRESHOLDS_BYTES if libc.mallopt(M_MMAP_THRESHOLD, v) == 1), None)
    if mmap_threshold is None:  # the trim threshold is set: what the process now runs, and a key must say
        _applied = HostAllocatorSetting(False, f"glibc {version}, M_TRIM_THRESHOLD {KEPT_TRIM_THRESHOLD_BYTES} "
                                               f"set but mallopt(M_MMAP_THRESHOLD, v) refused for v in "
                                               f"{KEPT_MMAP_THRESHOLDS_BYTES}: large blocks still mapped afresh")
        return _applied
    _applied = HostAllocatorSetting(True, f"glibc {version}, freed memory kept (M_TRIM_THRESHOLD "
                                          f"{KEPT_TRIM_THRESHOLD_BYTES}, M_MMAP_THRESHOLD {mmap_threshold})")
    return _applied


def host_allocator(keep_freed: bool) -> str:
    """Keep freed memory when asked (`keep_freed_memory`); one line on how the host allocator runs either
    way, for a console and a record (a process that kept it earlier keeps it: glibc's thresholds cannot be
    read back or reset). What every entry point with a `keep_freed_host_memory` setting or a
    `--system-allocator` flag calls before it builds a model or measures a copy."""
    return keep_freed_memory().detail if keep_freed else host_allocator_label()


def host_allocator_label() -> str:
    """How this process's host allocator runs, for a measurement's key: `keep_freed_memory`'s detail once
    it changed a threshold, else `SYSTEM_DEFAULT_ALLOCATOR`."""
    return _applied.detail if _applied is not None else SYSTEM_DEFAULT_ALLOCATOR
