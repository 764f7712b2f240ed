"""What planners read off the profile: per-tensor timing and regeneration cost, windows, slack.

- `regen_chain`: the forward ops that must re-run to regenerate a saved tensor in backward, given
  which tensors are not on the device then (recompute-decided saved tensors and every non-saved
  forward tensor). Its summed `duration_s` is the tensor's cost to regenerate.
- windows come from the keep-all timeline (`slackswap.schedule.replay.estimate_plan` of `keep_all_plan`): the forward
  window ends when the first backward op starts (the keep-all memory peak sits at that boundary:
  every saved activation is alive and the loss has allocated its outputs); the backward window is
  the rest of the step.
- slack: offloads run on the D2H engine during the forward window and must complete before its end
  (the peak); prefetches run on the H2D engine from the start of backward and must complete before
  the tensor's first backward use. `SlackLedger` checks both exactly for a set of swapped tensors
  (single serial engine per direction, earliest-deadline order), in O(n) numpy work per candidate.
- layer-boundary tensors (read by a forward op of another layer than their producer's): the
  checkpoints between layers. Greedy and knapsack planners never recompute them, so every recompute
  chain stays inside one layer (recomputing a boundary would chain back to the embedding and
  rematerialise many layers at once).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from slackswap.graph import FORWARD_PHASES, Graph, GraphMemo
from slackswap.hardware import Hardware
from slackswap.schedule.build import keep_all_plan
from slackswap.schedule.replay import PlanTimeline, estimate_plan
from slackswap.schedule.transfer import d2h_s, h2d_s


@dataclass(frozen=True)
class TensorInfo:
    name: str
    size_bytes: int
    #: Transformer layer of the producer op (NO_LAYER outside the stack).
    layer: int
    #: Keep-all time the producer finishes (an offload can start then).
    ready_s: float
    #: Keep-all start time of the first backward op that reads it (a prefetch must end by then).
    first_backward_use_s: float
    #: Forward ops to re-run if only this tensor is regenerated (everything else saved is kept).
    regen_ops: tuple[str, ...]
    regen_s: float
    d2h_s: float
    h2d_s: float
    boundary: bool
    #: Keep-all end of the last forward op that reads it (its producer's end if no forward op does):
    #: the earliest time a dropped copy could be gone. If no op runs between this and the first
    #: backward use, dropping it (recompute or swap) frees nothing at any instant.
    last_forward_use_s: float = 0.0

    @property
    def off_device_window_s(self) -> float:
        """How long the tensor could be off the device in keep-all order (0: never)."""
        return max(0.0, self.first_backward_use_s - max(self.last_forward_use_s, self.ready_s))


@dataclass(frozen=True)
class ProfileAnalysis:
    keep_all: PlanTimeline
    keep_all_peak_bytes: int
    ideal_step_s: float
    #: End of the forward window = start of the first backward step (keep-all timeline).
    forward_end_s: float
    backward_window_s: float
    tensors: Mapping[str, TensorInfo]

    @property
    def forward_window_s(self) -> float:
        return self.forward_end_s


def is_forward(graph: Graph, tensor: str) -> bool:
    return graph.op_by_name[graph.tensors[tensor].producer].phase in FORWARD_PHASES


def boundary_tensors(graph: Graph) -> frozenset[str]:
    """Forward tensors read by a forward op of a different layer than their producer's."""
    out = set()
    for op in graph.ops:
        if op.phase not in FORWARD_PHASES:
            continue
        for t in op.inputs:
            if graph.op_by_name[graph.tensors[t].producer].layer != op.layer:
                out.add(t)
    return frozenset(out)


def regen_walk(graph: Graph, tensor: str, missing: Collection[str]) -> tuple[set[str], set[str]]:
    """(forward ops that regenerate `tensor`, saved tensors the walk stops at) when the saved tensors in
    `missing` and all non-saved forward tensors are off the device. `tensor` itself counts as missing.
    The stop set is what DTR's cost depends on: evicting one of them lengthens the chain."""
    producer_of = walk_table(graph)
    ops: set[str] = set()
    frontier: set[str] = set()
    stack = [tensor]
    seen: set[str] = set()
    pop, push, visit, use, stop = stack.pop, stack.append, seen.add, ops.add, frontier.add
    while stack:
        name = pop()
        if name in seen:
            continue
        visit(name)
        producer, inputs = producer_of[name]
        use(producer)
        for t, is_saved in inputs:
            if not is_saved or t == tensor or t in missing:
                push(t)
            else:
                stop(t)
    return ops, frontier


def _build_walk_table(graph: Graph) -> dict[str, tuple[str, tuple[tuple[str, bool], ...]]]:
    tensors, op_by_name = graph.tensors, graph.op_by_name
    return {
        name: (t.producer, tuple((i, tensors[i].saved) for i in op_by_name[t.producer].inputs))
        for name, t in tensors.items()
    }


#: Tensor -> (its producer op, that op's inputs each with whether it is saved), once per graph: DTR walks
#: chains after every eviction, and on traced graphs, where evicted regions chain across layers, those
#: walks are most of its time.
walk_table: GraphMemo[dict[str, tuple[str, tuple[tuple[str, bool], ...]]]] = GraphMemo(_build_walk_table)


def regen_chain(graph: Graph, tensor: str, missing: Collection[str]) -> tuple[str, ...]:
    """Forward ops (in forward order) that regenerate `tensor` (see `regen_walk`)."""
    ops, _ = regen_walk(graph, tensor, missing)
    return tuple(sorted(ops, key=graph.op_index.__getitem__))


def analyse(graph: Graph, hardware: Hardware) -> ProfileAnalysis:
    timeline = estimate_plan(graph, keep_all_plan(graph), hardware)
    n_fwd = sum(1 for op in graph.ops if op.phase in FORWARD_PHASES)
    forward_end = timeline.step_start_s[n_fwd] if n_fwd < len(graph.ops) else timeline.step_s
    first_bwd: dict[str, float] = {}
    last_fwd: dict[str, float] = {}
    for i in range(n_fwd):
        for t in graph.ops[i].inputs:
            last_fwd[t] = timeline.step_end_s[i]
    for i in range(n_fwd, len(graph.ops)):
        for t in graph.ops[i].inputs:
            first_bwd.setdefault(t, timeline.step_start_s[i])
    boundary = boundary_tensors(graph)
    infos = {}
    for t in graph.saved_tensors:
        producer = graph.op_by_name[t.producer]
        chain = regen_chain(graph, t.name, ())
        infos[t.name] = TensorInfo(
            name=t.name,
            size_bytes=graph.drop_bytes_of[t.name],
            layer=producer.layer,
            ready_s=timeline.step_end_s[graph.op_index[t.producer]],
            first_backward_use_s=first_bwd[t.name],
            regen_ops=chain,
            regen_s=sum(graph.op_by_name[o].duration_s for o in chain),
            d2h_s=d2h_s(t.size_bytes, hardware),
            h2d_s=h2d_s(t.size_bytes, hardware),
            boundary=t.name in boundary,
            last_forward_use_s=last_fwd.get(t.name, timeline.step_end_s[graph.op_index[t.producer]]),
        )
    return ProfileAnalysis(
        keep_all=timeline,
        keep_all_peak_bytes=timeline.peak_bytes,
        ideal_step_s=timeline.step_s,
        forward_end_s=forward_end,
        backward_window_s=timeline.step_s - forward_end,
        tensors=MappingProxyType(infos),
    )


class SlackLedger:
    """Exact hide-ability of a growing set of swapped tensors, per direction.

    Offloads: release = producer end, common deadline = end of the forward window, one serial D2H
    engine. Feasible iff for every release r: (sum of offload times released at or after r) <= D - r.
    Prefetches: common release = start of backward, deadline = first backward use, one serial H2D
    engine in deadline order. Feasible iff for every deadline u: (sum of prefetch times due by u) <= u - D.
    Each array holds that margin at every candidate position; adding a tensor subtracts its transfer
    time from the margins it affects, and is allowed only if none would go negative.
    """

    def __init__(self, analysis: ProfileAnalysis, candidates: list[str]):
        infos = analysis.tensors
        d = analysis.forward_end_s
        self._d2h_order = {t: i for i, t in enumerate(sorted(candidates, key=lambda t: infos[t].ready_s))}
        self._h2d_order = {t: i for i, t in enumerate(sorted(candidates, key=lambda t: infos[t].first_backward_use_s))}
        ready = np.empty(len(candidates))
        use = np.empty(len(candidates))
        for t in candidates:
            ready[self._d2h_order[t]] = infos[t].ready_s
            use[self._h2d_order[t]] = infos[t].first_backward_use_s
        self._d2h_margin = d - ready
        self._h2d_margin = use - d
        self._infos = infos
        self.d2h_busy_s = 0.0
        self.h2d_busy_s = 0.0

    def fits(self, tensor: str) -> bool:
        info = self._infos[tensor]
        i, j = self._d2h_order[tensor], self._h2d_order[tensor]
        return bool(self._d2h_margin[: i + 1].min() >= info.d2h_s and self._h2d_margin[j:].min() >= info.h2d_s)

    def add(self, tensor: str) -> None:
        info = self._infos[tensor]
        self._d2h_margin[: self._d2h_order[tensor] + 1] -= info.d2h_s
        self._h2d_margin[self._h2d_order[tensor] :] -= info.h2d_s
        self.d2h_busy_s += info.d2h_s
        self.h2d_busy_s += info.h2d_s
