"""`swap_only` (vDNN, Rhu et al., MICRO 2016): offload layer activations during forward, prefetch
them one layer ahead during backward, never recompute.

vDNN offloads the activations of a layer as its forward pass produces them (here: one D2H copy per
saved tensor, issued after its producer) and, during backward, prefetches the activations of layer
l when the backward pass of layer l+1 begins. Its dynamic policy (vDNN_dyn) offloads as few layers
as fit memory; here the first k layers, with k the smallest count whose plan fits the budget
(bisection on the analytical timeline). Activations outside the stack are kept. Like every planner
here it returns only plans that never wait for memory; a budget that needs more offload than the
forward pass can hide is reported as infeasible with the numbers.
"""

from __future__ import annotations

from slackswap.graph import NO_LAYER, Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget, gib
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import analyse
from slackswap.planners.support.fit import over_budget, scheduled_peak
from slackswap.planners.support.greedy import smallest_fitting_count


@register_planner("swap_only")
class SwapOnly:
    name = "swap_only"

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        by_layer: dict[int, list[str]] = {}
        for t in graph.saved_tensors:
            layer = graph.op_by_name[t.producer].layer
            if layer != NO_LAYER and t.size_bytes > 0:
                by_layer.setdefault(layer, []).append(t.name)
        layers = sorted(by_layer)
        cache: dict[int, tuple[Plan, int]] = {}

        def probe(k: int) -> tuple[Plan, int]:
            if k not in cache:
                swap = {t for layer in layers[:k] for t in by_layer[layer]}
                decisions = {t.name: Decision.SWAP if t.name in swap else Decision.KEEP for t in graph.saved_tensors}
                cache[k] = scheduled_peak(
                    graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
                    prefetch="layer_ahead", notes={"offloaded_layers": k},
                )
            return cache[k]

        n = len(layers)
        plan = smallest_fitting_count(n, probe, budget_bytes)
        if plan is None:
            analysis = analyse(graph, hardware)
            link = hardware.link
            offload = sum(graph.tensors[t].size_bytes for ts in by_layer.values() for t in ts)
            hideable = analysis.forward_window_s * link.d2h_effective_bytes_per_s
            raise over_budget(
                self.name, budget_bytes, probe(n)[1], f"offloading all {n} layers",
                f": it offloads {gib(offload)} but the {analysis.forward_window_s * 1e3:.1f} ms forward pass can "
                f"hide only {gib(hideable)} at {link.d2h_effective_bytes_per_s / 1e9:.1f} GB/s",
            )
        return plan
