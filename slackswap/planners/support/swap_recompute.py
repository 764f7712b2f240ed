"""The common shape of the swap-then-recompute planners (slackswap, slackswap_seed, capuchin).

1. Pick the swapped set (each planner its own rule, within its own notion of slack).
2. Rank the remaining recompute candidates (each planner its own rule).
3. Recompute the shortest prefix of that ranking that fits the budget (`greedy.fit_prefix`); keep
   the rest.
4. Keep the checkpoint candidates whose recompute chain costs more than their bytes allow
   (`support/candidates.py`; not slackswap_seed, the seed's rule as published).
With no budget, or a budget the keep-all peak already fits, nothing is swapped or recomputed.

Cost: each swapped set's prefix search builds and replays whole schedules (about 0.1 s each at 320
analytic layers), so a swapped set that cannot win is dropped as soon as that is certain
(`_cannot_beat`): no plan steps faster than the sum of its compute steps, which is at least the
keep-all step plus one re-run of the producer of every recomputed tensor. The alternatives are
still compared in their order and a later one must be strictly faster, so skipping one that can at
best tie never changes the plan.
"""

from __future__ import annotations

from collections.abc import Callable

from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.support.analysis import ProfileAnalysis, analyse
from slackswap.planners.support.candidates import keep_chain_candidates
from slackswap.planners.support.greedy import fit_prefix, keep_all_if_it_fits, recompute_candidates
from slackswap.schedule.replay import estimate_plan


class SwapThenRecompute:
    name = ""
    #: Keep checkpoint candidates where that beats their recompute chain (`support/candidates.py`).
    keeps_candidates = True

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
                plan = self._plan_with(graph, hardware, budget_bytes, analysis, swaps,
                                       None if best is None else best[0])
            except InfeasibleBudgetError as exc:
                failure = exc
                continue
            if plan is None:  # it could at best tie with `best`
                continue
            step_s = estimate_plan(graph, plan, hardware).step_s
            if best is None or step_s < best[0]:
                best = (step_s, plan)
        if best is None:
            assert failure is not None
            raise failure
        if self.keeps_candidates:
            return keep_chain_candidates(graph, hardware, budget_bytes, best[1])
        return best[1]

    def _plan_with(
        self,
        graph: Graph,
        hardware: Hardware,
        budget_bytes: int,
        analysis: ProfileAnalysis,
        swaps: list[str],
        beat_step_s: float | None = None,
    ) -> Plan | None:
        """The plan for the swapped set `swaps`; None if it cannot step faster than `beat_step_s`."""
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
            hopeless=None if beat_step_s is None else _cannot_beat(graph, analysis, order, beat_step_s),
        )


def step_lower_bounds_s(graph: Graph, analysis: ProfileAnalysis, order: list[str]) -> list[float]:
    """[k] = a lower bound on the step time of any schedule that recomputes `order[:k]` (and anything
    else): the keep-all step (every op runs once, in the same order, on the one compute stream) plus
    one re-run of each distinct producer op of those tensors. A recomputed saved tensor has a backward
    reader, and `build_schedule` regenerates it before that reader with a recompute step of its
    producer; a schedule's step is at least the sum of its compute steps (stalls only add)."""
    duration = {op.name: op.duration_s for op in graph.ops}
    bounds = [analysis.ideal_step_s]
    producers: set[str] = set()
    recompute_s = 0.0
    for t in order:
        producer = graph.tensors[t].producer
        if producer not in producers:
            producers.add(producer)
            recompute_s += duration[producer]
        bounds.append(analysis.ideal_step_s + recompute_s)
    return bounds


def _cannot_beat(
    graph: Graph, analysis: ProfileAnalysis, order: list[str], beat_step_s: float
) -> Callable[[int], bool]:
    """`fit_prefix`'s `hopeless`: no plan with a prefix of k or more can be strictly faster than
    `beat_step_s`. The keep-all step is exact (a schedule's compute time is summed in the same order,
    with only non-negative terms added, so it cannot round below it); the recompute part is a sum of
    its own, so it must exceed `beat_step_s` by more than rounding (1e-9 relative) to count."""
    bounds = step_lower_bounds_s(graph, analysis, order)

    def hopeless(k: int) -> bool:
        return beat_step_s <= analysis.ideal_step_s or bounds[k] > beat_step_s * (1 + 1e-9)

    return hopeless
