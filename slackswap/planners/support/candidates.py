"""Keep checkpoint candidates where that is cheaper than the recompute chain through them.

A planner's plan recomputes saved tensors; `build_schedule` regenerates each one's non-saved forward
inputs too (a recompute chain). Keeping such an input (a checkpoint candidate,
`Graph.candidate_tensors`: a forward tensor autograd does not save) on the device from its forward
run to its last recompute reader stops the chain there: the step saves the re-run of its producer
and costs the candidate's bytes during backward.

`keep_chain_candidates`: the candidates whose producer the plan re-runs only for them (no saved
tensor the plan recomputes is an output of that producer), ranked by re-run seconds saved per byte,
largest first; the longest prefix of that ranking whose schedule still fits the budget (all of it
first, then bisection: a few probes) is kept, if its replayed step is strictly shorter. Linear in
depth: the ranking is one pass over the plan's steps, each probe one schedule.
"""

from __future__ import annotations

from dataclasses import replace

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan, StepKind
from slackswap.planners.support.budget_check import scheduled_peak
from slackswap.schedule.replay import estimate_plan


def chain_candidates(graph: Graph, plan: Plan) -> list[str]:
    """Undecided candidates a recompute step of `plan` regenerates, best seconds per byte first."""
    decisions = plan.decisions
    recomputed = {s.op for s in plan.steps if s.kind == StepKind.RECOMPUTE}
    ops = graph.op_by_name
    out: list[tuple[float, int, str]] = []
    for position, t in enumerate(graph.candidate_tensors):
        if t.name in decisions or t.producer not in recomputed or t.size_bytes == 0:
            continue
        producer = ops[t.producer]
        if any(decisions.get(o) == Decision.RECOMPUTE for o in producer.outputs):
            continue  # the producer re-runs for a saved tensor anyway: keeping t saves nothing
        out.append((-producer.duration_s / t.size_bytes, position, t.name))
    return [name for _, _, name in sorted(out)]


def keep_chain_candidates(graph: Graph, hardware: Hardware, budget_bytes: int | None, plan: Plan) -> Plan:
    """`plan` with the best-value prefix of `chain_candidates` kept, if that fits and steps faster."""
    order = chain_candidates(graph, plan)
    if not order:
        return plan
    cache: dict[int, tuple[Plan, int]] = {}

    def probe(k: int) -> tuple[Plan, int]:
        if k not in cache:
            decisions = dict(plan.decisions) | dict.fromkeys(order[:k], Decision.KEEP)
            notes = {**plan.notes, "kept_candidates": k}
            cache[k] = scheduled_peak(graph, decisions, planner=plan.planner, budget_bytes=budget_bytes,
                                      hardware=hardware, bound_step_s=plan.bound_step_s, notes=notes)
        return cache[k]

    def fits(k: int) -> bool:
        return budget_bytes is None or probe(k)[1] <= budget_bytes

    k = len(order)
    if not fits(k):
        lo, hi = 0, k  # lo fits (k = 0 is the plan itself, whose peak fits), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        k = lo
    if k == 0:
        return plan
    candidate = probe(k)[0]
    if estimate_plan(graph, candidate, hardware).step_s < estimate_plan(graph, plan, hardware).step_s:
        return replace(candidate, notes={**candidate.notes, "kept_candidates": k})
    return plan
