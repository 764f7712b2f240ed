"""Recompute steps before the peak: the split of the bound problem's recompute time at a checkpoint.

The recompute rows of `milp.model` charge every recompute step to the gap time before its tensor's
first backward reader, wherever that gap lies. Gap time before the peak is also copy-engine time:
the relaxation could run every recompute step just before the forward/backward boundary, where it
gives the d2h engine time to finish offloads, and count none of the recomputed copies there. A real
plan cannot: a recompute step before a checkpoint S_{c*} whose copy a later backward reader reads
holds that copy at S_{c*} (docs/milp.md, "Recompute before the peak").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from slackswap.planners.milp.facts import SavedInfo


def keep_all_peak_op(saved: Sequence[SavedInfo], const: Sequence[int]) -> int:
    """The op at whose start keeping every saved tensor holds the most bytes (the first, on a tie):
    its floor `const` (which counts what it produces and reads) + every saved tensor alive across it.
    Where the split is made is a choice, not a condition: any checkpoint gives a valid bound."""
    diff = [0] * (len(const) + 1)
    for info in saved:
        for lo, hi in zip([info.producer, *sorted(info.readers)], sorted(info.readers), strict=False):
            if hi > lo + 1:  # alive across the ops strictly between two of its uses
                diff[lo + 1] += info.size_bytes
                diff[hi] -= info.size_bytes
    return int(np.argmax(np.asarray(const, dtype=np.float64) + np.cumsum(diff[:-1])))


def recompute_split(cols, rows, *, k_star: int, n_intervals: int, sigma: Sequence[int], producer: Sequence[int],
                    recompute_cols: Sequence[int | None], kb_of: Sequence[int],
                    dur_ms: Sequence[float]) -> dict[int, int]:
    """Columns y_i per saved tensor i due after checkpoint k_star: "the copy of i that its first backward
    reader reads was made before S_{c_k_star}" (y_i <= r_i), and the rows that split the gap time there.

    Take any valid plan, simulated. A recompute-decided tensor's first backward reader b reads a copy
    made by a recompute step of its producer (validator). If that step ran before S_{c*}, it lies in
    the gaps of intervals <= k_star; else in intervals after k_star and before S_b. So, with yP_p >=
    y_i for i of producer p and zB[p,k] >= r_i - y_i for i of p due by checkpoint k:
    - sum_{j <= k_star} sigma_j >= sum_p dur_p yP_p (distinct producers are distinct steps);
    - sum_{k_star < j <= k} sigma_j >= sum_p dur_p zB[p,k] for every k > k_star.
    The caller adds the copy's bytes x y_i to the memory rows at or after c* and before b.
    `recompute_cols[i]`: the column r_i, or None where i cannot be recomputed.
    """
    y: dict[int, int] = {}
    y_producer: dict[int, int] = {}
    due: dict[int, dict[int, list[int]]] = {}
    for i, r in enumerate(recompute_cols):
        if r is None or kb_of[i] <= k_star:
            continue
        y[i] = cols.add(0, 1)
        rows.add([(y[i], 1), (r, -1)], -np.inf, 0)
        p = producer[i]
        if p not in y_producer:
            y_producer[p] = cols.add(0, 1)
        rows.add([(y_producer[p], 1), (y[i], -1)], 0, np.inf)
        due.setdefault(kb_of[i], {}).setdefault(p, []).append(i)
    if not y:
        return y
    rows.add([(sigma[j], 1.0) for j in range(1, k_star + 1)]
             + [(c, -dur_ms[p]) for p, c in y_producer.items()], 0, np.inf)
    z_last: dict[int, int] = {}
    for k in sorted(set(due) | {n_intervals}):
        for p, new in due.get(k, {}).items():
            z = cols.add(0, 1)
            for i in new:
                rows.add([(z, 1), (recompute_cols[i], -1), (y[i], 1)], 0, np.inf)
            if p in z_last:
                rows.add([(z, 1), (z_last[p], -1)], 0, np.inf)
            z_last[p] = z
        rows.add([(sigma[j], 1.0) for j in range(k_star + 1, k + 1)]
                 + [(z, -dur_ms[p]) for p, z in z_last.items()], 0, np.inf)
    return y
