"""The simulator's figure the runtime's ledger is compared with (plain core code, no torch).

The ledger counts saved tensors only, and on the CPU a copy has arrived when it is issued. The
matching simulation is the same plan on the same graph with every tensor that is not saved weighing
0 bytes (transients and activation gradients drop out of the memory curve, nothing else changes)
and a host link that takes no time, with no budget.
"""

from __future__ import annotations

from dataclasses import replace

from slackswap.graph import Graph
from slackswap.hardware import Hardware, HostLink
from slackswap.plan import Plan

#: A link that moves any tensor of this project in far less than one op's duration.
_INSTANT_BYTES_PER_S = 1e30


def saved_only(graph: Graph) -> Graph:
    tensors = {name: t if t.saved else replace(t, size_bytes=0) for name, t in graph.tensors.items()}
    return replace(graph, tensors=tensors, name=f"{graph.name}/saved-only")


def instant_link(hardware: Hardware) -> Hardware:
    link = HostLink(
        name="instant",
        d2h_theoretical_bytes_per_s=_INSTANT_BYTES_PER_S,
        h2d_theoretical_bytes_per_s=_INSTANT_BYTES_PER_S,
        d2h_effective_bytes_per_s=_INSTANT_BYTES_PER_S,
        h2d_effective_bytes_per_s=_INSTANT_BYTES_PER_S,
        latency_s=0.0,
    )
    return replace(hardware, link=link, name=f"{hardware.name}/instant-link")


def simulated_saved_peak_bytes(graph: Graph, plan: Plan, hardware: Hardware, instant: bool = True) -> int:
    """Peak of saved bytes on the device when the simulator executes `plan` (no budget)."""
    from slackswap.simulate import simulate

    weighed = saved_only(graph)
    # The same ops and tensors with other weights: the plan is re-addressed to the re-weighed graph on
    # purpose (its fingerprint covers sizes, so the plan's own fingerprint would be refused).
    plan = replace(plan, graph_fingerprint=weighed.fingerprint)
    result = simulate(weighed, plan, instant_link(hardware) if instant else hardware, None)
    return result.peak_activation_bytes


def plan_live_copies(graph: Graph, plan: Plan) -> dict[int, frozenset[int]]:
    """Per plan step j, the saved-tensor copies the plan has on the device while step j runs.

    A copy lives from its production (run / recompute step, or the step after its prefetch is
    issued) to its release: its resolved last use (`Copy.last_use`: its last reader, or the last
    reader of a view holding its storage), or for an offloaded copy the later of that and the issue
    of every offload it waits for. That is the simulator's rule with a link that takes no time.
    Copies of what is not a graph tensor (the RNG state a recomputed dropout stashes) are not saved
    tensors and are left out.
    """
    from slackswap.schedule.validate import resolve_schedule

    schedule = resolve_schedule(graph, plan)
    tensors = graph.tensors
    live: dict[int, set[int]] = {j: set() for j in range(len(plan.steps))}
    for c, copy in enumerate(schedule.copies):
        tensor = tensors.get(copy.tensor)
        if tensor is None or not tensor.saved:
            continue
        start = end = copy.source_index
        if copy.source == "prefetch":
            start = end = plan.prefetches[copy.source_index].issue_after_step + 1
        end = max([end, copy.last_use, *(plan.offloads[k].issue_after_step for k in copy.wait_offloads)])
        for j in range(start, end + 1):
            live[j].add(c)
    return {j: frozenset(cs) for j, cs in live.items()}


def explain_ledger(graph: Graph, plan: Plan, live_by_step: dict[int, frozenset[int]]) -> dict[str, object]:
    """Attribute the ledger's difference from the plan copy by copy.

    Returns the plan's peak (`plan_peak_bytes`), the ledger's (`ledger_peak_bytes`), the copies the
    plan has but the run did not (`missing`: must be empty for a faithful run), and at the ledger's
    peak step the copies alive that the plan had already released (`late`, with their bytes).
    """
    from slackswap.schedule.validate import resolve_schedule

    copies = resolve_schedule(graph, plan).copies
    planned = plan_live_copies(graph, plan)

    def size(cs: frozenset[int]) -> int:
        return sum(copies[c].size_bytes for c in cs)

    missing = sorted({(j, copies[c].tensor) for j, cs in planned.items() for c in cs - live_by_step.get(j, cs)})
    peak_step = max(live_by_step, key=lambda j: size(live_by_step[j]), default=-1)
    late = sorted(live_by_step.get(peak_step, frozenset()) - planned.get(peak_step, frozenset()))
    return {
        "plan_peak_bytes": max((size(cs) for cs in planned.values()), default=0),
        "ledger_peak_bytes": size(live_by_step.get(peak_step, frozenset())),
        "ledger_peak_step": peak_step,
        "missing": missing,
        "late": [(copies[c].tensor, copies[c].source, copies[c].size_bytes) for c in late],
        "late_bytes": sum(copies[c].size_bytes for c in late),
        "plan_bytes_at_ledger_peak": size(planned.get(peak_step, frozenset())),
    }
