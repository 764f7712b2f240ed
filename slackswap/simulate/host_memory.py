"""Host (pinned) memory over a simulated step, from the plan's positions (`schedule.positions`).

An offload's host copy is live from the time its offload starts writing it to the time the prefetch
that frees it (`PlanPositions.last_prefetch`, the host-copy rule in docs/decisions/0020) has landed;
an offload no prefetch reads, or whose last prefetch never started (an infeasible run), holds its copy
to the end of the run. At one instant frees come before takes, as for device memory. The peak of that
curve is `SimResult.host_peak_bytes`, the pinned memory each rank needs (`slackswap.node.pinned_reason`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, chain, repeat
from operator import itemgetter

from slackswap.schedule.positions import PlanPositions


def host_peak_bytes(
    positions: PlanPositions, offload_start_s: Sequence[float], offloads_started: int,
    prefetch_end_s: Sequence[float], prefetches_started: int, end_s: float,
) -> int:
    """The most host bytes live at any instant of a run that started its first `offloads_started`
    offloads and `prefetches_started` prefetches (offloads and prefetches start in plan order). One
    sort and one running sum, both in C (the simulator calls this for every plan it runs)."""
    n = offloads_started
    last, nbytes = positions.last_prefetch[:n], positions.host_bytes[:n]
    freed_s = [prefetch_end_s[p] if 0 <= p < prefetches_started else end_s for p in last]
    # (time, 0 free / 1 take, bytes): at one instant frees sort before takes.
    events = sorted(chain(zip(freed_s, repeat(0), [-b for b in nbytes]),
                          zip(offload_start_s[:n], repeat(1), nbytes)))
    return max(accumulate(map(itemgetter(2), events)), default=0) if n else 0
