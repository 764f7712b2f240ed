"""`swap_only` (vDNN, Rhu et al., "vDNN: Virtualized Deep Neural Networks for Scalable,
Memory-Efficient Neural Network Design", MICRO 2016): offload layer activations during forward,
prefetch them one layer ahead during backward, never recompute.

vDNN offloads the activations of a layer as its forward pass produces them (here: one D2H copy per
saved tensor, issued after its producer) and, during backward, prefetches the activations of layer
l when the backward pass of layer l+1 begins. Its dynamic policy (vDNN_dyn) offloads as few layers
as fit memory: here the first k layers, k the smallest count that runs within the budget. Activations
outside the stack are kept. k is searched from the byte-count guess (the first k whose layers' bytes
cover the excess over the budget) by galloping (`greedy.first_true`): a few probes at any depth, where
bisection took log2(L), each probe a build and a replay (or a simulation) of the whole schedule. The
peak, and whether the simulator completes, fall monotonically with k on every preset checked, so the
search finds the k bisection found (tests/test_planner_scaling.py compares them).

vDNN as published *waits*: a layer whose offload has not finished cannot free its activations, so
the next allocation blocks until the copy is done (vDNN synchronises its offload stream at every
layer). `memory_waits: true` (the default, conf/planner/swap_only.yaml) reproduces that: the plan
may exceed what the forward pass can hide, and the simulator charges the waits (`stall_memory_s`),
which is the stalled throughput the paper's users see. k is then the smallest count whose simulated
run completes within the budget (`slackswap.simulate`, no analytical shortcut: only the
discrete-event simulator models memory waits). `memory_waits: false` keeps the stricter rule of the
other planners here (a plan must never wait for memory; otherwise infeasible, with the bytes in the
message). Departure from the paper: vDNN synchronises at every layer even when memory is free; the
simulator waits only when an allocation does not fit, so our vDNN stalls less than the original
(docs/planners.md).
"""

from __future__ import annotations

from slackswap import validation as check
from slackswap.graph import NO_LAYER, Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget, gib
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import analyse
from slackswap.planners.support.budget_check import over_budget, scheduled_peak
from slackswap.planners.support.greedy import byte_count_guess, first_true, smallest_fitting_count


def layer_tensors(graph: Graph) -> dict[int, list[str]]:
    """Saved, non-empty tensors of each transformer layer (by producer), in production order."""
    by_layer: dict[int, list[str]] = {}
    for t in graph.saved_tensors:
        layer = graph.op_by_name[t.producer].layer
        if layer != NO_LAYER and t.size_bytes > 0:
            by_layer.setdefault(layer, []).append(t.name)
    return by_layer


@register_planner("swap_only")
class SwapOnly:
    name = "swap_only"

    def __init__(self, memory_waits: bool = True):
        self.memory_waits = check.flag("planner.options.memory_waits", memory_waits)

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        by_layer = layer_tensors(graph)
        layers = sorted(by_layer)
        n = len(layers)
        cache: dict[int, tuple[Plan, int]] = {}

        def probe(k: int) -> tuple[Plan, int]:
            if k not in cache:
                swap = {t for layer in layers[:k] for t in by_layer[layer]}
                decisions = {t.name: Decision.SWAP if t.name in swap else Decision.KEEP for t in graph.saved_tensors}
                cache[k] = scheduled_peak(
                    graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
                    prefetch="layer_ahead", notes={"offloaded_layers": k, "memory_waits": self.memory_waits},
                )
            return cache[k]

        unit_bytes = [sum(graph.tensors[t].size_bytes for t in by_layer[layer]) for layer in layers]
        plan = smallest_fitting_count(n, probe, budget_bytes, unit_bytes)
        if plan is not None:
            return plan
        assert budget_bytes is not None
        if self.memory_waits:
            guess = byte_count_guess(probe(0)[1] - budget_bytes, unit_bytes)
            waiting = self._smallest_count_that_runs(graph, hardware, budget_bytes, n, probe, guess)
            if waiting is not None:
                return waiting
        analysis = analyse(graph, hardware)
        link = hardware.link
        offload = sum(graph.tensors[t].size_bytes for ts in by_layer.values() for t in ts)
        hideable = analysis.forward_window_s * link.d2h_effective_bytes_per_s
        waits = "even waiting for memory, the simulator cannot run it" if self.memory_waits else (
            "it would have to wait for memory (memory_waits: false)")
        raise over_budget(
            self.name, budget_bytes, f"offloading all {n} layers without waiting",
            f", and {waits}: it offloads {gib(offload)} but the {analysis.forward_window_s * 1e3:.1f} ms forward "
            f"pass can hide only {gib(hideable)} at {link.d2h_effective_bytes_per_s / 1e9:.1f} GB/s",
        )

    def _smallest_count_that_runs(self, graph, hardware, budget_bytes, n, probe, guess: int) -> Plan | None:
        """Smallest k whose plan the simulator completes within the budget (waiting for memory where it
        must), searched from the byte-count `guess` (`first_true`), returning only a k it simulated.
        None if even all n layers deadlock."""
        from slackswap.simulate import simulate

        runs: dict[int, bool] = {}

        def completes(k: int) -> bool:
            if k not in runs:
                runs[k] = simulate(graph, probe(k)[0], hardware, budget_bytes).feasible
            return runs[k]

        if not completes(n):
            return None
        return probe(first_true(-1, n, completes, guess))[0]
