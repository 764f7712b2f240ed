"""The plan's live saved-tensor copies step by step, and the runtime ledger's difference from them
(plain core code, no torch). The simulator's own figure for the same comparison is
`slackswap.simulate.saved_peak.simulated_saved_peak_bytes`.
"""

from __future__ import annotations

from slackswap.graph import Graph
from slackswap.plan import Plan


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
