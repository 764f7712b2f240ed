"""Time every op of a captured step on the device the model lives on (`profile.timing=measured`).

The ops are the capture's (`slackswap.runtime.capture`): every ATen call of the step in order, named
``op{k}:{overload}`` by `slackswap.runtime.op_numbering` (an in-place call on the current op's own
output joins that op). The timer is a dispatch mode that runs the plain step (forward, loss,
backward: what `slackswap.runtime.train` times as a step) and stamps the clock after every call. An
op's time is *in context*: from the end of the call before it to the end of its last call. That is
the kernel plus the host work that leads to it (module code, autograd), which is what a step of
these ops costs and what a recompute of the op costs again; timing each op alone on copied inputs
would leave the host work out, and on the CPU at small shapes that is a large part of the step.

The timer costs host time itself. Its cost per call is measured (the calling thread's CPU time in a
step under the timer minus that in the plain step next to it, median over the pairs, over the number
of calls: neither other load nor intra-op worker threads add to it) and taken off each op's gap
(never below zero), so that the ops of a step add up to the plain step. Warm-up steps first, then
`repeats` steps; each op keeps its median, min and max. The step must make the capture's calls: a
different count, or a call whose overload is not the one the op is named after, is a
`MeasurementError` naming the op; so is a call that fails (its number, overload and the device).

CPU: `time.perf_counter_ns` (`clock="wall"`), or `time.process_time_ns` (`clock="process"`: the CPU
time of this process, which waiting for a core shared with other load does not add to; with one
intra-op thread, the wall time the step would take on a quiet machine); every op is synchronous
there. CUDA: an event recorded after every call and read after the step's synchronize
(`torch.cuda.Event(enable_timing=True)`), so an op's time is the GPU timeline's end-to-end interval,
idle launch gaps included. The CUDA path is written but was never run in this repository's tests
(no GPU): docs/profile.md says so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slackswap.graph import Graph
from slackswap.plan import Plan
from slackswap.profile.host_allocator import host_allocator_label
from slackswap.profile.measured import (
    MeasurementError,
    OpTime,
    OpTimeKey,
    OpTimeTable,
    copy_refusal,
    measured_load,
    read_table,
    replay_refusal,
    retime,
    reuse_refusal,
    save_table,
)
from slackswap.runtime.op_numbering import call_number
from slackswap.versions import package_versions

#: CPU clocks (module docstring): nanoseconds since an arbitrary origin.
CLOCKS = {"wall": time.perf_counter_ns, "process": time.process_time_ns}


class _Clock:
    """Marks on the device's timeline: `mark()` during the step, `seconds()` after it (sorted order)."""

    def __init__(self, device: torch.device, clock: str = "wall"):
        self.cuda = device.type == "cuda"
        self.device = device
        self.now_ns = CLOCKS[clock]
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(self.now_ns())

    def seconds(self) -> list[float]:
        """Seconds of each mark after the first."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            first = self.marks[0]
            return [first.elapsed_time(e) / 1e3 for e in self.marks]
        return [(m - self.marks[0]) / 1e9 for m in self.marks]


class _Timer(TorchDispatchMode):
    """Records, per ATen call, its overload and a clock mark just after it."""

    def __init__(self, clock: _Clock):
        super().__init__()
        self.clock = clock
        self.funcs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
        except Exception as exc:  # one line naming the op (its call number and overload) and the device
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise MeasurementError(f"op{len(self.funcs)}:{func} failed on {self.clock.device}: {why}") from None
        self.clock.mark()
        self.funcs.append(str(func))
        return out


@dataclass
class _Run:
    funcs: list[str]
    #: Per call: seconds from the step's start to just after it; then the step's end.
    after_s: list[float]
    end_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def as_captured():
    """Saved-tensor hooks that hand autograd its tensor back: with hooks installed autograd saves a
    tensor without the `detach` call it makes otherwise, so the step makes exactly the capture's (and
    the runtime's, which also saves through hooks) ATen calls."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _plain_step(model, inputs, loss_fn, device, context, clock: str) -> tuple[float, float]:
    """(seconds on `clock`, CPU seconds of this thread)."""
    now_ns = CLOCKS[clock]
    _sync(device)
    t0, c0 = now_ns(), time.thread_time_ns()
    with context():
        loss_fn(model(*inputs)).backward()
    _sync(device)
    return (now_ns() - t0) / 1e9, (time.thread_time_ns() - c0) / 1e9


def plain_step_times(model: torch.nn.Module, inputs: Sequence[object], loss_fn: Callable[[object], torch.Tensor],
                     steps: int, clock: str = "wall") -> list[float]:
    """Seconds of `steps` plain steps, timed as the table's plain steps are (same hooks, same clock); the
    RNG state and the gradients are left as they were. What a run re-measures after its plan's steps."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    params = list(model.parameters())
    grads = [p.grad for p in params]
    times = []
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        for _ in range(steps):
            for p in params:
                p.grad = None
            times.append(_plain_step(model, inputs, loss_fn, device, as_captured, clock)[0])
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return times


def _timed_step(model, inputs, loss_fn, device, context, clock_name: str) -> tuple[_Run, float, float]:
    """(the calls and their marks, seconds on the clock, CPU seconds of this thread)."""
    clock = _Clock(device, clock_name)
    _sync(device)
    t0, c0 = clock.now_ns(), time.thread_time_ns()
    clock.mark()
    with context(), _Timer(clock) as timer:  # the timer on top: it sees the model's calls only
        loss_fn(model(*inputs)).backward()
    clock.mark()
    _sync(device)
    wall, cpu = (clock.now_ns() - t0) / 1e9, (time.thread_time_ns() - c0) / 1e9
    s = clock.seconds()
    return _Run(timer.funcs, s[1:-1], s[-1]), wall, cpu


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    return str(device)


def op_time_key(graph: Graph, device: torch.device, clock: str = "wall") -> OpTimeKey:
    """The key of `graph` (a capture's: its meta has the model and input signatures) timed on `device`."""
    meta = graph.meta
    missing = [k for k in ("model_signature", "input_signature", "aten_calls") if k not in meta]
    if missing:
        raise MeasurementError(f"graph {graph.name}: not a captured step (meta lacks {missing[0]}); "
                               "measured op times need slackswap.runtime.capture_graph")
    signature = tuple((tuple(shape), dtype) for shape, dtype in meta["input_signature"])
    return OpTimeKey(graph_fingerprint=graph.fingerprint, model_signature=str(meta["model_signature"]),
                     input_signature=signature, device=device_label(device),
                     versions=package_versions(("torch", "transformers")),
                     method="cuda_events" if device.type == "cuda" else
                     {"wall": "perf_counter", "process": "process_time"}[clock],
                     intra_op_threads=torch.get_num_threads(), host_allocator=host_allocator_label())


def _op_of_call(graph: Graph, calls: int) -> list[int]:
    """Per ATen call of the step, the index of the graph op it belongs to."""
    starts = {call_number(op.name): i for i, op in enumerate(graph.ops)}
    if 0 not in starts:
        raise MeasurementError(f"graph {graph.name}: its first op is not call 0 ({graph.ops[0].name})")
    owner, current = [], 0
    for k in range(calls):
        current = starts.get(k, current)
        owner.append(current)
    return owner


def _check_calls(graph: Graph, run: _Run) -> None:
    expected = int(graph.meta["aten_calls"])
    if len(run.funcs) != expected:
        raise MeasurementError(f"device step made {len(run.funcs)} ATen calls, the captured graph "
                               f"{graph.name} has {expected}: not the captured step")
    for op in graph.ops:
        k = call_number(op.name)
        if run.funcs[k] != op.name.split(":", 1)[1]:
            raise MeasurementError(f"op {op.name}: the device step's call {k} is {run.funcs[k]}")


def measure_op_times(
    graph: Graph,
    model: torch.nn.Module,
    inputs: Sequence[object],
    loss_fn: Callable[[object], torch.Tensor],
    warmup: int = 2,
    repeats: int = 5,
    clock: str = "wall",
    replay_plan: Callable[[Graph], Plan] | None = None,
    copy_plan: Callable[[Graph], Plan] | None = None,
) -> OpTimeTable:
    """Time every op of `graph` (captured from this model and inputs) on the model's device (module
    docstring; `clock`: the CPU's, "wall" or "process"). The RNG state and the gradients are left as
    they were. `replay_plan` (the CPU only; the caller's full-recompute plan of the re-timed graph: the
    planners are a layer above): after the plain steps, the runtime's replay of every op it recomputes is
    timed on the same clock in profiling steps of the model (`slackswap.runtime.eager.replay_times`) and
    kept per op (`OpTimeTable.replay_times`); on a GPU the runtime's host work overlaps the kernels and
    nothing is timed. `copy_plan` (the CPU only; the caller's plan that offloads every saved tensor it
    can): the runtime's inline copies of each offloaded tensor are timed alike
    (`slackswap.runtime.eager.copy_times`, `OpTimeTable.copy_times`)."""
    context = as_captured
    if warmup < 0 or repeats < 1:
        raise MeasurementError(f"warmup={warmup}, repeats={repeats}: need warmup >= 0 and repeats >= 1")
    if clock not in CLOCKS:
        raise MeasurementError(f"clock {clock!r}: unknown; known: {sorted(CLOCKS)}")
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MeasurementError(f"device {device}: no CUDA device is visible to this torch build")
    key = op_time_key(graph, device, clock)
    owner = _op_of_call(graph, int(graph.meta["aten_calls"]))
    devices = [device.index or 0] if device.type == "cuda" else []
    plain, timed, runs, cpu_cost = [], [], [], []
    with torch.random.fork_rng(devices=devices):
        for i in range(warmup + repeats):
            for p in model.parameters():
                p.grad = None
            # Timed first (a call that fails is named by the timer), then plain: alternating, so that
            # drift (other load, clocks) touches both alike.
            run, wall, timed_cpu = _timed_step(model, inputs, loss_fn, device, context, clock)
            if i == 0:
                _check_calls(graph, run)
            for p in model.parameters():
                p.grad = None
            plain_s, plain_cpu = _plain_step(model, inputs, loss_fn, device, context, clock)
            if i >= warmup:
                plain.append(plain_s)
                timed.append(wall)
                runs.append(run)
                cpu_cost.append(timed_cpu - plain_cpu)
    for p in model.parameters():
        p.grad = None
    calls = len(owner)
    # The timer's cost per call: the CPU time of this thread in a timed step over that of the plain
    # step next to it (median over the pairs), spread over the calls. CPU time of the thread that runs
    # the step and the timer: waiting for a core shared with other load, and intra-op worker threads,
    # add nothing to it. The step's own calls, not a loop of cheap ones: what a call costs the timer
    # grows with its arguments.
    overhead = max(0.0, statistics.median(cpu_cost) / calls)
    per_op: list[list[float]] = [[0.0] * len(runs) for _ in graph.ops]
    tails = []
    for r, run in enumerate(runs):
        previous = 0.0
        for k in range(calls):
            per_op[owner[k]][r] += max(0.0, run.after_s[k] - previous - overhead)
            previous = run.after_s[k]
        tails.append(max(0.0, run.end_s - previous))
    times = {op.name: OpTime(statistics.median(v), min(v), max(v), len(v)) for op, v in zip(graph.ops, per_op,
                                                                                            strict=True)}
    table = OpTimeTable(key=key, times=times, warmup=warmup, repeats=repeats, step_median_s=statistics.median(plain),
                       step_min_s=min(plain), step_max_s=max(plain), timer_overhead_per_call_s=overhead,
                       unattributed_s=statistics.median(tails),
                       notes={"timed_step_median_s": statistics.median(timed), "aten_calls": calls,
                              **measured_load()})
    if device.type != "cpu" or (replay_plan is None and copy_plan is None):
        return table
    timed_graph, _ = retime(graph, table)
    if replay_plan is not None:
        from slackswap.runtime.eager.replay_times import measure_replay_times

        replays, source = measure_replay_times(timed_graph, replay_plan(timed_graph), model, inputs, loss_fn,
                                               CLOCKS[clock], warmup, repeats)
        table = replace(table, replay_times=replays, notes=dict(table.notes) | {"replay_source": source})
    if copy_plan is not None:
        from slackswap.runtime.eager.copy_times import measure_copy_times

        copies, source = measure_copy_times(timed_graph, copy_plan(timed_graph), model, inputs, loss_fn,
                                            CLOCKS[clock], warmup, repeats)
        table = replace(table, copy_times=copies, notes=dict(table.notes) | {"copy_source": source})
    return table


def cached_op_times(
    graph: Graph,
    model: torch.nn.Module,
    inputs: Sequence[object],
    loss_fn: Callable[[object], torch.Tensor],
    cache_dir: str | Path | None,
    warmup: int = 2,
    repeats: int = 5,
    clock: str = "wall",
    replay_plan: Callable[[Graph], Plan] | None = None,
    copy_plan: Callable[[Graph], Plan] | None = None,
) -> tuple[OpTimeTable, bool]:
    """(table, True when it came from `cache_dir`): measured once per key, reused by later runs unless
    it was measured under load (`slackswap.profile.measured.reuse_refusal`) or the file there cannot be
    used (`read_table`: it does not parse, or stores another key); then it is measured again, and the
    new table's `notes["remeasured_because"]` says why (the run prints it:
    `slackswap.profile.measured.cache_line`). With `replay_plan` (`measure_op_times`), a cached CPU table
    without replay times is measured again too (`replay_refusal`), and with `copy_plan` one without copy
    times (`copy_refusal`)."""
    why = None
    if cache_dir is not None:
        device = next(model.parameters()).device
        found, why = read_table(op_time_key(graph, device, clock), cache_dir)
        if found is not None:
            why = reuse_refusal(found)
            if why is None and replay_plan is not None and device.type == "cpu":
                why = replay_refusal(found)
            if why is None and copy_plan is not None and device.type == "cpu":
                why = copy_refusal(found)
            if why is None:
                return found, True
    table = measure_op_times(graph, model, inputs, loss_fn, warmup, repeats, clock, replay_plan, copy_plan)
    if why is not None:
        table = replace(table, notes=dict(table.notes) | {"remeasured_because": why})
    if cache_dir is not None:
        save_table(table, cache_dir)
    return table, False
