"""`slackswap`: swap what is expensive to regenerate, within the slack that really hides; recompute
the rest, cheapest per byte first, counting shared recompute work once.

Improvements over the seed's rule (`slackswap_seed`), see docs/planners.md:
- slack per direction and per tensor, not one pool: an offload must finish before the end of the
  forward pass (the memory peak) on a serial D2H engine, so a tensor produced late in the forward
  pass gets only the time left after it; a prefetch must finish before the tensor's first backward
  use on a serial H2D engine that can start only when backward does (`analysis.SlackLedger`);
- recompute is ranked by *marginal* cost per byte: ops already re-run for an earlier pick are free,
  and the outputs of one producer op are priced and taken together (a dropout output and its mask
  cost one dropout re-run for both; `order_by_group_marginal_cost`);
- a swapped byte is worth what it spares at the *tail* of the recompute ranking, not its own
  regeneration cost: once a tensor is more expensive per byte than the last tensor the budget makes
  us recompute, it would be kept anyway, and among such tensors the slack is best spent on the ones
  it can hold the most bytes of (longest production-to-use window first). slackswap therefore also
  tries that packing order over the tensors above the recompute tail and over all tensors (when
  the budget asks little, even cheap bytes swapped spare recompute), plus all tensors by bytes per
  copy-second, and keeps whichever of the four swapped sets (these three and the seed-style
  selection) gives the shortest estimated step (`swap_alternatives`);
- only the small swaps the budget needs: where the winning plan's peak sits below the budget,
  swapped tensors whose copies are latency-bound are returned to keep, smallest first, while the
  peak fits and the step is no longer (`support/unneeded_swaps.py`). A hidden swap is free in the
  simulator, but a small one on a machine costs a copy launch and a hook call, about as much as a
  large one. `only_needed_swaps: false` keeps every swap that hides.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

from slackswap import validation as check
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import ProfileAnalysis
from slackswap.planners.support.exact_time import PS_PER_S, op_durations_ps
from slackswap.planners.support.greedy import (
    order_by_standalone_cost,
    recompute_candidates,
    take_while_hidden,
)
from slackswap.planners.support.swap_recompute import SwapThenRecompute
from slackswap.planners.support.unneeded_swaps import drop_unneeded_swaps


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


def order_by_group_marginal_cost(
    graph: Graph, analysis: ProfileAnalysis, candidates: Sequence[str], prices: dict[str, float] | None = None
) -> list[str]:
    """Cheapest marginal regeneration per byte first, pricing the outputs of one producer op together.

    `order_by_marginal_cost` prices each tensor alone: the dropout output and its mask come from one
    op, so recomputing the output makes the mask free, but the output alone looks twice as expensive
    per byte as the pair really is and a costlier tensor (a GeLU output) is taken first. Here a
    group is the remaining candidates of one producer op; its price is the time of the ops its
    members' chains add (not yet re-run for an earlier pick) over the group's bytes, and a group is
    taken whole. After each pick the groups whose chains touch the newly covered ops are re-priced
    (lazy heap with versions), as in the per-tensor ranking.
    `prices`, if given, receives each tensor's group price (s per byte) at the time it was taken.
    """
    dur_ps = op_durations_ps(graph)
    rank = {t: i for i, t in enumerate(candidates)}
    members: dict[str, list[str]] = {}
    for t in candidates:
        members.setdefault(graph.tensors[t].producer, []).append(t)
    covered: set[str] = set()
    users: dict[str, set[str]] = {}  # op -> groups whose members' chains contain it
    # The time of each group's chain ops not yet covered, kept as picks cover ops (each op leaves
    # each group's total once): re-summing the union at each re-pricing was O(chain), and on traced
    # graphs the chains through the unsaved residual stream are O(L) long and re-price each other.
    uncovered_ps: dict[str, int] = {}
    size: dict[str, int] = {}
    for group, ts in members.items():
        ops = set().union(*(analysis.tensors[t].regen_ops for t in ts))
        for o in ops:
            users.setdefault(o, set()).add(group)
        uncovered_ps[group] = sum(dur_ps[o] for o in ops)
        size[group] = sum(max(analysis.tensors[t].size_bytes, 1) for t in ts)

    def key(group: str) -> float:
        return uncovered_ps[group] / PS_PER_S / size[group]

    version = dict.fromkeys(members, 0)
    heap = [(key(g), min(rank[t] for t in ts), 0, g) for g, ts in members.items()]
    heapq.heapify(heap)
    order: list[str] = []
    while heap:
        price, _, v, group = heapq.heappop(heap)
        if v != version[group] or not members[group]:
            continue
        picked = members[group]
        if prices is not None:
            prices.update(dict.fromkeys(picked, price))
        members[group] = []
        order.extend(picked)
        new_ops = {o for t in picked for o in analysis.tensors[t].regen_ops} - covered
        covered.update(new_ops)
        # A pick lengthens the chains that read a picked tensor by exactly the picked chains, whose ops
        # it has just covered: no price changes, so chains are not re-walked (as in
        # `order_by_marginal_cost`; on traced graphs the re-walk made planning quadratic). Only groups
        # sharing newly covered ops get a new price.
        affected: set[str] = set()
        for o in new_ops:
            for g in users[o]:
                uncovered_ps[g] -= dur_ps[o]
                affected.add(g)
        for g in affected:
            if g == group or not members[g]:
                continue
            version[g] += 1
            heapq.heappush(heap, (key(g), min(rank[t] for t in members[g]), version[g], g))
    return order


def in_layer_boundaries(graph: Graph, analysis: ProfileAnalysis) -> list[str]:
    """Layer boundaries of the stack whose regeneration chain (all other saved tensors on the device)
    is one op of their own layer, such as a post-LN layer's output norm reading the kept residual sum.
    The boundary rule exists because recomputing a boundary can chain back through many layers; a
    one-op chain cannot, and if a later pick lengthens it the marginal ranking prices that."""
    out = []
    for t, info in analysis.tensors.items():
        if info.boundary and info.layer >= 0 and len(info.regen_ops) == 1 and info.size_bytes > 0:
            out.append(t)
    return out


@register_planner("slackswap")
class SlackSwap(SwapThenRecompute):
    name = "slackswap"
    #: (analysis, labelled swapped sets) of the current `plan` call, for `notes["why"]`.
    _explain: tuple[ProfileAnalysis, dict[str, list[str]]] | None = None

    def __init__(self, only_needed_swaps: bool = True):
        """`only_needed_swaps`: drop the latency-bound swaps the budget does not need
        (`drop_unneeded_swaps`); false keeps every swap that hides, the plans before that rule."""
        self.only_needed_swaps = check.flag("planner.options.only_needed_swaps", only_needed_swaps)

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
            # A copy of no time (a zero-byte view freeing its base's bytes, on a link without
            # latency) frees bytes for nothing: first.
            copy_s = max(infos[t].d2h_s, infos[t].h2d_s)
            return -infos[t].size_bytes / copy_s if copy_s > 0 else -float("inf")

        all_sized = [t for t, i in infos.items() if i.size_bytes > 0]
        sets = {
            "costliest to regenerate per byte first": self.select_swaps(graph, analysis),
            "above the recompute tail, longest window first": take_while_hidden(
                analysis, sorted(above_tail, key=window)),
            "longest window first": take_while_hidden(analysis, sorted(all_sized, key=window)),
            "most bytes per copy second first": take_while_hidden(analysis, sorted(all_sized, key=bytes_per_copy_s)),
        }
        self._explain = (analysis, sets)
        return list(sets.values())

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        """The swap-then-recompute plan, with `notes["why"]`: for every swapped or recomputed tensor,
        the reason in one line (which swap set it came from and that its copies hide; its price and
        rank in the recompute ranking), and for every swap dropped as unneeded, that it is kept."""
        self._explain = None
        chosen_plan = super().plan(graph, hardware, budget_bytes)
        if self._explain is None:
            return chosen_plan
        analysis, sets = self._explain
        chosen_swaps = set(chosen_plan.tensors_with(Decision.SWAP))
        origin = next((label for label, chosen in sets.items() if set(chosen) == chosen_swaps), "")
        plan = chosen_plan
        if self.only_needed_swaps:
            plan = drop_unneeded_swaps(graph, hardware, budget_bytes, chosen_plan)
        swaps = set(plan.tensors_with(Decision.SWAP))
        prices: dict[str, float] = {}
        order = self.order_recompute(graph, analysis, self.recompute_pool(graph, analysis, chosen_swaps), prices)
        rank = {t: i for i, t in enumerate(order)}
        why: dict[str, str] = {}
        for t in plan.tensors_with(Decision.SWAP):
            why[t] = (f"swap: from the swapped set '{origin}'; its offload ends before the forward pass does and its "
                      "prefetch before its first backward use (SlackLedger)")
        for t in sorted(chosen_swaps - swaps):
            why[t] = (f"keep: in the swapped set '{origin}', but the budget does not need its swap (kept smallest "
                      "first while the peak fits and the step is no longer: drop_unneeded_swaps)")
        for t in plan.tensors_with(Decision.RECOMPUTE):
            why[t] = (f"recompute: rank {rank[t] + 1} of {len(order)} in the recompute ranking, "
                      f"{prices[t] * 2**20 * 1e6:.3f} us per MiB (its op's outputs priced together, shared "
                      "chain ops counted once); the budget needs the ranking up to here")
        return replace(plan, notes={**plan.notes, "swap_set": origin, "why": why})

    def order_recompute(
        self, graph: Graph, analysis: ProfileAnalysis, candidates: list[str], prices: dict[str, float] | None = None
    ) -> list[str]:
        return order_by_group_marginal_cost(graph, analysis, frees_memory(analysis, candidates), prices)

    def recompute_pool(self, graph: Graph, analysis: ProfileAnalysis, swaps: set[str]) -> list[str]:
        """Non-boundary tensors, plus the layer boundaries whose own regeneration stays inside their
        layer (`in_layer_boundaries`)."""
        return recompute_candidates(graph, analysis, swaps) + [
            t for t in in_layer_boundaries(graph, analysis) if t not in swaps
        ]
