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
from typing import TYPE_CHECKING

import numpy as np

from slackswap.errors import ConfigError
from slackswap.graph import FORWARD_PHASES, Graph
from slackswap.hardware import Hardware
from slackswap.planners.milp.facts import (
    SavedInfo,
    chain_cut_pairs,
    chain_intermediate_bytes,
    chain_producers,
    checkpoints_for,
    fixed_bytes_per_op,
    keep_all_peak_bytes,
    last_forward_reader,
    reduced_memory_rows,
    saved_infos,
)
from slackswap.planners.milp.flows import group_swap_flow, swap_flow
from slackswap.planners.milp.peak import keep_all_peak_op, recompute_split
from slackswap.schedule.transfer import d2h_s, h2d_s, transfer_s

if TYPE_CHECKING:  # scipy.sparse (~0.25 s) is imported when a problem is built, not by the planner registry
    from scipy import sparse

MS_PER_S = 1e3
GRANULARITIES: tuple[str, ...] = ("op", "layer")
MEMORY_ROWS: tuple[str, ...] = ("all", "reduced")


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


def build_bound_problem(
    graph: Graph,
    hardware: Hardware,
    budget_bytes: int,
    granularity: str,
    *,
    memory_rows: str = "all",
    plan_rules: bool = False,
    layers_per_window: int = 1,
    transfer_groups: bool = False,
    chain_cuts: bool = False,
    candidates: bool = True,
    peak_split: bool = False,
) -> BoundProblem:
    """Assemble the bound MILP. Objective: total gap time sum(sigma) in ms, so T = run time + objective.

    `memory_rows`: "all" (a memory row at every op start) or "reduced" (per (layer, phase) span only
    the op with the largest unmovable floor and the op with the largest keep-all resident bytes, plus
    every op of the spans around the forward/backward boundary). Dropping rows only enlarges the
    feasible set, so the bound stays valid (docs/milp.md).

    `plan_rules=True` builds the PLAN problem instead (never used for the bound): memory and time as
    `build_schedule` lays them out, which is tighter than necessary and therefore not a valid bound:
    a recompute-decided tensor's run copy lives until its last forward reader and its recompute copy
    from its first to its last backward reader; a recompute also pays (time) for its chain of
    non-saved forward inputs, whose copies (memory) sit beside it at its first backward reader.

    `chain_cuts=True` adds the chain-or-memory cuts (bound problem only; `chain_cut_pairs`,
    docs/milp.md "Chain cuts"): a recompute-decided tensor whose producer reads a non-saved forward
    tensor u either pays for a recompute of u's producer, or holds min(size t, size u) on the device
    from u's last forward reader to t's first backward reader.

    `candidates=True` (the enlarged plan space, docs/milp.md "Checkpoint candidates"): a plan may also
    keep or swap forward tensors autograd does not save. Keeping u is a copy of u the chain cut
    already counts; swapping u is a third way out of it, so a cut whose u is a checkpoint candidate
    gets an escape column e in [0, 1] (w <= z + e) that switches on u's own offload / prefetch flow
    (due before t's first backward reader, on the per-interval engine rows) and the memory of u's
    copies while the offload runs and once the prefetch has started: a swap of u, priced as one.
    `candidates=False` is the bound over plans that decide only saved tensors.

    `peak_split=True` (bound problem only; docs/milp.md "Recompute before the peak"): the recompute
    time is split at the checkpoint c* at or before the op where keeping everything peaks; a recompute
    step before S_{c*} holds its copy from there to its tensor's first backward reader
    (`milp.peak.recompute_split`), so gap time before the peak no longer serves both as recompute time
    and as copy-engine time for free.
    """
    if memory_rows not in MEMORY_ROWS:
        raise ConfigError("planner.options.memory_rows", memory_rows, f"unknown; known: {MEMORY_ROWS}")
    ops = graph.ops
    n = len(ops)
    dur_ms = [op.duration_s * MS_PER_S for op in ops]
    cps = checkpoints_for(graph, granularity, layers_per_window)
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
        recomputable = ops[info.producer].phase in FORWARD_PHASES
        kc, sc = cols.add(0, 1, 0, True), cols.add(0, 1, 0, True)
        rc = cols.add(0, 1 if recomputable else 0, 0, True)
        rows.add([(kc, 1), (sc, 1), (rc, 1)], 1, 1)
        decision_cols.append((kc, sc, rc))

    def first_cp_at_or_after(pos: int) -> int:
        return bisect.bisect_left(cps, pos)

    # Offload / prefetch progress and engine work per saved tensor. Engine work is held as CUMULATIVE
    # columns Q[t,k] = d2h work on t in intervals k_first..k (V likewise for h2d), non-decreasing in
    # k; the work inside interval k is Q[t,k] - Q[t,k-1]. This is the same polyhedron as per-interval
    # work columns (substitution), with O(K) instead of O(K^2) nonzeros per tensor.
    o_col: list[dict[int, int]] = []
    u_col: list[dict[int, int]] = []
    q_by_interval: dict[int, list[tuple[int, float]]] = {k: [] for k in range(1, K + 1)}
    v_by_interval: dict[int, list[tuple[int, float]]] = {k: [] for k in range(1, K + 1)}
    link = hardware.link
    group_of: list[int] = [-1] * len(saved)
    g_o: list[dict[int, int]] = []
    g_u: list[dict[int, int]] = []
    g_members: list[list[int]] = []
    if transfer_groups:
        # Grouped (relaxed) transfer model: one flow per group of tensors sharing (first checkpoint
        # after the producer, first checkpoint at/after the first backward reader). O_g[k], U_g[k]
        # (budget fractions) stand for sum_i size_i o[i,k] and sum_i size_i u[i,k]; Q_g, V_g (ms) for the
        # summed cumulative engine work. Every row below is a sum of per-tensor rows, with the fixed
        # time of a copy bounded through the group's largest (or smallest) member where only the bytes
        # are known, so it is a relaxation of the per-tensor model (docs/milp.md).
        # the bytes term of slackswap.schedule.transfer's formula, per budget unit
        d2h_ms_per_unit = transfer_s(budget_bytes, link.d2h_effective_bytes_per_s, 0.0, link.d2h_engines) * MS_PER_S
        h2d_ms_per_unit = transfer_s(budget_bytes, link.h2d_effective_bytes_per_s, 0.0, link.h2d_engines) * MS_PER_S
        keys: dict[tuple[int, int], int] = {}
        for i, info in enumerate(saved):
            key = (bisect.bisect_right(cps, info.producer), first_cp_at_or_after(info.first_bwd))
            group_of[i] = keys.setdefault(key, len(keys))
            if group_of[i] == len(g_members):
                g_members.append([])
            g_members[group_of[i]].append(i)
        d2h_fixed_ms = (link.latency_s + link.d2h_setup_s) * MS_PER_S
        for (k_first, kb), g in keys.items():
            members = g_members[g]
            o, u = group_swap_flow(
                cols, rows, q_by_interval, v_by_interval, k_first=k_first, kb=kb,
                members=[(decision_cols[i][1], saved[i].size_bytes * scale, saved[i].d2h_ms, saved[i].h2d_ms)
                         for i in members],
                d2h_ms_per_unit=d2h_ms_per_unit, h2d_ms_per_unit=h2d_ms_per_unit, d2h_fixed_ms=d2h_fixed_ms,
                latency_ms=link.latency_s * MS_PER_S,
                exact_sizes=all(saved[i].size_bytes == graph.tensors[saved[i].name].size_bytes for i in members))
            g_o.append(o)
            g_u.append(u)
    else:
        for info, (_, sc, _) in zip(saved, decision_cols, strict=True):
            o, u = swap_flow(cols, rows, q_by_interval, v_by_interval, swap_col=sc,
                             k_first=bisect.bisect_right(cps, info.producer),  # first checkpoint after it
                             kb=first_cp_at_or_after(info.first_bwd), d2h_ms=info.d2h_ms, h2d_ms=info.h2d_ms,
                             binary=plan_rules)
            o_col.append(o)
            u_col.append(u)

    # Chain cuts: w = r_t x [u's producer recomputed before t's first backward reader, or u swapped]
    # (w <= r_t, and w <= z[u's producer, kb(t)] + e below); memory rows between u's last reader and
    # t's first backward reader hold min(size_t, size_u) x (r_t - w), plus, when u is a checkpoint
    # candidate, the copies of u its swap holds: e - o_e[nc] + u_e[pc] (docs/milp.md "Checkpoint
    # candidates"). e switches on u's own offload / prefetch flow, due before t's first backward reader.
    cut_pairs = chain_cut_pairs(graph, saved) if chain_cuts and not plan_rules else ()
    cut_w = []
    cut_escape: list[tuple[int, dict[int, int], dict[int, int]] | None] = []
    candidate_names = graph.candidate_names if candidates else frozenset()
    escape_groups: dict[tuple[int, int], list[int]] = {}
    escape_members: dict[int, tuple[int, float, float, float]] = {}
    for i, p_u, _, _, _, u in cut_pairs:
        w = cols.add(0, 1)
        rows.add([(w, 1), (decision_cols[i][2], -1)], -np.inf, 0)
        cut_w.append(w)
        if u not in candidate_names:
            cut_escape.append(None)
            continue
        e = cols.add(0, 1)
        size = graph.tensors[u].size_bytes
        k_first, kb = bisect.bisect_right(cps, p_u), first_cp_at_or_after(saved[i].first_bwd)
        copy_ms = (d2h_s(size, hardware) * MS_PER_S, h2d_s(size, hardware) * MS_PER_S)
        if transfer_groups:  # one flow per (k_first, kb), as for saved tensors; built below
            escape_groups.setdefault((k_first, kb), []).append(len(cut_escape))
            escape_members[len(cut_escape)] = (e, size * scale, *copy_ms)
            cut_escape.append((e, {}, {}))
            continue
        o, pf = swap_flow(cols, rows, q_by_interval, v_by_interval, swap_col=e, k_first=k_first, kb=kb,
                          d2h_ms=copy_ms[0], h2d_ms=copy_ms[1])
        cut_escape.append((e, o, pf))
    # grouped escapes: (pair indices, O, U); O[k], U[k] stand for sum_n size_u o_n[k], sum_n size_u u_n[k]
    escape_flows: list[tuple[list[int], dict[int, int], dict[int, int]]] = []
    escape_flow_of: dict[int, int] = {}
    for (k_first, kb), pairs in escape_groups.items():
        o, pf = group_swap_flow(cols, rows, q_by_interval, v_by_interval, k_first=k_first, kb=kb,
                                members=[escape_members[n] for n in pairs], d2h_ms_per_unit=d2h_ms_per_unit,
                                h2d_ms_per_unit=h2d_ms_per_unit, d2h_fixed_ms=d2h_fixed_ms,
                                latency_ms=link.latency_s * MS_PER_S, exact_sizes=True)
        escape_flow_of.update(dict.fromkeys(pairs, len(escape_flows)))
        escape_flows.append((pairs, o, pf))

    peak_split = peak_split and not plan_rules
    for k in range(1, K + 1):
        for engines, work in ((link.d2h_engines, q_by_interval[k]), (link.h2d_engines, v_by_interval[k])):
            if work:
                rows.add(work + [(sigma[k], -engines)], -np.inf, engines * run_ms[k])

    # Recompute: each recomputed producer runs once more, before its tensor's first backward reader.
    # z[p,k] is non-decreasing in k and >= r_t for every t of p due by c_k (the due sets grow with k).
    kb_of = [first_cp_at_or_after(info.first_bwd) for info in saved]
    by_producer: dict[int, list[int]] = {}
    for i, info in enumerate(saved):
        producers = chain_producers(graph, info.name) if plan_rules else (info.producer,)
        for p in producers:
            by_producer.setdefault(p, []).append(i)
    due_at: dict[int, dict[int, list[int]]] = {}  # k -> producer -> members first due at k
    for p, members in by_producer.items():
        for i in members:
            due_at.setdefault(kb_of[i], {}).setdefault(p, []).append(i)
    for i, p_u, _, _, _, _ in cut_pairs:  # a z column for u's producer at kb(t), with no r_t >= row
        due_at.setdefault(kb_of[i], {}).setdefault(p_u, [])
    z_at: dict[tuple[int, int], int] = {}
    z_last: dict[int, int] = {}
    for k in sorted(set(kb_of) | {K}):
        for p, new in due_at.get(k, {}).items():
            z = cols.add(0, 1)
            for i in new:
                rows.add([(z, 1), (decision_cols[i][2], -1)], 0, np.inf)
            if p in z_last:
                rows.add([(z, 1), (z_last[p], -1)], 0, np.inf)
            z_last[p] = z
            z_at[(p, k)] = z
        terms = [(sigma[j], 1.0) for j in range(1, k + 1)]
        terms += [(z, -dur_ms[p]) for p, z in z_last.items()]
        rows.add(terms, 0, np.inf)

    for (i, p_u, _, _, _, _), w, escape in zip(cut_pairs, cut_w, cut_escape, strict=True):
        rows.add([(w, 1), (z_at[(p_u, kb_of[i])], -1)] + ([(escape[0], -1)] if escape else []), -np.inf, 0)

    # Memory at the start of the selected ops (all, or the reduced set: dropping rows is valid).
    const = list(fixed)
    for info in saved:
        for j in {info.producer} | info.readers:
            const[j] += info.size_bytes
    floor = [int(c) for c in const]
    early: dict[int, int] = {}  # saved index -> y: its first backward reader's copy was made before S_{c*}
    c_star = n
    if peak_split:
        k_star = bisect.bisect_right(cps, keep_all_peak_op(saved, const)) - 1
        c_star = cps[k_star]
        early = recompute_split(cols, rows, k_star=k_star, n_intervals=K, sigma=sigma,
                                producer=[info.producer for info in saved],
                                recompute_cols=[rc if ops[info.producer].phase in FORWARD_PHASES else None
                                                for info, (_, _, rc) in zip(saved, decision_cols, strict=True)],
                                kb_of=kb_of, dur_ms=dur_ms)
    chain_bytes = [chain_intermediate_bytes(graph, info.name) if plan_rules else 0 for info in saved]
    last_fwd = [last_forward_reader(graph, info) for info in saved]
    selected = range(n) if memory_rows == "all" else reduced_memory_rows(graph, saved, const, chain_bytes)
    for j in selected:
        terms: list[tuple[int, float]] = []
        swap_status: dict[int, list[int]] = {}
        nc = first_cp_at_or_after(j)
        pc = bisect.bisect_right(cps, j) - 1
        for i, info in enumerate(saved):
            if not info.producer <= j <= info.last_reader:
                continue
            kc, sc, rc = decision_cols[i]
            w = info.size_bytes * scale
            if plan_rules and j == info.first_bwd and chain_bytes[i]:
                terms.append((rc, chain_bytes[i] * scale))
            if j == info.producer or j in info.readers:
                continue
            terms.append((kc, w))
            if i in early and c_star <= j < info.first_bwd:  # a recompute copy made before S_{c*}
                terms.append((early[i], w))
            if plan_rules and (j <= last_fwd[i] or j > info.first_bwd):
                # build_schedule: the run copy lives to its last forward reader (swap or recompute);
                # the prefetched or recomputed copy from the first to the last backward reader.
                terms += [(sc, w), (rc, w)]
            elif j < info.first_bwd:
                if transfer_groups:
                    swap_status.setdefault(group_of[i], []).append(i)
                    continue
                # swapped: resident until its offload completes, and again once its prefetch starts
                if nc in o_col[i]:
                    terms += [(sc, w), (o_col[i][nc], -w)]
                if pc in u_col[i]:
                    terms.append((u_col[i][pc], w))
        escape_status: dict[int, list[int]] = {}
        for n, ((i, _, m_bytes, lo_j, hi_j, _), w, escape) in enumerate(zip(cut_pairs, cut_w, cut_escape,
                                                                             strict=True)):
            if lo_j <= j <= hi_j and j not in saved[i].readers:
                m = m_bytes * scale
                terms += [(decision_cols[i][2], m), (w, -m)]
                if i in early and c_star <= j and j != saved[i].producer:
                    # the copy of t or u may be the recompute copy of t the y term above counts
                    terms.append((early[i], -m))
                if n in escape_flow_of:
                    escape_status.setdefault(escape_flow_of[n], []).append(n)
                elif escape:  # u swapped: its run copy until the offload ends, its prefetched copy after
                    e, o, pf = escape
                    if nc in o:
                        terms += [(e, m), (o[nc], -m)]
                    if pc in pf:
                        terms.append((pf[pc], m))
        for g, pairs_at_j in escape_status.items():
            # sum_n m_n (e_n - o_n[nc] + u_n[pc]) over these pairs is at least sum_n m_n e_n - O[nc]
            # (m_n <= size_u), + U[pc] when every pair of the flow is here and m_n = size_u for each.
            pairs, o, pf = escape_flows[g]
            if nc not in o:
                continue
            terms += [(cut_escape[n][0], cut_pairs[n][2] * scale) for n in pairs_at_j]
            terms.append((o[nc], -1.0))
            if (len(pairs_at_j) == len(pairs) and pc in pf
                    and all(cut_pairs[n][2] == graph.tensors[cut_pairs[n][5]].size_bytes for n in pairs)):
                terms.append((pf[pc], 1.0))
        for g, members in swap_status.items():
            # sum_i size_i (s_i - o[i,nc] + u[i,pc]) over the members in swap status at j is at least
            # S_members - O_g[nc] (+ U_g[pc] when every member of the group is among them).
            if nc not in g_o[g]:
                continue
            terms += [(decision_cols[i][1], saved[i].size_bytes * scale) for i in members]
            terms.append((g_o[g][nc], -1.0))
            if len(members) == len(g_members[g]) and pc in g_u[g]:
                terms.append((g_u[g][pc], 1.0))
        if terms:
            rows.add(terms, -np.inf, 1.0 - const[j] * scale)

    from scipy import sparse

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



#: The graph facts (`milp.facts`) stay importable from here, where they were first.
__all__ = ["GRANULARITIES", "MEMORY_ROWS", "MS_PER_S", "BoundProblem", "build_bound_problem", "SavedInfo",
    "chain_cut_pairs", "chain_intermediate_bytes", "chain_producers", "checkpoints_for", "fixed_bytes_per_op",
    "keep_all_peak_bytes", "last_forward_reader", "reduced_memory_rows", "saved_infos"]
