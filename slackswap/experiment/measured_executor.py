"""Which executor a measured step runs a plan on, and the plan's prediction as that executor runs it.

The runtime (`slackswap.runtime.apply`) runs a plan on its saved-tensor hooks alone after the first
step: then a step costs the plan's ops. A plan that keeps or recomputes a checkpoint candidate (a
tensor autograd does not save: a recompute that reads one has no saved-tensor hook to receive it) is
refused that program (`RunReport.hook_only_refusal`), and the runtime runs every step verified: a
Python dispatch mode on every ATen call (naming, numbering and checking each against the graph), about
0.1 ms a call on a CPU, 3-6x the plain step of the small models here. That step times the verifier,
not the plan, and is not how a user runs such a plan. A user runs it through PyTorch's own
mechanism: the plan made for the export (`slackswap.experiment.export_plan.plan_for_export`) installed
as per-layer eager selective checkpointing (`slackswap.runtime.export.PlanExport`).

Its prediction models what that executor runs (`predict_export`): eager checkpointing replays a
layer's forward before its first backward reader, every op of it up to its last saved output that no
cached output covers, so it runs more recomputes than the plan decides (the replayed transients of
`slackswap.pytorch_execution.pytorch_plan`); the simulator runs that executed plan. What the model
runs each layer under the cheapest mechanism that executes its decisions
(`slackswap.runtime.export.mechanism`): a layer whose every decided tensor is recomputed under a plain
checkpoint, any other under the SAC policy, whose Python dispatch modes see every ATen call of the
layer's forward and of its replay. That per-call cost is no op's: it is measured once per machine by a
microbenchmark (`slackswap.runtime.export.dispatch_cost`) and added per call the SAC layers make
(`dispatch_calls`). Every layer, under either mechanism, is a non-reentrant checkpoint region, whose own
host work (a frame, the RNG state, the recompute started and stopped early from backward; a pack hook in
the forward, another in the recompute and an unpack hook per saved tensor) is no op's either: measured
once per machine (`slackswap.runtime.export.checkpoint_cost`) and added per region and per saved tensor
of the layers (`checkpoint_regions`, `checkpoint_saved`). Both are the op-time table's `ExportHostCost`;
nothing is added when it is not given (a GPU, where that host work overlaps the kernels).

What the replay costs in ops is the simulator's: the recompute reruns the layer's forward up to its last
saved tensor; under SAC each op the policy saved is intercepted there and served from the cache (a
dispatch call, no op), each op it recomputes runs again (a dispatch call and the op's time:
`pytorch_plan`'s executed recomputes). The replay re-runs the layer's Python forward, so its views
(reshapes, transposes, expands: ops that make no tensor of their own, which no recompute step holds)
run again too: on the CPU each is added at its op time, the module code leading to it
(`slackswap.pytorch_execution.replayed_views`); their dispatch calls are already among a SAC layer's.
So does the module code leading to each call served from the cache: such a call is charged the
per-call dispatch cost and nothing more, since measured that covers it (`benchmarks/export_cached_calls.py`:
stamped in the replays of the benchmark's four exported models, a cached call, the module code leading
to it included, cost within 2.5 us of the dispatch it is charged); which calls are served is counted on
the graph (`sac_replay_ops`, `cached_calls`).

`EXECUTORS`: `runtime` (every plan under `apply`), `export` (every plan made for and run through the
export), `auto` (the runtime, and the export for a plan its hook-only program refuses). Needs torch
when a function runs; importing this module does not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan, StepKind
from slackswap.profile.machine import Machine
from slackswap.profile.measured import ExportHostCost

if TYPE_CHECKING:
    from slackswap.experiment.prediction import Prediction
    from slackswap.runtime.train import StepRecord
    from slackswap.runtime.training_workload import Workload

EXECUTORS = ("runtime", "export", "auto")


@dataclass(frozen=True)
class ExportPrediction:
    """The step predicted for a plan made for the export, as eager checkpointing executes it."""

    prediction: Prediction
    #: The plan's own recompute steps, and those the eager replay runs (the plan's and every uncached
    #: op of a layer's forward up to its last saved output).
    plan_recomputes: int
    executed_recomputes: int
    #: ATen calls per step the SAC layers route through the export's dispatch modes (forward and replay),
    #: counted on the graph; 0 when no model was given.
    dispatch_calls: int = 0
    #: Checkpoint regions per step and the saved tensors (pack events) of their forwards, counted on the
    #: graph (`export_counts`); 0 when no model was given.
    checkpoint_regions: int = 0
    checkpoint_saved: float = 0.0
    #: The ops the replays run again that make no tensor of their own (priced at their op times on the CPU).
    replayed_views: int = 0
    #: Of `dispatch_calls`, those of the replays that the SAC cache serves (`sac_replay_calls`).
    cached_calls: int = 0


@dataclass(frozen=True)
class ExportCheck:
    """A plain step and a step under the installed export, from the same weights, batch and RNG seed."""

    bit_exact: bool
    #: Largest absolute difference over the loss and every parameter gradient.
    max_abs_diff: float
    #: Decisions the eager export executed otherwise than planned (`PlanExport.step_differences`).
    differences: int


@dataclass(frozen=True)
class ReplayCalls:
    """A SAC layer's replay in ATen calls, by what each call costs there (`sac_replay_calls`)."""

    #: Calls of the ops it runs again: the executed plan's recomputes (their op times, and the dispatch).
    executed: int
    #: Calls of its views (`replayed_views`: their op times, and the dispatch).
    views: int
    #: Calls the selective-checkpoint cache serves (a kept or swapped output): the dispatch alone, priced
    #: at `ExportHostCost.sac_per_call_s` like every call; the module code leading to such a call runs
    #: again too, and that per-call price covers it (module docstring).
    cached: int


@dataclass(frozen=True)
class ExportCounts:
    """What a plan's eager export runs per step beyond the executed plan's ops (`export_counts`)."""

    #: ATen calls through the SAC modes (`sac_dispatch_calls`).
    dispatch_calls: int
    #: Checkpoint regions (every layer the export wraps) and their forwards' pack events.
    regions: int
    saved: float
    #: The ops the regions' replays run again that make no tensor of their own
    #: (`slackswap.pytorch_execution.replayed_views`).
    replayed_views: tuple[str, ...] = ()
    #: Of the SAC calls, those of the replays that the cache serves (`sac_replay_calls`).
    cached_calls: int = 0


def predict_export(graph: Graph, plan: Plan, hardware: Hardware, machine: Machine | None, model: object = None,
                   costs: ExportHostCost | None = None) -> ExportPrediction:
    """`plan` (made by `plan_for_export` on `graph`) predicted as PyTorch's eager checkpointing runs it:
    `pytorch_plan(..., "eager")`, each layer's recomputes and replayed transients in one block before
    its first backward reader, on `slackswap.experiment.prediction.predict_step`; with `model` (the
    plan's) on a synchronous machine (the CPU), plus the views the replays run again at their op times,
    and with `costs` (the op-time table's `export_host`) the SAC layers' dispatch per call and the
    checkpoint's own work per region and per saved tensor (module docstring)."""
    from dataclasses import replace

    from slackswap.experiment.prediction import predict_step
    from slackswap.pytorch_execution import pytorch_plan

    executed = pytorch_plan(graph, plan, dict(plan.decisions), hardware, "eager")

    def recomputes(p: Plan) -> int:
        return sum(s.kind == StepKind.RECOMPUTE for s in p.steps)

    prediction = predict_step(graph, executed, hardware, machine)
    counts = export_counts(graph, plan, model) if model is not None else ExportCounts(0, 0, 0.0)
    if machine is not None and machine.synchronous:
        ops = graph.op_by_name
        views = sum(ops[v].duration_s for v in counts.replayed_views)
        prediction = replace(prediction, step_s=prediction.step_s + views, replayed_views_s=views)
        if costs is not None:
            dispatch = counts.dispatch_calls * costs.sac_per_call_s
            frames = counts.regions * costs.checkpoint_per_region_s + counts.saved * costs.checkpoint_per_saved_s
            prediction = replace(prediction, step_s=prediction.step_s + dispatch + frames, dispatch_s=dispatch,
                                 checkpoint_s=frames)
    return ExportPrediction(prediction, recomputes(plan), recomputes(executed), counts.dispatch_calls,
                            counts.regions, counts.saved, len(counts.replayed_views), counts.cached_calls)


def export_counts(graph: Graph, plan: Plan, model: object) -> ExportCounts:
    """`ExportCounts` per step of `plan`'s eager export: `sac_dispatch_calls`; every layer the export
    wraps is a region; a region's saved tensors are the pack events the capture counted while its layer
    ran (`saved_tensor_packs_by_layer`: weights and tensors autograd saves twice included, a tensor the
    next layer's op saves counted in that layer, whose frame packs it); a graph without that count
    (captured before it was recorded) scales the graph's saved tensors of the layer by the capture's
    pack events per saved graph tensor (`saved_tensor_packs`); the views the regions' replays run again
    (`slackswap.pytorch_execution.replayed_views`)."""
    from slackswap.graph import NO_LAYER, SAVED_PACKS_BY_LAYER_KEY
    from slackswap.pytorch_execution import replayed_views
    from slackswap.runtime.export import PlanExport

    export = PlanExport(plan, graph, model)
    regions = len(export.regions)
    by_layer = graph.meta.get(SAVED_PACKS_BY_LAYER_KEY)
    if by_layer is not None:
        saved = float(sum(by_layer[:regions]))
    else:
        tensors = [t for t in graph.tensors.values() if t.saved]
        per_tensor = graph.meta.get("saved_tensor_packs", len(tensors)) / max(1, len(tensors))
        saved = sum(1 for t in tensors if t.layer != NO_LAYER and t.layer < regions) * per_tensor
    views = tuple(v for vs in replayed_views(graph, range(regions)).values() for v in vs)
    layers = _selective_layers(graph, plan, model, export)
    replays = _calls_by_kind(_replay_ops(graph, plan, layers))
    return ExportCounts(_dispatch_calls(layers, replays), regions, saved, views,
                        sum(c.cached for c in replays.values()))


def sac_dispatch_calls(graph: Graph, plan: Plan, model: object, export: object = None) -> int:
    """The ATen calls per step that pass the export's SAC dispatch modes: per layer the export runs under
    the policy (`PlanExport.mechanisms`), its forward's calls (the graph's ops of the layer, each with
    the in-place calls joined to it) and its replay's (those up to the layer's last op with a saved
    output, where the replay stops: `sac_replay_calls`)."""
    layers = _selective_layers(graph, plan, model, export)
    return _dispatch_calls(layers, _calls_by_kind(_replay_ops(graph, plan, layers)))


def sac_replay_calls(graph: Graph, plan: Plan, model: object, export: object = None) -> dict[int, ReplayCalls]:
    """Per layer the export runs under the SAC policy, its replay's ATen calls by what each costs there
    (`ReplayCalls`, summed from `sac_replay_ops`). All of them pass the dispatch modes (`sac_dispatch_calls`)."""
    return _calls_by_kind(sac_replay_ops(graph, plan, model, export))


def sac_replay_ops(graph: Graph, plan: Plan, model: object,
                   export: object = None) -> dict[int, tuple[tuple[str, str, int], ...]]:
    """Per SAC layer, its replay's ops in forward order (the layer's forward ops up to its last op with a
    saved output, where the replay stops) as (op name, kind, its ATen calls: the op's and the in-place calls
    joined to it). Kind, as `_replayed_transients` decides what runs: "executed" for an op with fresh
    outputs that the plan recomputes or that no kept or swapped output covers (a recompute of the executed
    plan, `pytorch_plan`), "views" for an op whose outputs are all views (`replayed_views`), "cached" for
    one the selective-checkpoint cache serves."""
    return _replay_ops(graph, plan, _selective_layers(graph, plan, model, export))


def _dispatch_calls(layers: dict[int, tuple], replays: dict[int, ReplayCalls]) -> int:
    """`sac_dispatch_calls` from the SAC layers and their replays' calls, each found once."""
    forward = sum(sum(w for _, w in ops) for ops, _ in layers.values())
    return forward + sum(c.executed + c.views + c.cached for c in replays.values())


def _calls_by_kind(replay_ops: dict[int, tuple[tuple[str, str, int], ...]]) -> dict[int, ReplayCalls]:
    out: dict[int, ReplayCalls] = {}
    for r, ops in replay_ops.items():
        counts = {"executed": 0, "views": 0, "cached": 0}
        for _, kind, calls in ops:
            counts[kind] += calls
        out[r] = ReplayCalls(**counts)
    return out


def _replay_ops(graph: Graph, plan: Plan, layers: dict[int, tuple]) -> dict[int, tuple[tuple[str, str, int], ...]]:
    """`sac_replay_ops` of the SAC layers `_selective_layers` found."""
    from slackswap.plan import Decision
    from slackswap.pytorch_execution import makes_no_tensor

    cached = {t for t, d in plan.decisions.items() if d in (Decision.KEEP, Decision.SWAP)}
    have = {t for s in plan.steps if s.kind == StepKind.RECOMPUTE for t in s.outputs}
    out: dict[int, tuple[tuple[str, str, int], ...]] = {}
    for r, (ops, last) in layers.items():
        kinds = []
        for op, width in ops[:last + 1]:
            if makes_no_tensor(graph, op):
                kind = "views"
            elif cached.intersection(op.outputs) and not have.intersection(op.outputs):
                kind = "cached"
            else:
                kind = "executed"
            kinds.append((op.name, kind, width))
        out[r] = tuple(kinds)
    return out


def _selective_layers(graph: Graph, plan: Plan, model: object, export: object = None) -> dict[int, tuple]:
    """Per SAC layer with forward ops: ([(op, its ATen calls)], the index of its last op with a saved output,
    where its replay stops: `replay_stop`)."""
    from slackswap.pytorch_execution import replay_stop
    from slackswap.runtime.export import PlanExport
    from slackswap.runtime.export.mechanism import SELECTIVE
    from slackswap.runtime.op_numbering import call_number

    export = export if export is not None else PlanExport(plan, graph, model)
    forward = graph.forward_ops
    out = {}
    for r, m in enumerate(export.mechanisms()):
        ops = [(i, op) for i, op in enumerate(forward) if op.layer == r]
        if m != SELECTIVE or not ops:
            continue
        width = [call_number(forward[i + 1].name) - call_number(op.name) if i + 1 < len(forward) else 1
                 for i, op in ops]
        out[r] = ([(op, w) for (_, op), w in zip(ops, width, strict=True)], replay_stop(graph, [op for _, op in ops]))
    return out


def hook_only_refusal(w: Workload, graph: Graph, plan: Plan, seed: int = 1) -> tuple[bool, str | None]:
    """(gradients bit-exact, why the runtime's hook-only program refuses `plan` or None), from one
    verified step under `apply` against a plain one (`slackswap.runtime.train.gradient_check`; the
    weights are left unchanged)."""
    from slackswap.runtime.train import gradient_check

    check = gradient_check(w, graph, plan, seed)
    return check.bit_exact, check.report.hook_only_refusal


def export_gradient_check(w: Workload, graph: Graph, plan: Plan, seed: int = 1) -> ExportCheck:
    """Loss and every parameter gradient of a plain step against a step under `PlanExport(plan, graph,
    model).installed(model)`, both from `seed` (dropout draws alike); the weights are left unchanged
    (`slackswap.runtime.train.eager_export_gradient_check`)."""
    from slackswap.runtime.train import eager_export_gradient_check

    return ExportCheck(*eager_export_gradient_check(w, graph, plan, seed))


def export_steps(w: Workload, graph: Graph, plan: Plan, steps: int, lr: float, seed: int,
                 clock: Callable[[], float] = time.perf_counter,
                 on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
    """`steps` AdamW steps (`slackswap.runtime.train.train_steps`) with `plan`'s export installed as
    eager per-layer selective checkpointing. The first step audits the policies (the comparison drops
    it as warm-up); the later ones run from the audited tables."""
    from slackswap.runtime.export import PlanExport
    from slackswap.runtime.train import train_steps

    with PlanExport(plan, graph, w.model).installed(w.model):
        return train_steps(w, graph, None, steps, lr, seed, on_step, clock=clock)


__all__ = ["EXECUTORS", "ExportCheck", "ExportCounts", "ExportPrediction", "export_gradient_check",
           "export_steps", "export_counts", "hook_only_refusal", "predict_export", "ReplayCalls",
           "sac_dispatch_calls", "sac_replay_calls", "sac_replay_ops"]
