"""`slackswap`: swap what is expensive to regenerate, within the slack that really hides; recompute
the rest, cheapest per byte first, counting shared recompute work once.

Improvements over the seed's rule (`slackswap_seed`), see docs/planners.md:
- slack per direction and per tensor, not one pool: an offload must finish before the end of the
  forward pass (the memory peak) on a serial D2H engine, so a tensor produced late in the forward
  pass gets only the time left after it; a prefetch must finish before the tensor's first backward
  use on a serial H2D engine that can start only when backward does (`analysis.SlackLedger`);
- recompute is ranked by *marginal* cost per byte: ops already re-run for an earlier pick are free
  (`greedy.order_by_marginal_cost`);
- a swapped byte is worth what it spares at the *tail* of the recompute ranking, not its own
  regeneration cost: once a tensor is more expensive per byte than the last tensor the budget makes
  us recompute, it would be kept anyway, and among such tensors the slack is best spent on the ones
  it can hold the most bytes of (longest production-to-use window first). slackswap therefore also
  tries that packing order over the tensors above the recompute tail and over all tensors (when
  the budget asks little, even cheap bytes swapped spare recompute), plus all tensors by bytes per
  copy-second, and keeps whichever of the four swapped sets (these three and the seed-style
  selection) gives the shortest estimated step (`swap_alternatives`).
"""

from __future__ import annotations

from slackswap.graph import Graph
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import ProfileAnalysis
from slackswap.planners.support.greedy import (
    order_by_marginal_cost,
    order_by_standalone_cost,
    recompute_candidates,
    take_while_hidden,
)
from slackswap.planners.support.swap_recompute import SwapThenRecompute


def by_regen_cost_per_byte(analysis: ProfileAnalysis) -> list[str]:
    """Most expensive to regenerate per byte first (zero-byte tensors are never worth a transfer)."""
    infos = analysis.tensors
    candidates = [t for t, i in infos.items() if i.size_bytes > 0]
    return sorted(candidates, key=lambda t: -infos[t].regen_s / infos[t].size_bytes)


def frees_memory(analysis: ProfileAnalysis, candidates: list[str]) -> list[str]:
    """Drop the candidates that could never be off the device: no op runs between their last forward
    use and their first backward use (the loss's probabilities: produced by the last forward op, read
    by the first backward op). Recomputing one regenerates it at once, at the same memory, and pays
    its whole chain (the LM head) for nothing."""
    return [t for t in candidates if analysis.tensors[t].off_device_window_s > 0]


def by_shared_regen_cost_per_byte(graph: Graph, analysis: ProfileAnalysis) -> list[str]:
    """As `by_regen_cost_per_byte`, but the producer op's time is shared among the bytes of all its
    saved outputs (q, k and v come from one qkv op: swapping all three spares it once)."""
    infos = analysis.tensors
    out_bytes: dict[str, int] = {}
    for t, i in infos.items():
        producer = graph.tensors[t].producer
        out_bytes[producer] = out_bytes.get(producer, 0) + i.size_bytes

    def key(t: str) -> float:
        i = infos[t]
        own = graph.op_by_name[graph.tensors[t].producer].duration_s
        return -(i.regen_s - own + own * i.size_bytes / out_bytes[graph.tensors[t].producer]) / i.size_bytes

    return sorted((t for t, i in infos.items() if i.size_bytes > 0), key=key)


@register_planner("slackswap")
class SlackSwap(SwapThenRecompute):
    name = "slackswap"

    def select_swaps(self, graph: Graph, analysis: ProfileAnalysis) -> list[str]:
        return take_while_hidden(analysis, by_shared_regen_cost_per_byte(graph, analysis))

    def swap_alternatives(self, graph: Graph, analysis: ProfileAnalysis, budget_bytes: int) -> list[list[str]]:
        infos = analysis.tensors
        # The recompute tail without swaps: the per-byte cost of the last tensor the budget needs.
        order = order_by_standalone_cost(analysis, frees_memory(analysis, recompute_candidates(graph, analysis, set())))
        need = analysis.keep_all_peak_bytes - budget_bytes
        tail_per_byte = 0.0
        for t in order:
            if need <= 0:
                break
            need -= infos[t].size_bytes
            tail_per_byte = infos[t].regen_s / max(infos[t].size_bytes, 1)
        above_tail = [
            t for t, i in infos.items() if i.size_bytes > 0 and (i.boundary or i.regen_s / i.size_bytes > tail_per_byte)
        ]
        def window(t: str) -> float:
            return -(infos[t].first_backward_use_s - infos[t].ready_s)

        def bytes_per_copy_s(t: str) -> float:
            return -infos[t].size_bytes / max(infos[t].d2h_s, infos[t].h2d_s)

        all_sized = [t for t, i in infos.items() if i.size_bytes > 0]
        return [
            self.select_swaps(graph, analysis),
            take_while_hidden(analysis, sorted(above_tail, key=window)),
            take_while_hidden(analysis, sorted(all_sized, key=window)),
            take_while_hidden(analysis, sorted(all_sized, key=bytes_per_copy_s)),
        ]

    def order_recompute(self, graph: Graph, analysis: ProfileAnalysis, candidates: list[str]) -> list[str]:
        return order_by_marginal_cost(graph, analysis, frees_memory(analysis, candidates))
