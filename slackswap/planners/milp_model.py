"""The bound problem of the `milp` planner: a MILP whose optimum is a lower bound on simulated step time.

Every constraint here is a NECESSARY condition of any execution the simulator can produce for a valid
plan (the argument, constraint by constraint, is in docs/milp.md). Nothing heuristic may be added
here: a heuristic constraint could cut off the true optimum and the "bound" would stop being one.

Time model. Checkpoints are run-step starts S_c of a subset of ops (every op, or layer starts),
c_0 = 0 < c_1 < ... < c_K = n_ops, where S_{n_ops} = T is the end of the step. Interval k is
(S_{c_{k-1}}, S_{c_k}]; its length is the run-step durations of ops c_{k-1} .. c_k - 1 plus a gap
variable sigma_k >= 0 (stalls and any recompute steps in that interval). So T = sum(durations) +
sum(sigma): stalls are variables, not assumed away.

Variables (all in [0, 1] unless said):
- keep/swap/recompute indicators per saved tensor (binary in the MILP, summing to 1);
- o[t,k]: offload of t completed by S_{c_k}; u[t,k]: prefetch of t started by S_{c_k}
  (relaxed to [0, 1]: a fraction is weaker than the true 0/1, so still a valid bound);
- q[t,k], v[t,k] >= 0: d2h / h2d engine work (ms) on t inside interval k (a preemptive relaxation
  of the serial copy engines);
- sigma_k >= 0 (ms); z[p,k]: "producer p is recomputed for a reader before S_{c_k}".

Units inside the LP: milliseconds and fractions of the budget, for conditioning.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse

from slackswap.errors import ConfigError
from slackswap.graph import Graph, Phase
from slackswap.hardware import Hardware

MS_PER_S = 1e3
GRANULARITIES: tuple[str, ...] = ("op", "layer")


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


@dataclass(frozen=True)
class BoundProblem:
    """The assembled MILP `min c@x s.t. lo <= A@x <= hi, bounds, integrality` plus its index maps."""

    c: np.ndarray
    a: sparse.csr_array
    lo: np.ndarray
    hi: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integrality: np.ndarray
    saved: tuple[SavedInfo, ...]
    #: Column of (keep, swap, recompute) for saved[i].
    decision_cols: tuple[tuple[int, int, int], ...]
    checkpoints: tuple[int, ...]
    total_run_s: float
    #: Per op: bytes resident at its start for sure whatever the plan (the all-recompute floor).
    floor_bytes: tuple[int, ...]


def transfer_ms(size_bytes: int, bytes_per_s: float, latency_s: float) -> float:
    """Duration of one copy on one engine, as the simulator charges it: latency + bytes / bandwidth."""
    return (latency_s + size_bytes / bytes_per_s) * MS_PER_S


def checkpoints_for(graph: Graph, granularity: str) -> tuple[int, ...]:
    """Op positions whose start times are modelled. Always 0 and the virtual end n_ops.

    `op`: every op (tightest, largest). `layer`: the first op of each (layer, phase) run, so each
    layer's forward and backward span is one window.
    """
    if granularity not in GRANULARITIES:
        raise ConfigError("planner.options.granularity", granularity, f"unknown; known: {GRANULARITIES}")
    n = len(graph.ops)
    if granularity == "op":
        return tuple(range(n + 1))
    points = {0, n}
    for i in range(1, n):
        prev, op = graph.ops[i - 1], graph.ops[i]
        if (op.layer, op.phase) != (prev.layer, prev.phase):
            points.add(i)
    return tuple(sorted(points))


def saved_infos(graph: Graph, hardware: Hardware) -> tuple[SavedInfo, ...]:
    index = graph.op_index
    link = hardware.link
    out = []
    for t in graph.saved_tensors:
        readers = frozenset(index[c] for c in t.consumers)
        bwd = [r for r in readers if graph.ops[r].phase == Phase.BACKWARD]
        out.append(
            SavedInfo(
                name=t.name,
                size_bytes=t.size_bytes,
                producer=index[t.producer],
                first_bwd=min(bwd),
                last_reader=max(readers),
                readers=readers,
                d2h_ms=transfer_ms(t.size_bytes, link.d2h_effective_bytes_per_s, link.latency_s),
                h2d_ms=transfer_ms(t.size_bytes, link.h2d_effective_bytes_per_s, link.latency_s),
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
        diff[start] += t.size_bytes
        diff[end + 1] -= t.size_bytes
    return list(np.cumsum(diff[:-1]).astype(np.int64).tolist())


class _Columns:
    def __init__(self) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.cost: list[float] = []
        self.integer: list[int] = []

    def add(self, lb: float = 0.0, ub: float = np.inf, cost: float = 0.0, integer: bool = False) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.cost.append(cost)
        self.integer.append(1 if integer else 0)
        return len(self.lb) - 1


class _Rows:
    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, terms: Sequence[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(self.lo)
        for col, val in terms:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lo.append(lo)
        self.hi.append(hi)


def build_bound_problem(graph: Graph, hardware: Hardware, budget_bytes: int, granularity: str) -> BoundProblem:
    """Assemble the bound MILP. Objective: total gap time sum(sigma) in ms, so T = run time + objective."""
    ops = graph.ops
    n = len(ops)
    dur_ms = [op.duration_s * MS_PER_S for op in ops]
    cps = checkpoints_for(graph, granularity)
    K = len(cps) - 1  # intervals 1..K
    run_ms = [0.0] + [sum(dur_ms[cps[k - 1] : cps[k]]) for k in range(1, K + 1)]
    saved = saved_infos(graph, hardware)
    fixed = fixed_bytes_per_op(graph)
    cols = _Columns()
    rows = _Rows()
    scale = 1.0 / budget_bytes

    sigma = [-1] + [cols.add(cost=1.0) for _ in range(1, K + 1)]
    decision_cols = []
    for info in saved:
        # Only forward (and loss) ops can be recomputed (validator rule), so r = 0 for the others.
        recomputable = ops[info.producer].phase in (Phase.FORWARD, Phase.LOSS)
        kc, sc = cols.add(0, 1, 0, True), cols.add(0, 1, 0, True)
        rc = cols.add(0, 1 if recomputable else 0, 0, True)
        rows.add([(kc, 1), (sc, 1), (rc, 1)], 1, 1)
        decision_cols.append((kc, sc, rc))

    def first_cp_at_or_after(pos: int) -> int:
        return bisect.bisect_left(cps, pos)

    # Offload / prefetch progress and engine work per saved tensor.
    o_col: list[dict[int, int]] = []
    u_col: list[dict[int, int]] = []
    q_by_interval: dict[int, list[int]] = {k: [] for k in range(1, K + 1)}
    v_by_interval: dict[int, list[int]] = {k: [] for k in range(1, K + 1)}
    for info, (_, sc, _) in zip(saved, decision_cols, strict=True):
        kb = first_cp_at_or_after(info.first_bwd)
        k_first = bisect.bisect_right(cps, info.producer)  # first checkpoint strictly after producer
        inner = [k for k in range(k_first, kb)]  # checkpoints with producer < c_k < first_bwd
        o = {k: cols.add(0, 1) for k in inner}
        u = {k: cols.add(0, 1) for k in inner}
        q = {k: cols.add() for k in range(k_first, kb + 1)}
        v = {k: cols.add() for k in range(k_first, kb + 1)}
        for k in q:
            q_by_interval[k].append(q[k])
            v_by_interval[k].append(v[k])
        for a, b in zip(inner, inner[1:], strict=False):
            rows.add([(o[a], 1), (o[b], -1)], -np.inf, 0)
            rows.add([(u[a], 1), (u[b], -1)], -np.inf, 0)
        for k in inner:
            rows.add([(o[k], 1), (sc, -1)], -np.inf, 0)
            rows.add([(u[k], 1), (o[k], -1)], -np.inf, 0)
            # offload completed by S_{c_k} => its work was done in intervals up to k
            rows.add([(o[k], info.d2h_ms)] + [(q[j], -1) for j in q if j <= k], -np.inf, 0)
            # any prefetch work in interval k => the prefetch started by S_{c_k}
            rows.add([(v[k], 1), (u[k], -info.h2d_ms)], -np.inf, 0)
            # not started by S_{c_k} => all its work lies in (S_{c_k}, S_{first_bwd}]
            rows.add(
                [(sc, info.h2d_ms), (u[k], -info.h2d_ms)] + [(v[j], -1) for j in v if j > k], -np.inf, 0
            )
        rows.add([(v[kb], 1), (sc, -info.h2d_ms)], -np.inf, 0)
        rows.add([(sc, info.d2h_ms)] + [(q[j], -1) for j in q], -np.inf, 0)
        rows.add([(sc, info.h2d_ms)] + [(v[j], -1) for j in v], -np.inf, 0)
        o_col.append(o)
        u_col.append(u)

    link = hardware.link
    for k in range(1, K + 1):
        for engines, work in ((link.d2h_engines, q_by_interval[k]), (link.h2d_engines, v_by_interval[k])):
            if work:
                rows.add([(w, 1) for w in work] + [(sigma[k], -engines)], -np.inf, engines * run_ms[k])

    # Recompute: each recomputed producer runs once more, before its tensor's first backward reader.
    kb_of = [first_cp_at_or_after(info.first_bwd) for info in saved]
    by_producer: dict[int, list[int]] = {}
    for i, info in enumerate(saved):
        by_producer.setdefault(info.producer, []).append(i)
    for k in sorted(set(kb_of) | {K}):
        terms = [(sigma[j], 1.0) for j in range(1, k + 1)]
        for p, members in by_producer.items():
            due = [i for i in members if kb_of[i] <= k]
            if not due:
                continue
            z = cols.add(0, 1)
            terms.append((z, -dur_ms[p]))
            for i in due:
                rows.add([(z, 1), (decision_cols[i][2], -1)], 0, np.inf)
        rows.add(terms, 0, np.inf)

    # Memory at the start of every op.
    floor = []
    for j in range(n):
        const = fixed[j]
        terms: list[tuple[int, float]] = []
        nc = first_cp_at_or_after(j)
        pc = bisect.bisect_right(cps, j) - 1
        for i, info in enumerate(saved):
            if not info.producer <= j <= info.last_reader:
                continue
            kc, sc, _ = decision_cols[i]
            if j == info.producer or j in info.readers:
                const += info.size_bytes
                continue
            w = info.size_bytes * scale
            terms.append((kc, w))
            if j < info.first_bwd:
                # swapped: resident until its offload completes, and again once its prefetch starts
                if nc in o_col[i]:
                    terms += [(sc, w), (o_col[i][nc], -w)]
                if pc in u_col[i]:
                    terms.append((u_col[i][pc], w))
        floor.append(int(const))
        if terms:
            rows.add(terms, -np.inf, 1.0 - const * scale)

    a = sparse.coo_array((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lo), len(cols.lb))).tocsr()
    return BoundProblem(
        c=np.asarray(cols.cost),
        a=a,
        lo=np.asarray(rows.lo),
        hi=np.asarray(rows.hi),
        lb=np.asarray(cols.lb),
        ub=np.asarray(cols.ub),
        integrality=np.asarray(cols.integer),
        saved=saved,
        decision_cols=tuple(decision_cols),
        checkpoints=cps,
        total_run_s=sum(op.duration_s for op in ops),
        floor_bytes=tuple(floor),
    )


def keep_all_peak_bytes(graph: Graph) -> int:
    """Peak of resident bytes over op starts when every tensor lives from its producer to its last
    reader (the keep-all schedule). Memory only grows at op starts, so the peak is at one of them."""
    index = graph.op_index
    diff = [0] * (len(graph.ops) + 1)
    for t in graph.tensors.values():
        start = index[t.producer]
        end = max((index[c] for c in t.consumers), default=start)
        diff[start] += t.size_bytes
        diff[end + 1] -= t.size_bytes
    return int(np.max(np.cumsum(diff[:-1])))
