"""Copy-engine flows of the bound problem: the columns and rows that model one offload and one prefetch.

A flow is the offload of a device copy after its producer's run step and the prefetch that brings it
back before a deadline checkpoint `kb` (a swapped saved tensor's first backward reader; for a swapped
checkpoint candidate, the first backward reader of the saved tensor whose recompute reads it). Each
row is a necessary condition of the simulated execution of a valid plan (docs/milp.md, "Copy
engines"); the module only assembles them, `model.build_bound_problem` decides what a flow stands for.

Engine work is held as CUMULATIVE columns Q[k] = d2h work in intervals k_first..k (V likewise for h2d),
non-decreasing in k; the work inside interval k is Q[k] - Q[k-1]. This is the same polyhedron as
per-interval work columns (a substitution), with O(K) instead of O(K^2) nonzeros per flow.
"""

from __future__ import annotations

import numpy as np


def cumulative_engine_work(cols, rows, q_by_interval, v_by_interval, k_first: int, kb: int):
    """Columns Q[k], V[k] (ms): a flow's cumulative d2h / h2d engine work up to checkpoint k, for k in
    k_first..kb. They never decrease, and each interval's share (Q[k] - Q[k-1]) is charged to that
    interval's engine capacity through `q_by_interval` / `v_by_interval`."""
    span = range(k_first, kb + 1)
    Q = {k: cols.add() for k in span}
    V = {k: cols.add() for k in span}
    for k in span:
        q_by_interval[k].append((Q[k], 1.0))
        v_by_interval[k].append((V[k], 1.0))
        if k > k_first:
            q_by_interval[k].append((Q[k - 1], -1.0))
            v_by_interval[k].append((V[k - 1], -1.0))
            rows.add([(Q[k - 1], 1), (Q[k], -1)], -np.inf, 0)
            rows.add([(V[k - 1], 1), (V[k], -1)], -np.inf, 0)
    return Q, V


def non_decreasing(rows, columns: tuple[dict[int, int], ...], checkpoints: list[int]) -> None:
    """"Done by checkpoint k" indicators only ever switch on: column[a] <= column[b] for a < b."""
    for a, b in zip(checkpoints, checkpoints[1:], strict=False):
        for column in columns:
            rows.add([(column[a], 1), (column[b], -1)], -np.inf, 0)


def swap_flow(cols, rows, q_by_interval, v_by_interval, *, swap_col: int, k_first: int, kb: int,
              d2h_ms: float, h2d_ms: float, binary: bool = False) -> tuple[dict[int, int], dict[int, int]]:
    """One copy's offload and prefetch, switched on by the column `swap_col` (1: the copy is swapped).

    `k_first`: the first checkpoint strictly after the producer (the offload is issued after the
    producer's run step, so its work lies in intervals k_first..); `kb`: the first checkpoint at or
    after the deadline by which the prefetch has finished. Returns (o, u): o[k] = "the offload has
    completed by S_{c_k}", u[k] = "the prefetch has started by S_{c_k}", for k_first <= k < kb.
    `binary`: o and u integral (the plan problem); relaxed to [0, 1] for the bound.
    """
    inner = list(range(k_first, kb))  # checkpoints with producer < c_k < deadline
    o = {k: cols.add(0, 1, 0, binary) for k in inner}
    u = {k: cols.add(0, 1, 0, binary) for k in inner}
    Q, V = cumulative_engine_work(cols, rows, q_by_interval, v_by_interval, k_first, kb)
    non_decreasing(rows, (o, u), inner)
    for k in inner:
        rows.add([(o[k], 1), (swap_col, -1)], -np.inf, 0)
        rows.add([(u[k], 1), (o[k], -1)], -np.inf, 0)
        # offload completed by S_{c_k} => its work was done in intervals up to k
        rows.add([(o[k], d2h_ms), (Q[k], -1)], -np.inf, 0)
        # any prefetch work in interval k => the prefetch started by S_{c_k}
        rows.add([(V[k], 1), (u[k], -h2d_ms)] + ([(V[k - 1], -1)] if k > k_first else []), -np.inf, 0)
        # not started by S_{c_k} => all its work lies in (S_{c_k}, S_{c_kb}]
        rows.add([(swap_col, h2d_ms), (u[k], -h2d_ms), (V[kb], -1), (V[k], 1)], -np.inf, 0)
    rows.add([(V[kb], 1), (swap_col, -h2d_ms)] + ([(V[kb - 1], -1)] if kb > k_first else []), -np.inf, 0)
    rows.add([(swap_col, d2h_ms), (Q[kb], -1)], -np.inf, 0)
    rows.add([(swap_col, h2d_ms), (V[kb], -1)], -np.inf, 0)
    return o, u


def group_swap_flow(cols, rows, q_by_interval, v_by_interval, *, k_first: int, kb: int,
                    members: list[tuple[int, float, float, float]], d2h_ms_per_unit: float, h2d_ms_per_unit: float,
                    d2h_fixed_ms: float, latency_ms: float,
                    exact_sizes: bool) -> tuple[dict[int, int], dict[int, int]]:
    """One flow for a group of copies sharing (k_first, kb): the sum of their `swap_flow` rows.

    `members`: (swap column, units, d2h ms, h2d ms) per copy, units = the bytes its copy moves (or
    fewer: then `exact_sizes` must be false) in budget fractions. Returns (O, U): O[k] stands for
    sum_i units_i o_i[k], U[k] for sum_i units_i u_i[k]. Every row is a sum of per-copy rows, with the
    fixed time of a copy bounded through the group's largest member (a copy of at most `largest`
    units takes at least (bytes term + fixed time / largest) per unit) or, where every member moves
    exactly its units, its smallest (at most (bytes term + latency / smallest) per unit); so the
    group is a relaxation of its members' flows (docs/milp.md, "Model size")."""
    s_terms = [(c, w) for c, w, _, _ in members]
    lat_terms = [(c, latency_ms) for c, _, _, _ in members]
    largest = max(w for _, w, _, _ in members)
    d2h_floor_per_unit = d2h_ms_per_unit + (d2h_fixed_ms / largest if largest > 0 else 0.0)
    smallest = min(w for _, w, _, _ in members)
    h2d_ceil_per_unit = h2d_ms_per_unit + latency_ms / smallest if exact_sizes and smallest > 0 else None
    inner = list(range(k_first, kb))
    o = {k: cols.add(0, np.inf) for k in inner}
    u = {k: cols.add(0, np.inf) for k in inner}
    Q, V = cumulative_engine_work(cols, rows, q_by_interval, v_by_interval, k_first, kb)
    non_decreasing(rows, (o, u), inner)
    for k in inner:
        rows.add([(o[k], 1)] + [(c, -w) for c, w in s_terms], -np.inf, 0)
        rows.add([(u[k], 1), (o[k], -1)], -np.inf, 0)
        rows.add([(o[k], d2h_floor_per_unit), (Q[k], -1)], -np.inf, 0)
        # prefetch work in interval k <= the started prefetches' copy times (latency kept: <=)
        previous = [(V[k - 1], -1)] if k > k_first else []
        rows.add([(V[k], 1), (u[k], -h2d_ms_per_unit)] + [(c, -w) for c, w in lat_terms] + previous, -np.inf, 0)
        rows.add([(c, w * h2d_ms_per_unit) for c, w in s_terms]
                 + [(u[k], -h2d_ms_per_unit), (V[kb], -1), (V[k], 1)], -np.inf, 0)
        if h2d_ceil_per_unit is not None:
            rows.add([(V[k], 1), (u[k], -h2d_ceil_per_unit)] + previous, -np.inf, 0)
            rows.add([(c, h2d) for c, _, _, h2d in members]
                     + [(u[k], -h2d_ceil_per_unit), (V[kb], -1), (V[k], 1)], -np.inf, 0)
    # every swapped member's whole copy time, latency included, by the group's deadline
    rows.add([(c, d2h) for c, _, d2h, _ in members] + [(Q[kb], -1)], -np.inf, 0)
    rows.add([(c, h2d) for c, _, _, h2d in members] + [(V[kb], -1)], -np.inf, 0)
    return o, u
