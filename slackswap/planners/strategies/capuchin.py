"""`capuchin` (Peng et al., ASPLOS 2020): swap first while the prefetch can hide, then recompute
ranked by memory saved per second of recompute (MSPS).

Faithful points: swap candidates are ranked by *free time* (the idle interval between a tensor's
last forward use and its first backward use; Capuchin evicts the longest-idle tensors first), and a
swap is taken only if its transfers hide (here: the same exact per-direction slack check slackswap
uses, `analysis.SlackLedger`). Recompute candidates are ranked by MSPS = bytes / recompute time, and
Capuchin re-prices candidates whose recompute source changes after each pick, which is the marginal
chain cost of `greedy.order_by_marginal_cost`. The difference from `slackswap` is therefore the swap
ranking: idle time instead of regeneration cost per byte.
"""

from __future__ import annotations

from slackswap.graph import Graph
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import ProfileAnalysis
from slackswap.planners.support.greedy import order_by_marginal_cost, take_while_hidden
from slackswap.planners.support.swap_recompute import SwapThenRecompute


@register_planner("capuchin")
class Capuchin(SwapThenRecompute):
    name = "capuchin"

    def select_swaps(self, graph: Graph, analysis: ProfileAnalysis) -> list[str]:
        infos = analysis.tensors
        ranked = sorted(
            (t for t, i in infos.items() if i.size_bytes > 0),
            key=lambda t: -(infos[t].first_backward_use_s - infos[t].ready_s),
        )
        return take_while_hidden(analysis, ranked)

    def order_recompute(self, graph: Graph, analysis: ProfileAnalysis, candidates: list[str]) -> list[str]:
        return order_by_marginal_cost(graph, analysis, candidates)
