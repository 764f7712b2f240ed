"""`selective_recompute` (Korthikanti et al. 2022, Megatron-LM "selective activation recompute").

Drop the activations *inside* the attention core (QK^T scores, softmax, softmax dropout: the
5·a·s²·b term) and regenerate them in backward from the kept Q, K and V; the core's output (the
context that the projection reads) is kept. Megatron applies it per layer; here in the first k
layers, with k the smallest count whose plan fits the budget (searched on the analytical timeline
from the byte-count guess, `greedy.smallest_fitting_count`). Never swaps. With a fused (flash)
attention kernel there is almost nothing inside the core to drop, so most budgets are infeasible for
this strategy, as they are in Megatron.
"""

from __future__ import annotations

from slackswap.graph import Graph, Phase
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.support.budget_check import over_budget, scheduled_peak
from slackswap.planners.support.candidates import keep_chain_candidates
from slackswap.planners.support.greedy import smallest_fitting_count


def attention_core_tensors(graph: Graph) -> dict[int, list[str]]:
    """Per layer, the saved tensors produced inside the attention core and read by nothing outside it."""
    core_ops = {op.name for op in graph.ops if op.attention_core and op.phase == Phase.FORWARD}
    out: dict[int, list[str]] = {}
    for t in graph.saved_tensors:
        if t.producer not in core_ops:
            continue
        readers = [c for c in t.consumers if graph.op_by_name[c].phase == Phase.FORWARD]
        if all(c in core_ops for c in readers):
            out.setdefault(graph.op_by_name[t.producer].layer, []).append(t.name)
    return out


@register_planner("selective_recompute")
class SelectiveRecompute:
    name = "selective_recompute"

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        core = attention_core_tensors(graph)
        layers = sorted(core)
        cache: dict[int, tuple[Plan, int]] = {}

        def probe(k: int) -> tuple[Plan, int]:
            if k not in cache:
                drop = {t for layer in layers[:k] for t in core[layer]}
                decisions = {
                    t.name: Decision.RECOMPUTE if t.name in drop else Decision.KEEP for t in graph.saved_tensors
                }
                cache[k] = scheduled_peak(
                    graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
                    notes={"recomputed_layers": k},
                )
            return cache[k]

        n = len(layers)
        unit_bytes = [sum(graph.tensors[t].size_bytes for t in core[layer]) for layer in layers]
        plan = smallest_fitting_count(n, probe, budget_bytes, unit_bytes)
        if plan is None:
            raise over_budget(self.name, budget_bytes, f"recomputing the attention core in all {n} layers")
        return keep_chain_candidates(graph, hardware, budget_bytes, plan)
