"""Host (pinned) memory over a simulated step, from the plan's positions (`schedule.positions`).

An offload's host copy is live from the time its offload starts writing it to the time the prefetch
that frees it (`PlanPositions.last_prefetch`, the host-copy rule in docs/decisions/0020) has landed;
an offload no prefetch reads, or whose last prefetch never started (an infeasible run), holds its copy
to the end of the run. At one instant frees come before takes, as for device memory. The peak of that
curve is `SimResult.host_peak_bytes`, the pinned memory each rank needs (`slackswap.node.pinned_reason`).
"""

from __future__ import annotations

from collections.abc import Sequence

from slackswap.schedule.positions import PlanPositions


def host_peak_bytes(
    positions: PlanPositions, offload_start_s: Sequence[float], offloads_started: int,
    prefetch_end_s: Sequence[float], prefetches_started: int, end_s: float,
) -> int:
    """The most host bytes live at any instant of a run that started its first `offloads_started`
    offloads and `prefetches_started` prefetches (offloads and prefetches start in plan order)."""
    events: list[tuple[float, int, int]] = []  # (time, 0 free / 1 take, bytes)
    for k in range(offloads_started):
        p = positions.last_prefetch[k]
        freed_s = prefetch_end_s[p] if 0 <= p < prefetches_started else end_s
        nbytes = positions.host_bytes[k]
        events.append((offload_start_s[k], 1, nbytes))
        events.append((freed_s, 0, -nbytes))
    events.sort()
    peak = live = 0
    for _, _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak
