"""Drop the swaps a plan's budget does not need where a transfer's cost is mostly its fixed part.

A swap-first planner (slackswap) swaps every tensor whose copies hide in the slack, then recomputes
only what the budget still asks. When the slack is ample that swaps far more than the budget needs:
on the runtime benchmark's 8-layer step at 70 % of the keep-all peak, slackswap swapped 133 tensors
and kept 18 % of the saved bytes. In the simulator a hidden swap is free, so nothing told it to stop.
On a machine a small one is not: every transfer costs a copy launch and a hook call on the CPU
whatever its size, which the link model does not price (its `latency_s` is on the copy engine, where
a hidden copy costs nothing). torchtune's activation offload skips tensors under 1 KiB for the
same reason (`OffloadActivations(min_offload_size=1024)`).

`drop_unneeded_swaps` returns to keep the swapped tensors whose copies are latency-bound (their
bytes take no longer than the link's fixed latency: `latency_bound_bytes`, 250 kB on the A100
preset), smallest first (the most transfers spared per byte of headroom), as long as the replayed
peak still fits the budget and the replayed step is no longer than the plan's. Larger swaps stay:
their cost is their bytes, which the simulator prices, and the headroom they leave is what the
caching allocator's rounding and fragmentation need (keeping them too made the allocator model
reject `advise`'s 1-GPU Llama-7B plans made against the allocated peak). How many is predicted
from the plan's replayed memory profile (what keeping each adds while its swap holds no device
copy), and the prediction is confirmed by one schedule build and replay: linear in depth, with a
numpy sweep per bisection step of the prediction. Like `fit_prefix`, it returns only a prefix it
has checked.
"""

from __future__ import annotations

from collections.abc import Sequence

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.support.greedy import first_true
from slackswap.schedule.build import build_schedule
from slackswap.schedule.replay import PlanTimeline, estimate_plan, peak_bytes
from slackswap.schedule.transfer import d2h_s, h2d_s


def latency_bound_bytes(hardware: Hardware) -> float:
    """The size below which a copy is latency-bound: its bytes take no longer than its fixed part (the
    link's latency, and an offload's setup) in either direction. 250 kB on the A100's PCIe 4.0 preset,
    520 kB on the H200's PCIe 5.0 one."""
    # The fixed part is a copy of no bytes (`schedule/transfer.py`, the one copy-time formula); each
    # byte then adds 1 / (the bandwidth one engine sees), the formula's other term.
    link = hardware.link
    d2h = d2h_s(0, hardware) * link.d2h_effective_bytes_per_s / link.d2h_engines
    h2d = h2d_s(0, hardware) * link.h2d_effective_bytes_per_s / link.h2d_engines
    return min(d2h, h2d)


def latency_bound_swaps_smallest_first(graph: Graph, hardware: Hardware, plan: Plan) -> list[str]:
    """The plan's swapped tensors whose copies are latency-bound (`latency_bound_bytes`), fewest bytes
    first; ties in graph order."""
    position = {name: i for i, name in enumerate(graph.tensors)}
    limit = latency_bound_bytes(hardware)
    swapped = [t for t in plan.tensors_with(Decision.SWAP) if graph.tensors[t].size_bytes <= limit]
    return sorted(swapped, key=lambda t: (graph.tensors[t].size_bytes, position[t]))


def drop_unneeded_swaps(graph: Graph, hardware: Hardware, budget_bytes: int | None, plan: Plan) -> Plan:
    """`plan` with a prefix of `latency_bound_swaps_smallest_first` kept instead of swapped, whose
    replayed peak fits `budget_bytes` and whose replayed step is not longer: the longest the plan's
    memory profile predicts, or if that misses the longest shorter one found by galloping; `plan`
    itself if none.
    `notes["dropped_swaps"]` says how many were returned."""
    order = latency_bound_swaps_smallest_first(graph, hardware, plan)
    if budget_bytes is None or not order:
        return plan
    replay = estimate_plan(graph, plan, hardware)
    cache: dict[int, tuple[Plan, bool]] = {0: (plan, True)}

    def probe(k: int) -> tuple[Plan, bool]:
        """(the plan keeping the first k of `order`, whether its peak fits and its step is no longer)"""
        if k not in cache:
            decisions = dict(plan.decisions) | dict.fromkeys(order[:k], Decision.KEEP)
            candidate = build_schedule(
                graph, decisions, planner=plan.planner, budget_bytes=budget_bytes, hardware=hardware,
                bound_step_s=plan.bound_step_s, notes={**plan.notes, "dropped_swaps": k},
            )
            estimate = estimate_plan(graph, candidate, hardware)
            fits = estimate.peak_bytes <= budget_bytes and estimate.step_s <= replay.step_s
            cache[k] = (candidate, fits)
        return cache[k]

    n = len(order)
    # The predicted longest prefix (`predicted_fitting_count`) is confirmed by one build and replay.
    # The prediction over-counts what keeping adds, so on the plan's own timing a longer prefix may
    # fit but this one does; no probe looks for the longer one (in the cases of record the next
    # tensor never fit). Only where the rebuilt schedule moved transfers enough to miss is the
    # prefix shortened, galloping (`first_true` over j = n - k, the swaps left swapped; j = n, the
    # plan itself, holds).
    k = predicted_fitting_count(graph, plan, replay, order, budget_bytes)
    if k > 0 and not probe(k)[1]:
        k = n - first_true(n - k, n, lambda j: probe(n - j)[1], n - k + 1)
    if k == 0:
        return plan
    return probe(k)[0]


def predicted_fitting_count(
    graph: Graph, plan: Plan, replay: PlanTimeline, order: Sequence[str], budget_bytes: int
) -> int:
    """The longest prefix of `order` (swapped tensors of `plan`) whose keeping the plan's own memory
    profile predicts fits `budget_bytes`, by bisection over `peak_bytes` of the profile plus, per kept
    tensor, its bytes from its offload's end to its last prefetch's start: what keeping it adds
    while its swap has no copy on the device, counted generously (where a prefetched copy or the
    original copy still lives, its bytes count twice). Rebuilding the schedule moves transfers, so
    the prediction is only where the search starts. A numpy sweep per bisection step, no replay."""
    window_start = {t.tensor: replay.offload_end_s[i] for i, t in enumerate(plan.offloads)}
    window_end: dict[str, float] = {}
    for i, t in enumerate(plan.prefetches):
        window_end[t.tensor] = max(window_end.get(t.tensor, 0.0), replay.prefetch_start_s[i])
    starts = [window_start[t] for t in order]
    ends = [max(window_end.get(t, window_start[t]), window_start[t]) for t in order]
    sizes = [graph.tensors[t].size_bytes for t in order]

    def fits(k: int) -> bool:
        alloc = (*replay.copy_alloc_s, *starts[:k])
        free = (*replay.copy_free_s, *ends[:k])
        size = (*replay.copy_size_bytes, *sizes[:k])
        return peak_bytes(alloc, free, size)[0] <= budget_bytes

    lo, hi = 0, len(order)  # fits(0): the plan's own peak fits
    if fits(hi):
        return hi
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
