"""Predict a plan's step on the machine at hand, to set beside the step measured there.

On a GPU the simulator already models the machine: ops on the compute stream, copies on their own
engines over the (measured) link. On the CPU the "device" and the host are one memory and the
runtime copies synchronously on the compute thread (`slackswap.runtime.copy_engines.CpuCopies`), so
nothing overlaps: the predicted step is the plan simulated on an instant link (its ops and
recomputes, every copy arrived when issued) plus each copy's measured time (`Machine.copy_s`:
latency + bytes / bandwidth). Nothing is skipped and nothing is fitted to the step it predicts.

With `host` (the machine's `RuntimeHostCost`, measured once by `slackswap.runtime.eager.host_cost`), the
eager runtime's own host work is added where its hook-only step makes it (`runtime_host_s`, counted
from the graph and the plan): every plan runs in the runtime's context once a step; a plan that is not
idle passes every saved tensor through the runtime's pack hook and every read-back through its unpack
hook (the capture's counts, `saved_tensor_packs` / `saved_tensor_unpacks`), priced apart for the
tensors it recomputes (the capture's events per tensor, `SAVED_EVENTS_BY_TENSOR_KEY`: their unpack
hands autograd another tensor than it saved, made by the replay) and the rest; each recompute step
replays its op's ATen calls from Python, and each copy of a swap costs its bookkeeping beyond the
copy's own time. An idle plan (keeps everything, moves nothing) runs no hook, where the profile's
plain steps ran a pass-through one on every event (`slackswap.runtime.op_times`): its prediction takes
that hook off.

With `replay_times` (the op-time table's: each op's replay by the runtime timed in profiling steps of
the model itself, `slackswap.runtime.eager.replay_times`), a recompute step of an op that has one is
priced at that replay time less the op's in-context time (which the simulator already counts for the
recompute), instead of the microbenchmark's a + b x calls: the microbenchmark's small blocks stay in
cache, where a real model's replay in backward reads data its forward left colder, and its calls'
arguments are small. A recompute step of an op without a replay time falls back to the
microbenchmark; both are counted (`Prediction.replay_timed_steps`, `replay_fallback_steps`).

With `copy_times` (the op-time table's: each offloaded tensor's inline copies timed in profiling steps
of the model itself, `slackswap.runtime.eager.copy_times`), a copy of a tensor that has one is priced at
it instead of the machine description's copy curve, which times copies on buffers that stay in the
caches (in a step they cost 0.8-3.1x that on the measured-profile benchmark's models, and 0.88-1.12x the
copy times); both are counted (`Prediction.copy_timed`, `copy_curve`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slackswap.graph import LEAF_MODULE_CALLS_KEY, Graph, saved_tensor_events
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan, StepKind
from slackswap.profile.machine import Machine
from slackswap.profile.measured import RuntimeHostCost


@dataclass(frozen=True)
class Prediction:
    step_s: float
    #: The simulator's step (on an instant link where copies are synchronous).
    simulated_s: float
    #: Seconds of synchronous copies added to it (0 where copies overlap compute).
    sync_copy_s: float
    copies: int
    #: Seconds of the eager export's selective-checkpoint dispatch added to it (`predict_export`; 0 otherwise).
    dispatch_s: float = 0.0
    #: Seconds of the eager export's non-reentrant checkpoints' own work added to it (`predict_export`).
    checkpoint_s: float = 0.0
    #: Seconds of the views the eager export's replays run again, at their op times (`predict_export`).
    replayed_views_s: float = 0.0
    #: Seconds of the eager runtime's own host work added to it (`runtime_host_s`; 0 without `host`).
    runtime_host_s: float = 0.0
    #: Recompute steps priced at their op's measured replay time, and those priced by the microbenchmark
    #: (no replay time for their op), where the runtime's host work is added (the CPU); 0 elsewhere.
    replay_timed_steps: int = 0
    replay_fallback_steps: int = 0
    #: Copies priced at their tensor's in-step copy time (`copy_times`), and those priced by the machine
    #: description's copy curve (no copy time for their tensor), where copies are synchronous; 0 elsewhere.
    copy_timed: int = 0
    copy_curve: int = 0


@dataclass(frozen=True)
class RuntimeHostCounts:
    """What a plan's hook-only step does that its ops' times do not hold (module docstring)."""

    #: Saved-tensor events (packs and unpacks) of tensors the plan does not recompute (kept, swapped, or
    #: no graph tensor), for a plan that is not idle.
    hook_events: int
    #: Recompute steps priced by the microbenchmark (`replay_per_step_s`): those of an op without a
    #: measured replay time (every one without replay times), and the ATen calls they replay.
    recompute_steps: int
    replayed_calls: int
    copies: int = 0
    #: Steps of the runtime's context: 1 (every plan runs in it, an idle one with no hook).
    context_steps: int = 1
    #: Events of the profile's pass-through hook the step does not make (an idle plan's: every event).
    profile_hook_events: int = 0
    #: Recompute steps of an op with a measured replay time, and the sum over them of replay time less the
    #: op's in-context time (negative where a replay costs less than the op did in its forward).
    replay_timed_steps: int = 0
    replay_timed_excess_s: float = 0.0
    #: Saved-tensor events of tensors the plan recomputes.
    recompute_events: int = 0
    #: Calls of modules without children a recomputing plan's step checks (the graph's `leaf_module_calls`).
    module_checks: int = 0

    def seconds(self, host: RuntimeHostCost) -> float:
        return (self.replay_timed_excess_s
                + self.hook_events * host.hook_per_event_s
                + self.recompute_events * host.recompute_hook_per_event_s
                + self.recompute_steps * host.replay_per_step_s
                + self.replayed_calls * host.replay_per_call_s + self.copies * host.per_copy_s
                + self.context_steps * host.context_per_step_s
                + self.module_checks * host.module_check_per_call_s
                - self.profile_hook_events * host.profile_hook_per_event_s)


def runtime_host_counts(graph: Graph, plan: Plan, replay_times: Mapping[str, float] | None = None
                        ) -> RuntimeHostCounts:
    """Hook events (of tensors recomputed and of the rest), recompute steps and replayed ATen calls of
    `plan`'s hook-only step on `graph`, and its one step of the runtime's context; for an idle plan, the
    profile's pass-through hook events it does not make instead of events. With `replay_times`, a
    recompute step of an op that has one is counted apart with its replay time less the op's duration on
    `graph` (module docstring)."""
    steps = [s for s in plan.steps if s.kind == StepKind.RECOMPUTE]
    events = int(graph.meta.get("saved_tensor_packs", 0)) + int(graph.meta.get("saved_tensor_unpacks", 0))
    if plan.idle:
        return RuntimeHostCounts(0, 0, 0, profile_hook_events=events)
    ops = graph.ops
    index = {op.name: k for k, op in enumerate(ops)}

    def number(name: str) -> int:  # 'op22:aten.empty_like.default' -> 22 (slackswap.runtime.op_numbering)
        return int(name.split(":", 1)[0].removeprefix("op"))

    def width(name: str) -> int:  # the op's ATen calls: up to the next op's first
        k = index[name]
        return number(ops[k + 1].name) - number(name) if k + 1 < len(ops) else 1

    replays = replay_times or {}
    timed = [s for s in steps if s.op in replays]
    fallback = [s for s in steps if s.op not in replays]
    excess = sum((replays[s.op] - ops[index[s.op]].duration_s for s in timed), 0.0)
    recomputed = saved_tensor_events(graph, plan.tensors_with(Decision.RECOMPUTE))
    checks = 0
    if steps:  # a recomputing plan's hook-only step checks each module call
        if LEAF_MODULE_CALLS_KEY not in graph.meta and events:
            raise ValueError(f"graph {graph.name!r}: meta {LEAF_MODULE_CALLS_KEY!r} missing (its module calls, which a "
                             "recomputing plan's step checks, were not counted): capture it again")
        checks = int(graph.meta.get(LEAF_MODULE_CALLS_KEY, 0))
    return RuntimeHostCounts(events - recomputed, len(fallback), sum(width(s.op) for s in fallback),
                             len(plan.offloads) + len(plan.prefetches), replay_timed_steps=len(timed),
                             replay_timed_excess_s=excess, recompute_events=recomputed, module_checks=checks)


def predict_step(graph: Graph, plan: Plan, hardware: Hardware, machine: Machine | None,
                 host: RuntimeHostCost | None = None, replay_times: Mapping[str, float] | None = None,
                 copy_times: Mapping[str, tuple[float, float]] | None = None) -> Prediction:
    """The plan's step on `machine` (None: `hardware` as it is, copies overlapping); with `host` on a
    synchronous machine (the CPU), plus the eager runtime's own host work (module docstring), its
    recompute steps at their ops' `replay_times` where measured: on a GPU it overlaps the kernels and
    is not added. On a synchronous machine a copy of a tensor with `copy_times` (offload, prefetch) is
    priced at it, any other by the machine's copy curve (module docstring)."""
    from slackswap.simulate import simulate
    from slackswap.simulate.saved_peak import instant_link

    copies = len(plan.offloads) + len(plan.prefetches)
    if machine is None or not machine.synchronous:  # host work overlaps the device's: not added
        on = machine.on(hardware) if machine is not None else hardware
        sim = simulate(graph, plan, on, None)
        return Prediction(sim.step_s, sim.step_s, 0.0, copies)
    counts = runtime_host_counts(graph, plan, replay_times)
    # Without `host` the microbenchmark's terms are not measured (nothing added); measured replays still are.
    host_s = counts.seconds(host if host is not None else RuntimeHostCost())
    sim = simulate(graph, plan, instant_link(hardware), None)
    sizes, timed = graph.size_bytes_of, copy_times or {}
    copy_s = sum(timed[t.tensor][0] if t.tensor in timed else machine.copy_s("d2h", sizes[t.tensor])
                 for t in plan.offloads)
    copy_s += sum(timed[t.tensor][1] if t.tensor in timed else machine.copy_s("h2d", sizes[t.tensor])
                  for t in plan.prefetches)
    copy_timed = sum(t.tensor in timed for t in (*plan.offloads, *plan.prefetches))
    return Prediction(sim.step_s + copy_s + host_s, sim.step_s, copy_s, copies, runtime_host_s=host_s,
                      replay_timed_steps=counts.replay_timed_steps,
                      replay_fallback_steps=counts.recompute_steps if host is not None else 0,
                      copy_timed=copy_timed, copy_curve=copies - copy_timed)


@dataclass(frozen=True)
class StepComparison:
    """Measured steps after the first (warm-up) against a prediction."""

    predicted_s: float
    measured_median_s: float
    measured_min_s: float
    measured_max_s: float
    steps: int

    @property
    def relative_error(self) -> float:
        """(predicted - measured) / measured: negative when the prediction is faster."""
        return (self.predicted_s - self.measured_median_s) / self.measured_median_s


def compare_steps(predicted_s: float, step_times_s: Sequence[float]) -> StepComparison:
    """The steps after the first (all of them when there is only one)."""
    kept = list(step_times_s[1:]) or list(step_times_s)
    return StepComparison(predicted_s, statistics.median(kept), min(kept), max(kept), len(kept))
