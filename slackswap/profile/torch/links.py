"""Measure the host <-> device links of the machine at hand: bandwidth and per-copy latency of each
direction (pinned and pageable host memory, one direction alone and both at once), over sizes from
4 KiB up, and the cost of pinning a host buffer. `machine_description` turns the rows into what the
hardware and node configs load (`slackswap.profile.machine`).

CUDA: H2D and D2H `copy_(non_blocking=True)` on their own streams, timed with CUDA events; both at
once: one copy per direction issued together, each timed on its stream. Pinning: `torch.empty(...,
pin_memory=True)` timed on the host (a `cudaHostAlloc`). Written but never run in this repository's
tests: no GPU here (docs/profile.md says so).

CPU: there is no device memory, so the "device" and the host are the same DRAM. A copy is what the
runtime's CPU engine does (`slackswap.runtime.copy_engines.CpuCopies`): an offload is `copy_` into a
host buffer, a prefetch is `clone`, both synchronous on the compute thread. Pinned memory needs an
accelerator (`pin_memory=True` raises on a CPU-only build): those rows are one line saying so, not
numbers. "Both at once" is two copies in a row on the one thread: it is what the runtime does there.

`cached_machine_description` measures once per device and torch version and reuses the description
under the op-time table's rule (`slackswap.profile.machine.description_refusal`): one measured on a
loaded machine, or a file that cannot be used, is measured again, and the new one says why.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from slackswap.profile.host_allocator import SYSTEM_DEFAULT_ALLOCATOR, host_allocator_label

KIB = 1024
#: Copy sizes: 4 KiB to 1 GiB by powers of 4 (the issue's range); callers cap the top (`max_bytes`).
SIZES_BYTES = tuple(4 * KIB * 4**i for i in range(10))  # 4 KiB ... 1 GiB


@dataclass(frozen=True)
class CopyRow:
    direction: str  # "h2d", "d2h", "both" (each direction's time while the other runs)
    host_memory: str  # "pinned" or "pageable"
    size_bytes: int
    median_s: float
    min_s: float
    max_s: float

    @property
    def bytes_per_s(self) -> float:
        return self.size_bytes / self.median_s if self.median_s > 0 else float("inf")


@dataclass(frozen=True)
class LinkMeasurement:
    device: str
    #: True on the CPU: host and "device" are one memory, copies are synchronous on the compute thread.
    same_memory: bool
    rows: tuple[CopyRow, ...]
    #: (size_bytes, seconds) to allocate a pinned host buffer; empty where pinning is unavailable.
    pin_rows: tuple[tuple[int, float], ...]
    #: One line per measurement that could not be made.
    skipped: tuple[str, ...]


def _time(fn, device: torch.device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats + 1):  # the first is a warm-up (page faults, allocator)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out[1:]


def _row(direction: str, memory: str, size: int, times: list[float]) -> CopyRow:
    return CopyRow(direction, memory, size, statistics.median(times), min(times), max(times))


def _cpu_rows(sizes: tuple[int, ...], repeats: int) -> list[CopyRow]:
    device = torch.device("cpu")
    rows = []
    for size in sizes:
        src = torch.ones(size, dtype=torch.uint8)
        host = torch.empty(size, dtype=torch.uint8)
        d2h, h2d = partial(host.copy_, src), host.clone
        rows.append(_row("d2h", "pageable", size, _time(d2h, device, repeats)))
        rows.append(_row("h2d", "pageable", size, _time(h2d, device, repeats)))
        # One thread: "both at once" is one after the other; each direction's share is half the pair.
        rows.append(_row("both", "pageable", size,
                         [t / 2 for t in _time(lambda d=d2h, h=h2d: (d(), h()), device, repeats)]))
    return rows


def _cuda_rows(device: torch.device, sizes: tuple[int, ...], repeats: int) -> list[CopyRow]:
    rows = []
    h2d_stream, d2h_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    for memory in ("pinned", "pageable"):
        for size in sizes:
            pinned = memory == "pinned"
            host_src = torch.ones(size, dtype=torch.uint8, pin_memory=pinned)
            host_dst = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            dev_src = torch.ones(size, dtype=torch.uint8, device=device)
            dev_dst = torch.empty(size, dtype=torch.uint8, device=device)

            def timed(stream, dst, src):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record(stream)
                    dst.copy_(src, non_blocking=True)
                    end.record(stream)
                return start, end

            for direction, stream, dst, src in (("h2d", h2d_stream, dev_dst, host_src),
                                                ("d2h", d2h_stream, host_dst, dev_src)):
                times = []
                for _ in range(repeats + 1):
                    s, e = timed(stream, dst, src)
                    torch.cuda.synchronize(device)
                    times.append(s.elapsed_time(e) / 1e3)
                rows.append(_row(direction, memory, size, times[1:]))
            both = []
            for _ in range(repeats + 1):
                h = timed(h2d_stream, dev_dst, host_src)
                d = timed(d2h_stream, host_dst, dev_src)
                torch.cuda.synchronize(device)
                both.append(max(h[0].elapsed_time(h[1]), d[0].elapsed_time(d[1])) / 1e3)
            rows.append(_row("both", memory, size, both[1:]))
    return rows


def _pin_rows(sizes: tuple[int, ...], repeats: int) -> list[tuple[int, float]]:
    out = []
    for size in sizes:
        times = _time(lambda s=size: torch.empty(s, dtype=torch.uint8, pin_memory=True), torch.device("cpu"),
                      repeats)
        out.append((size, statistics.median(times)))
    return out


def measure_links(device: str = "cpu", max_bytes: int = 256 * 1024**2, repeats: int = 5) -> LinkMeasurement:
    """Copy rows for every size of `SIZES_BYTES` up to `max_bytes` on `device` (module docstring)."""
    sizes = tuple(s for s in SIZES_BYTES if s <= max_bytes)
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            from slackswap.profile.measured import MeasurementError

            raise MeasurementError(f"device {device}: no CUDA device is visible to this torch build")
        rows = _cuda_rows(dev, sizes, repeats)
        return LinkMeasurement(f"{dev} {torch.cuda.get_device_name(dev)}", False, tuple(rows),
                               tuple(_pin_rows(sizes, repeats)), ())
    skipped = ("pinned host memory: no accelerator on this machine (pin_memory needs one); not measured",
               "pinning cost: no accelerator on this machine; not measured")
    return LinkMeasurement("cpu", True, tuple(_cpu_rows(sizes, repeats)), (), skipped)


def measurement_description(m: LinkMeasurement, name: str) -> dict:
    """`slackswap.profile.machine.machine_description` of a measurement, with the versions it ran on."""
    from dataclasses import asdict

    from slackswap.profile.machine import machine_description
    from slackswap.profile.measured import measured_load
    from slackswap.versions import package_versions

    description = machine_description(
        name, m.device, m.same_memory, [asdict(r) for r in m.rows], m.pin_rows, m.skipped,
        source=f"measured by slackswap.profile.torch.links on {m.device}, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    description["versions"] = package_versions(("torch",))
    description["host_allocator"] = host_allocator_label()
    # The load it was measured at: a cached description measured under load is measured again.
    description["notes"] = measured_load()
    return description


def machine_cache_path(cache_dir: str | Path, device: str) -> Path:
    """Where a run caches the description of `device`'s links: one file per device, torch's intra-op
    thread count (a CPU copy past torch's parallel-copy grain runs on that many threads), versions and,
    once this process keeps freed host memory (`slackswap.profile.host_allocator`), a digest of how: a
    CPU prefetch is a `clone` into a fresh block, which glibc's own thresholds serve from fresh pages."""
    from slackswap.versions import package_versions

    tag = "-".join(f"{k}{v}" for k, v in sorted(package_versions(("torch",)).items()))
    allocator = host_allocator_label()
    digest = hashlib.sha256(allocator.encode()).hexdigest()[:8]
    kept = "" if allocator == SYSTEM_DEFAULT_ALLOCATOR else f"-alloc{digest}"
    return Path(cache_dir) / (f"machine-{device.replace(':', '_')}-threads{torch.get_num_threads()}-"
                              f"{tag.replace('/', '_').replace(' ', '_')}{kept}.json")


def cached_machine_description(device: str, cache_dir: str | Path | None, max_bytes: int,
                               repeats: int = 3) -> tuple[dict, bool]:
    """(description of `device`'s links, True when it came from `cache_dir`): measured once per device
    and versions, reused by later runs unless `description_refusal` refuses the cached file (measured
    under load, on other versions, or not a description; a file that does not parse alike); then it is
    measured again, the new description's `notes["remeasured_because"]` says why, and it replaces the
    cached file. As `slackswap.runtime.op_times.cached_op_times` does for the op-time table."""
    from slackswap.profile.machine import description_refusal
    from slackswap.profile.measured import read_cached_json, write_json_atomic
    from slackswap.versions import package_versions

    why = path = None
    if cache_dir is not None:
        path = machine_cache_path(cache_dir, device)
        artefact = f"machine description {path.name}"
        found, why = read_cached_json(path, artefact)
        if found is not None:
            why = description_refusal(found, artefact, package_versions(("torch",)))
            if why is None:
                return found, True
    description = measurement_description(measure_links(device, max_bytes, repeats), device)
    if why is not None:
        description["notes"] = dict(description["notes"]) | {"remeasured_because": why}
    if path is not None:
        write_json_atomic(path, description)
    return description, False
