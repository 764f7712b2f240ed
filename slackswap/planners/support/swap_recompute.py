"""The common shape of the swap-then-recompute planners (slackswap, slackswap_seed, capuchin).

1. Pick the swapped set (each planner its own rule, within its own notion of slack).
2. Rank the remaining recompute candidates (each planner its own rule).
3. Recompute the shortest prefix of that ranking that fits the budget (`greedy.fit_prefix`); keep
   the rest.
With no budget, or a budget the keep-all peak already fits, nothing is swapped or recomputed.
"""

from __future__ import annotations

from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.support.analysis import ProfileAnalysis, analyse
from slackswap.planners.support.greedy import fit_prefix, keep_all_if_it_fits, recompute_candidates
from slackswap.schedule.replay import estimate_plan


class SwapThenRecompute:
    name = ""

    def select_swaps(self, graph: Graph, analysis: ProfileAnalysis) -> list[str]:
        raise NotImplementedError

    def swap_alternatives(self, graph: Graph, analysis: ProfileAnalysis, budget_bytes: int) -> list[list[str]]:
        """Swapped sets to try; the plan with the shortest estimated step wins. Default: one."""
        return [self.select_swaps(graph, analysis)]

    def order_recompute(self, graph: Graph, analysis: ProfileAnalysis, candidates: list[str]) -> list[str]:
        raise NotImplementedError

    def recompute_pool(self, graph: Graph, analysis: ProfileAnalysis, swaps: set[str]) -> list[str]:
        """The tensors a planner may recompute on top of `swaps`. Default: no layer boundary."""
        return recompute_candidates(graph, analysis, swaps)

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        analysis = analyse(graph, hardware)
        unconstrained = keep_all_if_it_fits(graph, hardware, analysis, budget_bytes, self.name)
        if unconstrained is not None:
            return unconstrained
        best: tuple[float, Plan] | None = None
        failure: InfeasibleBudgetError | None = None
        tried: list[set[str]] = []
        for swaps in self.swap_alternatives(graph, analysis, budget_bytes):
            if set(swaps) in tried:
                continue
            tried.append(set(swaps))
            try:
                plan = self._plan_with(graph, hardware, budget_bytes, analysis, swaps)
            except InfeasibleBudgetError as exc:
                failure = exc
                continue
            step_s = estimate_plan(graph, plan, hardware).step_s
            if best is None or step_s < best[0]:
                best = (step_s, plan)
        if best is None:
            assert failure is not None
            raise failure
        return best[1]

    def _plan_with(
        self, graph: Graph, hardware: Hardware, budget_bytes: int, analysis: ProfileAnalysis, swaps: list[str]
    ) -> Plan:
        keep = {t: Decision.KEEP for t in analysis.tensors}
        base = dict(keep)
        base.update(dict.fromkeys(swaps, Decision.SWAP))
        order = self.order_recompute(graph, analysis, self.recompute_pool(graph, analysis, set(swaps)))
        swapped_bytes = sum(analysis.tensors[t].size_bytes for t in swaps)

        def notes(k: int) -> dict[str, object]:
            return {
                "forward_window_s": analysis.forward_window_s,
                "backward_window_s": analysis.backward_window_s,
                "swapped_bytes": swapped_bytes,
                "recomputed_bytes": sum(analysis.tensors[t].size_bytes for t in order[:k]),
                "keep_all_peak_bytes": analysis.keep_all_peak_bytes,
            }

        return fit_prefix(
            graph,
            hardware,
            budget_bytes,
            analysis,
            base,
            order,
            planner=self.name,
            notes=notes,
            what=f"swapping {len(swaps)} tensors and recomputing all {len(order)} other non-boundary tensors",
        )
