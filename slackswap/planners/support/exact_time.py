"""Op durations as integer picoseconds, for running sums that are exact in any order.

A planner that keeps a running total (the uncovered part of a recompute chain, the cost of a class
of evicted tensors) and adds or subtracts ops in whatever order picks and evictions happen would,
with floats, get totals that depend on that order in the last bits, and so break ties differently
from a fresh sum. Integers make the running total equal to the fresh sum. One picosecond is far
below any op's modelled time (the shortest are microseconds).
"""

from __future__ import annotations

from slackswap.graph import Graph

PS_PER_S = 10**12


def op_durations_ps(graph: Graph) -> dict[str, int]:
    """Each op's duration in integer picoseconds."""
    return {op.name: round(op.duration_s * PS_PER_S) for op in graph.ops}
