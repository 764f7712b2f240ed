"""What the `milp` bound problem reads of a graph: the saved tensors (`SavedInfo`), the checkpoints,
the unmovable bytes per op, the recompute chains and their cuts, the memory rows kept, and the
keep-all peak. Pure functions of the graph and hardware, kept apart from the problem's rows
(`milp.model`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from slackswap.errors import ConfigError
from slackswap.graph import FORWARD_PHASES, Graph, Phase
from slackswap.hardware import Hardware
from slackswap.schedule.transfer import d2h_s, h2d_s

if TYPE_CHECKING:  # scipy.sparse (~0.25 s) is imported when a problem is built, not by the planner registry
    pass

MS_PER_S = 1e3
GRANULARITIES: tuple[str, ...] = ("op", "layer")
MEMORY_ROWS: tuple[str, ...] = ("all", "reduced")


@dataclass(frozen=True)
class SavedInfo:
    """One saved tensor, with the op positions the bound problem needs."""

    name: str
    size_bytes: int
    producer: int
    #: First backward reader: a swapped or recomputed copy must be on the device when it starts.
    first_bwd: int
    last_reader: int
    readers: frozenset[int]
    d2h_ms: float
    h2d_ms: float


def checkpoints_for(graph: Graph, granularity: str, layers_per_window: int = 1) -> tuple[int, ...]:
    """Op positions whose start times are modelled. Always 0 and the virtual end n_ops.

    `op`: every op (tightest, largest). `layer`: the first op of each (layer, phase) run, so each
    layer's forward and backward span is one window; with `layers_per_window` m > 1 only every m-th
    such span start (counted per phase) is a checkpoint, so a window spans m layers. Any subset of op
    starts is a valid set of checkpoints (docs/milp.md); fewer checkpoints only weaken the bound.
    """
    if granularity not in GRANULARITIES:
        raise ConfigError("planner.options.granularity", granularity, f"unknown; known: {GRANULARITIES}")
    n = len(graph.ops)
    if granularity == "op":
        return tuple(range(n + 1))
    points = {0, n}
    count: dict[Phase, int] = {}
    for i in range(1, n):
        prev, op = graph.ops[i - 1], graph.ops[i]
        if (op.layer, op.phase) != (prev.layer, prev.phase):
            seen = count.get(op.phase, 0)
            count[op.phase] = seen + 1
            if op.layer < 0 or prev.layer < 0 or prev.phase != op.phase or seen % layers_per_window == 0:
                points.add(i)
    return tuple(sorted(points))


def saved_infos(graph: Graph, hardware: Hardware) -> tuple[SavedInfo, ...]:
    index = graph.op_index
    out = []
    for t in graph.saved_tensors:
        readers = frozenset(index[c] for c in t.consumers)
        bwd = [r for r in readers if graph.ops[r].phase == Phase.BACKWARD]
        out.append(
            SavedInfo(
                name=t.name,
                size_bytes=graph.owned_bytes(t.name),
                producer=index[t.producer],
                first_bwd=min(bwd),
                last_reader=max(readers),
                readers=readers,
                # the simulator's copy times (slackswap.schedule.transfer), engines' bandwidth share included
                d2h_ms=d2h_s(t.size_bytes, hardware) * MS_PER_S,
                h2d_ms=h2d_s(t.size_bytes, hardware) * MS_PER_S,
            )
        )
    return tuple(out)


def fixed_bytes_per_op(graph: Graph) -> list[int]:
    """Bytes of non-saved tensors resident at each op's start: a plan cannot move or drop them.

    A tensor is resident at the start of op j when its producer is at or before j and its last
    reader at or after j (outputs are allocated at op start; a tensor is freed when its last reader
    finishes).
    """
    index = graph.op_index
    diff = [0] * (len(graph.ops) + 1)
    for t in graph.tensors.values():
        if t.saved:
            continue
        start = index[t.producer]
        end = max((index[c] for c in t.consumers), default=start)
        diff[start] += graph.owned_bytes(t.name)
        diff[end + 1] -= graph.owned_bytes(t.name)
    return list(np.cumsum(diff[:-1]).astype(np.int64).tolist())


def last_forward_reader(graph: Graph, info: SavedInfo) -> int:
    """Last forward/loss reader of a saved tensor (its producer if none): where its run copy dies
    under build_schedule when it is swapped or recomputed."""
    fwd = [r for r in info.readers if graph.ops[r].phase in FORWARD_PHASES]
    return max(fwd, default=info.producer)


def _chain_tensors(graph: Graph, name: str) -> tuple[list[int], list[str]]:
    """build_schedule's regeneration of a recompute-decided tensor: its producer, and recursively the
    producers of its NON-saved forward inputs (saved inputs are kept, swapped or regenerated on their
    own account). Returns (op positions, the non-saved intermediate tensors)."""
    index = graph.op_index
    producers: list[int] = []
    intermediates: list[str] = []
    stack = [graph.tensors[name].producer]
    seen: set[str] = set()
    while stack:
        op_name = stack.pop()
        if op_name in seen:
            continue
        seen.add(op_name)
        producers.append(index[op_name])
        for t in graph.op_by_name[op_name].inputs:
            tensor = graph.tensors[t]
            producer = graph.op_by_name[tensor.producer]
            if not tensor.saved and producer.phase in FORWARD_PHASES:
                intermediates.append(t)
                stack.append(tensor.producer)
    return producers, intermediates


def chain_producers(graph: Graph, name: str) -> tuple[int, ...]:
    return tuple(_chain_tensors(graph, name)[0])


def chain_intermediate_bytes(graph: Graph, name: str) -> int:
    return sum(graph.owned_bytes(t) for t in set(_chain_tensors(graph, name)[1]))


def chain_cut_pairs(graph: Graph, saved: Sequence[SavedInfo]) -> tuple[tuple[int, int, int, int, int, str], ...]:
    """(saved index i, position of u's producer, min(size_t, size_u), first row, last row, u) per chain cut.

    For a saved tensor t (index i) with a forward producer p that reads a non-saved forward tensor u:
    at the start of every op j with last_reader(u) < j < first_bwd(t), j not a reader of t, a valid
    plan recomputing t holds a copy of t or of u, or recomputes u's producer before first_bwd(t)
    (docs/milp.md "Chain cuts"). Each u serves one t and each t one u, so the copies counted in one
    memory row are distinct (and distinct from everything else the row counts)."""
    index = graph.op_index
    out = []
    used: set[str] = set()
    for i, info in enumerate(saved):
        producer = graph.ops[info.producer]
        if producer.phase not in FORWARD_PHASES or info.size_bytes == 0:
            continue
        for u in producer.inputs:
            tensor = graph.tensors[u]
            u_producer = graph.op_by_name[tensor.producer]
            if tensor.saved or u_producer.phase not in FORWARD_PHASES or tensor.size_bytes == 0 or u in used:
                continue
            used.add(u)
            last_u = max(index[c] for c in tensor.consumers)
            out.append((i, index[tensor.producer], min(tensor.size_bytes, info.size_bytes), last_u + 1,
                        info.first_bwd - 1, u))
            break
    return tuple(out)


def reduced_memory_rows(
    graph: Graph, saved: Sequence[SavedInfo], const: Sequence[int], extra: Sequence[int]
) -> list[int]:
    """The ops that keep a memory row under `memory_rows: reduced`.

    Per maximal (layer, phase) span: the op with the largest unmovable floor (`const`) and the op with
    the largest keep-all resident bytes (floor + every saved tensor alive across it, + `extra` at first
    backward readers). Plus every op from the last transformer layer's forward span to the first
    backward layer span (the forward/backward boundary, where the peak sits). Any subset is valid for
    the bound: a dropped row is a dropped necessary condition.
    """
    ops = graph.ops
    n = len(ops)
    diff = [0] * (n + 1)
    for info, x in zip(saved, extra, strict=True):
        diff[info.producer + 1] += info.size_bytes  # producer and readers are already in const
        diff[info.last_reader] -= info.size_bytes
        if x:
            diff[info.first_bwd] += x
            diff[info.first_bwd + 1] -= x
    alive = np.cumsum(diff[:-1])
    potential = np.asarray(const, dtype=np.float64) + alive
    chosen: set[int] = set()
    start = 0
    for j in range(1, n + 1):
        if j == n or (ops[j].layer, ops[j].phase) != (ops[start].layer, ops[start].phase):
            span = range(start, j)
            chosen.add(max(span, key=lambda x: const[x]))
            chosen.add(max(span, key=lambda x: potential[x]))
            start = j
    layer_fwd = [i for i, op in enumerate(ops) if op.phase == Phase.FORWARD and op.layer >= 0]
    layer_bwd = [i for i, op in enumerate(ops) if op.phase == Phase.BACKWARD and op.layer >= 0]
    if layer_fwd and layer_bwd:
        top = ops[layer_fwd[-1]].layer
        lo = min(i for i in layer_fwd if ops[i].layer == top)
        first_bwd_layer = ops[layer_bwd[0]].layer
        hi = max(i for i in layer_bwd if ops[i].layer == first_bwd_layer and i >= layer_bwd[0])
        chosen.update(range(lo, hi + 1))
    return sorted(chosen)



def keep_all_peak_bytes(graph: Graph) -> int:
    """Peak of resident bytes over op starts when every tensor lives from its producer to its last
    reader (the keep-all schedule). Memory only grows at op starts, so the peak is at one of them."""
    index = graph.op_index
    diff = [0] * (len(graph.ops) + 1)
    for t in graph.tensors.values():
        start = index[t.producer]
        end = max((index[c] for c in t.consumers), default=start)
        diff[start] += graph.owned_bytes(t.name)
        diff[end + 1] -= graph.owned_bytes(t.name)
    return int(np.max(np.cumsum(diff[:-1])))
