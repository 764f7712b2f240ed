"""Measured op times: a table of how long each op of a captured step took on a real device, cached on
disk, and a graph re-timed from it (`profile.timing=measured`, docs/profile.md "Measured op times").

The roofline (`slackswap.profile.timing`) stays the graph builders' timing; a measured table replaces
op durations *after* the graph is built, per op name, and every op the table lacks keeps its roofline
duration. `retime` says how many ops each source timed, so a run never mixes sources silently.

A table is keyed by everything its times depend on (`OpTimeKey`): the graph's fingerprint (op
identities, tensor sizes), the model's parameter signature, the input shapes and dtypes, the device
and the library versions. It is stored as `<cache_dir>/<key digest>.json`; another shape, device or
torch version is another digest, so a stale table is never found, and `load_table` checks the stored
key against the one asked for besides. A cached measurement measured under load is measured again
rather than reused (`load_refusal`): the one rule for the op-time table and the machine description
(`slackswap.profile.machine.description_refusal`), whose run says in one line each which it reused
(`cache_line`). This module needs no torch: the measuring is `slackswap.runtime.op_times`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from slackswap.errors import SlackSwapError
from slackswap.graph import Graph
from slackswap.profile.host_allocator import SYSTEM_DEFAULT_ALLOCATOR

TIMINGS = ("roofline", "measured")
#: Bumped when the measuring method changes what a time means (old tables then miss).
TABLE_FORMAT = "slackswap.op_times/6"


class MeasurementError(SlackSwapError):
    """A measurement that cannot be made: one line naming the op or the device."""


@dataclass(frozen=True)
class OpTimeKey:
    """What an op-time table's times depend on; two tables with equal keys time the same ops."""

    graph_fingerprint: str
    model_signature: str
    #: [[shape, dtype], ...] of the step's tensor inputs (`slackswap.runtime.capture.input_signature`).
    input_signature: tuple[tuple[tuple[int, ...], str], ...]
    #: "cpu", "cuda:0 NVIDIA H200", ...: the device and, on CUDA, its name.
    device: str
    #: python, slackswap, torch, transformers versions (`slackswap.versions.package_versions`).
    versions: Mapping[str, str]
    #: "perf_counter" (CPU) or "cuda_events".
    method: str
    #: torch's intra-op threads when measured (`torch.get_num_threads()`): on the CPU an op's time is its
    #: kernel on that many threads (hf_gpt2_2l's plain step 12 ms on 2, 16 ms on 1), so a table measured on
    #: one count predicts nothing on another.
    intra_op_threads: int
    #: How the host allocator ran (`slackswap.profile.host_allocator.host_allocator_label`): with glibc's
    #: defaults a step takes page faults at random, with freed memory kept it does not, and the op times
    #: differ by them.
    host_allocator: str = SYSTEM_DEFAULT_ALLOCATOR
    format: str = TABLE_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {"graph_fingerprint": self.graph_fingerprint, "model_signature": self.model_signature,
                "input_signature": [[list(s), dt] for s, dt in self.input_signature], "device": self.device,
                "versions": dict(self.versions), "method": self.method, "intra_op_threads": self.intra_op_threads,
                "host_allocator": self.host_allocator, "format": self.format}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OpTimeKey:
        d = dict(d)
        d["input_signature"] = tuple((tuple(s), dt) for s, dt in d["input_signature"])
        d["versions"] = dict(d["versions"])
        return cls(**d)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class OpTime:
    """One op's time over the measured repeats (seconds): the median is what the graph takes."""

    median_s: float
    min_s: float
    max_s: float
    repeats: int


@dataclass(frozen=True)
class RuntimeHostCost:
    """Host seconds the eager runtime's hook-only step spends beyond its ops' in-context times, measured
    once per machine by `slackswap.runtime.eager.host_cost` (never from a plan's step): per saved-tensor
    event (pack or unpack) of a plan that is not idle, apart for the events of a tensor the plan
    recomputes and of one it does not; per recompute step and per ATen call it replays;
    per copy of a swap; per step of the runtime's context; and what the profile's plain steps hold that
    an idle plan's step does not (`profile_hook_per_event_s`)."""

    #: Per event of a tensor the plan does not recompute (kept, swapped, or no graph tensor: a weight, an
    #: input), beyond the profile's pass-through hook, which the op times hold.
    hook_per_event_s: float = 0.0
    replay_per_step_s: float = 0.0
    replay_per_call_s: float = 0.0
    #: Per copy (offload or reload) of a swap, beyond the copy's own time (`Machine.copy_s`) and the hook
    #: events: the runtime's bookkeeping and the host buffer's lookup.
    per_copy_s: float = 0.0
    #: Per step of any plan run by the runtime, against a plain step without any hook: its context
    #: (entering and leaving the run, the model's input check, the step's report), measured on an idle plan.
    context_per_step_s: float = 0.0
    #: Per saved-tensor event, what the profile's pass-through hook adds to its plain steps' op times
    #: (`slackswap.runtime.op_times`): an idle plan's step runs no hook, so its prediction takes it off.
    profile_hook_per_event_s: float = 0.0
    #: Per event of a tensor the plan recomputes, beyond the pass-through hook: the pack keeps a number
    #: instead of the tensor, the unpack hands autograd another tensor than it saved (the replay's).
    recompute_hook_per_event_s: float = 0.0
    #: Per call of a module without children in a recomputing plan's step: the check that the step calls
    #: the verified step's modules (`slackswap.runtime.eager.module_calls`; its per-step read of the modules'
    #: numbers spread over the calls).
    module_check_per_call_s: float = 0.0
    source: str = ""


@dataclass(frozen=True)
class ExportHostCost:
    """Host seconds the eager export's step spends beyond its ops' in-context times and the replay's ops,
    measured once per machine (never from a plan's step): per ATen call through the SAC dispatch modes
    (`slackswap.runtime.export.dispatch_cost`), and the non-reentrant checkpoint's own work per region and
    per saved tensor (`slackswap.runtime.export.checkpoint_cost`)."""

    sac_per_call_s: float = 0.0
    checkpoint_per_region_s: float = 0.0
    checkpoint_per_saved_s: float = 0.0
    source: str = ""


def _stored_cost(cls: type, stored: Mapping[str, Any]) -> Any:
    """A host cost (`RuntimeHostCost`, `ExportHostCost`) as a cached table stores it, every field present:
    their fields default to 0 s, so one stored before a field was measured would read as free. A missing
    field is a KeyError naming it, which `read_table` turns into one line and a table measured again."""
    missing = [f.name for f in fields(cls) if f.name not in stored]
    if missing:
        raise KeyError(f"{cls.__name__} lacks {', '.join(missing)}")
    return cls(**stored)


@dataclass(frozen=True)
class OpTimeTable:
    key: OpTimeKey
    times: Mapping[str, OpTime]
    warmup: int
    repeats: int
    #: Median wall time of the plain step (forward, loss, backward) without the timer, and its spread.
    step_median_s: float
    step_min_s: float
    step_max_s: float
    #: The timer's own cost per ATen call, taken off each op's time (module docstring of op_times).
    timer_overhead_per_call_s: float = 0.0
    #: Median time after the last ATen call of the step (backward's return): in no op.
    unattributed_s: float = 0.0
    #: Ops that could not be timed, one line each ("op12:aten.bmm.default: <why>").
    failed: tuple[str, ...] = ()
    notes: Mapping[str, Any] = field(default_factory=dict)
    #: The eager runtime's own host costs on this machine (`RuntimeHostCost`); None when not measured.
    runtime_host: RuntimeHostCost | None = None
    #: The eager export's own host costs on this machine (`ExportHostCost`); None when not measured.
    export_host: ExportHostCost | None = None
    #: Per op name: median seconds of the eager runtime's replay of that op in profiling steps of this
    #: model (`slackswap.runtime.eager.replay_times`, measured on the CPU with the op times); a prediction
    #: prices a recompute step of the op at it. None: not measured (a GPU's table, or one cached before
    #: replays were timed: `replay_refusal`); empty: measured, no op replayed (`notes["replay_source"]`).
    replay_times: Mapping[str, float] | None = None
    #: Per tensor name: median seconds of the eager runtime's inline CPU offload and of one prefetch of it,
    #: (d2h, h2d), in profiling steps of this model (`slackswap.runtime.eager.copy_times`, measured on the
    #: CPU with the op times); a prediction prices the tensor's copies at them. None: not measured (a GPU's
    #: table, or one cached before copies were timed: `copy_refusal`); empty: measured, none offloaded.
    copy_times: Mapping[str, tuple[float, float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key.to_dict(), "warmup": self.warmup, "repeats": self.repeats,
            "step_median_s": self.step_median_s, "step_min_s": self.step_min_s, "step_max_s": self.step_max_s,
            "timer_overhead_per_call_s": self.timer_overhead_per_call_s, "unattributed_s": self.unattributed_s,
            "failed": list(self.failed), "notes": dict(self.notes),
            "runtime_host": None if self.runtime_host is None else asdict(self.runtime_host),
            "export_host": None if self.export_host is None else asdict(self.export_host),
            "replay_times": None if self.replay_times is None else dict(self.replay_times),
            "copy_times": None if self.copy_times is None else {k: list(v) for k, v in self.copy_times.items()},
            "times": {name: asdict(t) for name, t in self.times.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OpTimeTable:
        d = dict(d)
        key = OpTimeKey.from_dict(d.pop("key"))
        times = MappingProxyType({name: OpTime(**t) for name, t in d.pop("times").items()})
        host = d.pop("runtime_host", None)
        d["runtime_host"] = None if host is None else _stored_cost(RuntimeHostCost, host)
        export = d.pop("export_host", None)
        d["export_host"] = None if export is None else _stored_cost(ExportHostCost, export)
        for old in ("sac_dispatch_per_call_s", "sac_dispatch_source"):  # tables cached before export_host
            d.pop(old, None)
        replay = d.pop("replay_times", None)  # absent from a table cached before replays were timed: None
        d["replay_times"] = None if replay is None else MappingProxyType({k: float(v) for k, v in replay.items()})
        copies = d.pop("copy_times", None)  # absent from a table cached before copies were timed: None
        d["copy_times"] = None if copies is None else MappingProxyType(
            {k: (float(d2h), float(h2d)) for k, (d2h, h2d) in copies.items()})
        return cls(key=key, times=times, failed=tuple(d.pop("failed", ())),
                   notes=MappingProxyType(dict(d.pop("notes", {}))), **d)

    @property
    def measured_sum_s(self) -> float:
        return sum(t.median_s for t in self.times.values())


#: Highest 1-minute load average per CPU at which a cached measurement (an op-time table, a machine
#: description of measured links) is reused. Above it (or with no load recorded) it is measured again:
#: a table's op times carry its load (the timer's cost taken off each op is measured next to the step),
#: and on this project's 2-core machine hf_gpt2_2l's table measured at load 1.0 (0.5 per CPU) predicted
#: its step at -8 to -10 % while one measured during a package install predicted -28 % (docs/profile.md,
#: "The table"). A machine description's copy times carry their load alike (docs/profile.md, "Links").
MAX_REUSE_LOAD_PER_CPU = 0.5


def measured_load() -> dict[str, Any]:
    """The machine's load now, as a cached measurement records it beside its figures (`load_refusal`
    reads it back): the 1-minute load average and the CPU count."""
    return {"load_average_1min": os.getloadavg()[0], "cpu_count": os.cpu_count()}


def load_text(notes: Mapping[str, Any]) -> str:
    """"load 0.62 on 2 CPUs" from a measurement's `measured_load` notes ("an unrecorded load" without)."""
    load, cpus = notes.get("load_average_1min"), notes.get("cpu_count")
    if not isinstance(load, int | float) or load != load or not isinstance(cpus, int) or cpus < 1:
        return "an unrecorded load"
    return f"load {load:.2f} on {cpus} CPUs"


def load_refusal(artefact: str, notes: Mapping[str, Any]) -> str | None:
    """Why the cached `artefact` ("op-time table <digest>", "machine description <file>") must be measured
    again rather than reused (one line), or None to reuse it: its `notes` (`measured_load`) say it was
    measured at a 1-minute load per CPU above `MAX_REUSE_LOAD_PER_CPU`, or at an unrecorded load."""
    load, cpus = notes.get("load_average_1min"), notes.get("cpu_count")
    if not isinstance(load, int | float) or not isinstance(cpus, int) or cpus < 1 or load != load:
        return f"cached {artefact} has no recorded load: measuring it again"
    if load / cpus > MAX_REUSE_LOAD_PER_CPU:
        return (f"cached {artefact} was measured at load {load:.2f} on {cpus} CPUs ({load / cpus:.2f} "
                f"per CPU > {MAX_REUSE_LOAD_PER_CPU}): measuring it again")
    return None


#: Largest relative gap between the sum of an op-time table's op medians and the median of its own plain
#: steps (measured alternately with the timed ones) at which its op times are taken for the step's. The
#: timer's cost is taken off each op so that they add up (`slackswap.runtime.op_times`): on the 2-core
#: machine at load up to 1.3 they came within -10 % (torch's 2 threads) and -2 % (one thread). With torch's
#: 2 threads and one core busy with other work they came to -39 % and -66 % (hf_gpt2_2l, sum 14.7 and 9.5
#: ms against plain steps of 24.1 and 28.1 ms): the workers wait for a core at every parallel region, the
#: plain steps more than the timed ones, and the prediction from such a table read -61 to -86 %.
TABLE_SUM_TOLERANCE = 0.20


def sum_gap(table: OpTimeTable) -> float:
    """(sum of op medians - plain step median) / plain step median: negative when the ops add up short."""
    return (table.measured_sum_s - table.step_median_s) / table.step_median_s


def sum_refusal(table: OpTimeTable) -> str | None:
    """Why `table`'s op times are not its step's (one line), or None: their medians add up to more than
    `TABLE_SUM_TOLERANCE` away from its own plain step. A prediction from it is still made and printed
    with this line beside it; a cached one is measured again (`reuse_refusal`)."""
    gap = sum_gap(table)
    if abs(gap) <= TABLE_SUM_TOLERANCE:
        return None
    threads = table.key.intra_op_threads
    cpus = table.notes.get("cpu_count")
    why = (f"op-time table {table.key.digest()}: its op times add up to {table.measured_sum_s * 1e3:.2f} ms, its "
           f"plain step measured {table.step_median_s * 1e3:.2f} ms ({gap * 100:+.0f} %, over "
           f"{TABLE_SUM_TOLERANCE * 100:.0f} %): the ops' times are not the step's, measured at "
           f"{load_text(table.notes)} on torch's {threads} intra-op thread{'s' if threads != 1 else ''}")
    if threads > 1 and isinstance(cpus, int) and threads >= cpus:
        return why + ("; other work takes the cores its threads wait for: fewer threads (OMP_NUM_THREADS) or a "
                      "quieter machine")
    return why + "; other work takes the core it runs on: a quieter machine"


def reuse_refusal(table: OpTimeTable) -> str | None:
    """Why a cached op-time table is measured again rather than reused: `load_refusal`, or op times that
    do not add up to its own plain step (`sum_refusal`); None to reuse it."""
    refusal = load_refusal(f"op-time table {table.key.digest()}", table.notes)
    if refusal is None and sum_refusal(table) is not None:
        refusal = (f"cached op-time table {table.key.digest()}'s op times add up to {sum_gap(table) * 100:+.0f} % "
                   "of its plain step: measuring it again")
    return refusal


def replay_refusal(table: OpTimeTable) -> str | None:
    """Why a cached CPU table is measured again rather than reused by a run that prices recompute steps at
    the ops' replay times (`slackswap.runtime.op_times.cached_op_times` with a `replay_plan`): it has none,
    cached before replays were timed. None when it has them. A prediction never reads their absence as
    zeros: it would price every recompute step at the microbenchmark's cost without saying so."""
    if table.replay_times is None:
        return f"cached op-time table {table.key.digest()} has no replay times of its ops: measuring it again"
    return None


def copy_refusal(table: OpTimeTable) -> str | None:
    """Why a cached CPU table is measured again rather than reused by a run that prices copies at the
    tensors' in-step copy times (`slackswap.runtime.op_times.cached_op_times` with a `copy_plan`): it has
    none, cached before copies were timed. None when it has them."""
    if table.copy_times is None:
        return f"cached op-time table {table.key.digest()} has no copy times of its tensors: measuring it again"
    return None


def cache_line(artefact: str, cached: bool, notes: Mapping[str, Any], cache_dir: str | Path | None) -> str:
    """The run's one line for one cached measurement: reused (at the load it was measured at), measured
    again (why: `notes["remeasured_because"]`), or measured now (none cached, or no cache)."""
    if cached:
        return f"cached {artefact} reused (measured at {load_text(notes)})"
    why = notes.get("remeasured_because")
    if why:
        return f"{why} (now at {load_text(notes)})"
    where = "none cached" if cache_dir is not None else "no cache (profile.cache_dir is empty)"
    return f"{artefact} measured now at {load_text(notes)}: {where}"


def read_cached_json(path: Path, artefact: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the mapping stored at `path`, None); (None, None) when there is no file; (None, one line saying
    why) when the file cannot be read or is not a JSON mapping: the caller measures again, never uses part
    of it."""
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return None, f"cached {artefact} ({path.name}) cannot be read ({first}): measuring it again"
    if not isinstance(data, dict):
        return None, f"cached {artefact} ({path.name}) is not a JSON mapping: measuring it again"
    return data, None


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> Path:
    """Write `data` to `path` through a temporary file and a rename: a sweep's concurrent jobs never read
    half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


def table_path(key: OpTimeKey, cache_dir: str | Path) -> Path:
    return Path(cache_dir) / f"{key.digest()}.json"


def save_table(table: OpTimeTable, cache_dir: str | Path) -> Path:
    return write_json_atomic(table_path(table.key, cache_dir), table.to_dict())


def read_table(key: OpTimeKey, cache_dir: str | Path) -> tuple[OpTimeTable | None, str | None]:
    """(the cached table of exactly `key`, None); (None, None) when none is cached (another version, shape
    or device is another file); (None, one line saying why) when a file is there but cannot be used: it
    does not parse as a table, or its stored key differs from `key`."""
    path = table_path(key, cache_dir)
    artefact = f"op-time table {key.digest()}"
    data, why = read_cached_json(path, artefact)
    if data is None:
        return None, why
    try:
        table = OpTimeTable.from_dict(data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, (f"cached {artefact} ({path.name}) is not an op-time table ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else 'bad field'}): measuring it again")
    if table.key != key:
        return None, f"cached {artefact} ({path.name}) stores another key: measuring it again"
    return table, None


def load_table(key: OpTimeKey, cache_dir: str | Path) -> OpTimeTable | None:
    """The cached table of exactly `key`, or None (`read_table` says why a file there is not used)."""
    return read_table(key, cache_dir)[0]


@dataclass(frozen=True)
class TimingSources:
    """How many ops of a re-timed graph each source timed; `roofline_ops` names the fallbacks."""

    measured: int
    roofline: int
    roofline_ops: tuple[str, ...] = ()

    def line(self) -> str:
        shown = ", ".join(self.roofline_ops[:3]) + (" ..." if len(self.roofline_ops) > 3 else "")
        tail = f" ({shown})" if self.roofline_ops else ""
        return f"op times: {self.measured} measured, {self.roofline} roofline fallback{tail}"


def retime(graph: Graph, table: OpTimeTable) -> tuple[Graph, TimingSources]:
    """`graph` with every op the table times at its median; the others keep their roofline duration.
    A table of another graph (fingerprint) is refused: its op names would mean other ops."""
    if table.key.graph_fingerprint != graph.fingerprint:
        raise MeasurementError(f"op-time table is for graph {table.key.graph_fingerprint}, "
                               f"not {graph.name} ({graph.fingerprint})")
    ops, fallback = [], []
    for op in graph.ops:
        t = table.times.get(op.name)
        if t is None:
            fallback.append(op.name)
            ops.append(op)
        else:
            ops.append(replace(op, duration_s=t.median_s))
    meta = dict(graph.meta) | {"timing": "measured", "op_times": table.key.digest(),
                               "op_times_device": table.key.device}
    retimed = Graph(name=graph.name, ops=tuple(ops), tensors=graph.tensors, num_layers=graph.num_layers,
                    weight_bytes=graph.weight_bytes, weight_grad_bytes=graph.weight_grad_bytes,
                    optimizer_state_bytes=graph.optimizer_state_bytes, meta=meta)
    return retimed, TimingSources(len(ops) - len(fallback), len(fallback), tuple(fallback))
