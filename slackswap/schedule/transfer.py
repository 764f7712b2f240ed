"""The copy engines: how long one copy takes and in which order each direction's engines serve copies.

One formula and one queue rule, used by the simulator's engine, the planners' fast replay, the
schedule builder's "alap" prefetch placement and the MILP's coefficients, so none of them can drift
(docs/simulation.md section 3).

- Duration: `latency_s + size_bytes * engines / effective_bytes_per_s`. The k engines of one
  direction share that direction's bandwidth equally, so each copy sees 1/k of it. An offload also
  pays the link's `d2h_setup_s` (a per-tensor pinned allocation; 0 with a buffer pool).
- The bandwidths are the ones this GPU really gets: on a shared node `slackswap.sharing` has already
  divided the switch uplink among the GPUs behind it and derated for both directions running.
- Queue: each direction serves its transfer list in list order. Copy k starts no earlier than it is
  ready (issued; for a prefetch, its offload done), no earlier than copy k-1 started (in order, even
  with several engines), and on the engine that frees up first.
"""

from __future__ import annotations

from slackswap.hardware import Hardware


def transfer_s(size_bytes: int, bytes_per_s: float, latency_s: float, engines: int = 1) -> float:
    """Time one copy occupies its engine: latency + bytes / (effective bandwidth / engines)."""
    return latency_s + size_bytes * engines / bytes_per_s


def d2h_s(size_bytes: int, hardware: Hardware) -> float:
    link = hardware.link
    return transfer_s(size_bytes, link.d2h_effective_bytes_per_s, link.latency_s + link.d2h_setup_s, link.d2h_engines)


def h2d_s(size_bytes: int, hardware: Hardware) -> float:
    link = hardware.link
    return transfer_s(size_bytes, link.h2d_effective_bytes_per_s, link.latency_s, link.h2d_engines)


class CopyQueue:
    """One direction's engines serving their list in order (the queue rule of the module docstring).

    The replay computes start times with it directly; the simulator's event loop applies the same
    rule event by event (only the head of the list may start, on a free engine), and the
    differential test (tests/test_schedule_differential.py) checks that they agree exactly.
    """

    def __init__(self, engines: int):
        self.free_at_s = [0.0] * engines
        self.last_start_s = 0.0

    def start(self, ready_s: float, duration_s: float) -> tuple[float, float]:
        """Start the next copy of the list; returns (start_s, end_s)."""
        engine = min(range(len(self.free_at_s)), key=self.free_at_s.__getitem__)
        start = max(ready_s, self.free_at_s[engine], self.last_start_s)
        end = start + duration_s
        self.free_at_s[engine] = end
        self.last_start_s = start
        return start, end
