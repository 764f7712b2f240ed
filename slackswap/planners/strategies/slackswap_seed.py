"""`slackswap_seed`: the seed's plain rule, kept to measure what `slackswap` improves.

- slack = one pool of transfer time: the forward window (offloads hide under forward compute);
- swap the tensors most expensive to regenerate per byte while the sum of their transfer times
  (the slower direction of each) fits the pool;
- recompute the rest the budget requires, cheapest standalone regeneration per byte first.
It ignores that a late-forward offload cannot finish before the peak and that recompute chains
share ops; both show up as extra recompute or stalls in the simulator.
"""

from __future__ import annotations

from slackswap.graph import Graph
from slackswap.planners.registry import register_planner
from slackswap.planners.strategies.slackswap import by_regen_cost_per_byte
from slackswap.planners.support.analysis import ProfileAnalysis
from slackswap.planners.support.greedy import order_by_standalone_cost
from slackswap.planners.support.swap_recompute import SwapThenRecompute


@register_planner("slackswap_seed")
class SlackSwapSeed(SwapThenRecompute):
    name = "slackswap_seed"
    keeps_candidates = False  # the seed's rule as published decides only what autograd saves

    def select_swaps(self, graph: Graph, analysis: ProfileAnalysis) -> list[str]:
        pool_s = analysis.forward_window_s
        used_s = 0.0
        swaps = []
        for t in by_regen_cost_per_byte(analysis):
            info = analysis.tensors[t]
            cost_s = max(info.d2h_s, info.h2d_s)
            if used_s + cost_s <= pool_s:
                used_s += cost_s
                swaps.append(t)
        return swaps

    def order_recompute(self, graph: Graph, analysis: ProfileAnalysis, candidates: list[str]) -> list[str]:
        return order_by_standalone_cost(analysis, candidates)
