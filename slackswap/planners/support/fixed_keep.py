"""Plan with some saved tensors fixed to keep, with any planner: the plan space of an executor that
decides those tensors itself (PyTorch's checkpointing keeps a layer's output, a random op's output,
an in-place chain and every tensor outside a checkpointed layer, whatever a plan says).

Why a derived graph and not a planner option: every planner decides every saved tensor of the graph
it is given, so the way to make a tensor undecidable for all of them alike is a graph in which it is
not a saved tensor but still costs what a kept one costs. `graph_with_fixed_keep` builds it: a fixed
tensor's backward readers stop reading it, it is no longer saved, and the model's code holds it
(`Tensor.held_until`) until its last reader in the original graph. A held run copy lives exactly as
long as a kept one (the copy resolver extends a run copy to its hold, `slackswap.schedule.copies`),
and the scheduler lets a recompute read a tensor held into the backward pass as it reads a kept one
(`slackswap.schedule.build`), so a plan of the derived graph has the same steps and, copy for copy,
the same device memory as the same decisions with the fixed tensors kept on the original graph
(tests/test_fixed_keep.py checks the peak to the byte).

`plan_with_fixed_keep` plans the derived graph with the planner, maps the plan back (fixed tensors
keep; a decision a planner made for one of them as a checkpoint candidate is dropped), rebuilds the
schedule with `slackswap.schedule.build` on the original graph (the planner's transfer positions are
kept when the steps are the same) and checks its replayed peak against the budget. Tensors that must
share one decision (`tied`: PyTorch's policy is one per op, so several saved outputs of one op are
saved, offloaded or recomputed together) take the strongest of their members' decisions
(keep > swap > recompute), a decision for a checkpoint candidate the executor never keeps
(`not_kept`) is dropped and one it always holds (`kept_candidates`) is keep (the planner does not see
that hold: the kept copy is priced as a kept candidate, alive until its last recompute reader); that
can raise the peak, so then the derived graph is planned again with
the budget lowered by the excess (at most `max_rounds` times, as the MILP and DTR repair their plans).
It never returns a plan above the budget: `InfeasibleBudgetError` says why not.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import FORWARD_PHASES, Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import Planner, gib
from slackswap.planners.support.budget_check import lower_until_within
from slackswap.schedule.build import build_schedule, unread_swapped_candidates

#: Strongest first: the decision a tied group takes (one policy per op: any member kept keeps them all).
_STRENGTH = (Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE)


def check_fixed(graph: Graph, fixed: Collection[str], tied: Sequence[Sequence[str]] = ()) -> None:
    """Every fixed or tied tensor is a saved tensor of a forward op (naming the first that is not)."""
    ops = graph.op_by_name
    for field, names in (("fixed_keep", fixed), ("tied", [t for group in tied for t in group])):
        for name in names:
            tensor = graph.tensors.get(name)
            if tensor is None or not tensor.saved or ops[tensor.producer].phase not in FORWARD_PHASES:
                raise ConfigError(field, name, "is not a saved tensor of a forward op of the graph")


def graph_with_fixed_keep(graph: Graph, fixed: Collection[str]) -> Graph:
    """The graph in which the `fixed` saved tensors are not decidable and cost what a kept one does
    (module docstring): not saved, no backward reader, held until their last reader of `graph`."""
    check_fixed(graph, fixed)
    fixed = frozenset(fixed)
    if not fixed:
        return graph
    index, ops = graph.op_index, graph.op_by_name
    tensors = dict(graph.tensors)
    for name in fixed:
        t = graph.tensors[name]
        last = max((index[c] for c in (*t.consumers, *([t.held_until] if t.held_until else ()))),
                   default=index[t.producer])
        tensors[name] = replace(t, saved=False, held_until=graph.ops[last].name,
                                consumers=tuple(c for c in t.consumers if ops[c].phase in FORWARD_PHASES))
    new_ops = tuple(
        op if op.phase in FORWARD_PHASES or fixed.isdisjoint(op.inputs)
        else replace(op, inputs=tuple(t for t in op.inputs if t not in fixed))
        for op in graph.ops)
    meta = {**dict(graph.meta), "fixed_keep": sorted(fixed)}
    return replace(graph, name=f"{graph.name}+fixed_keep", ops=new_ops, tensors=MappingProxyType(tensors),
                   meta=meta)


def map_back(graph: Graph, derived_plan: Plan, fixed: Collection[str], hardware: Hardware,
             tied: Sequence[Sequence[str]] = (), notes: Mapping[str, object] | None = None,
             not_kept: Collection[str] = (), kept_candidates: Collection[str] = (),
             cached_together: Sequence[Sequence[str]] = ()) -> Plan:
    """The derived graph's plan on `graph`: fixed tensors keep, tied groups one decision, `not_kept`
    candidates undecided, `kept_candidates` kept, each `cached_together` group (saved tensors and
    candidates of one op) its strongest decision, a recomputed group's candidates undecided; the
    schedule rebuilt by `build_schedule`; the planner's transfers are kept where the steps and swaps
    are the same."""
    fixed = frozenset(fixed)
    decisions: dict[str, Decision] = {}
    for name, decision in derived_plan.decisions.items():
        if name in fixed or name in not_kept:
            continue  # a candidate decision for a fixed tensor (kept anyway) or one the executor never keeps
        decisions[name] = Decision(decision)
    decisions.update(dict.fromkeys(fixed, Decision.KEEP))
    decisions.update(dict.fromkeys(kept_candidates, Decision.KEEP))
    for group in tied:
        strongest = min((decisions[t] for t in group), key=_STRENGTH.index)
        decisions.update(dict.fromkeys(group, strongest))
    saved = {t.name for t in graph.saved_tensors}
    for group in cached_together:
        decided = [decisions[t] for t in group if t in decisions]
        if not decided:
            continue
        strongest = min(decided, key=_STRENGTH.index)
        for t in group:
            if strongest != Decision.RECOMPUTE or t in saved:
                decisions[t] = strongest
            else:
                decisions.pop(t, None)  # a candidate of a recomputed op: not kept, nothing cached
    recomputed = recompute_unread_swaps(graph, decisions, cached_together, saved)
    if recomputed:
        notes = {**dict(notes or {}), "swaps_recomputed": len(recomputed),
                 "swaps_recomputed_bytes": sum(graph.tensors[t].size_bytes for t in recomputed),
                 "swaps_recomputed_reason": UNREAD_SWAP}
    plan = build_schedule(graph, decisions, planner=derived_plan.planner, budget_bytes=derived_plan.budget_bytes,
                          hardware=hardware, bound_step_s=derived_plan.bound_step_s,
                          notes={**dict(derived_plan.notes), **dict(notes or {})})
    swapped = {t.tensor for t in derived_plan.offloads}
    if plan.steps == derived_plan.steps and swapped == {t.tensor for t in plan.offloads}:
        plan = replace(plan, offloads=derived_plan.offloads, prefetches=derived_plan.prefetches)
    return plan


#: Why a swap the planner chose is recomputed instead (`map_back`, the plan's notes `swaps_recomputed*`).
UNREAD_SWAP = ("a swapped op also makes a checkpoint candidate no recompute reads (LayerNorm's output beside its "
               "statistics, topk's or sort's values beside their indices): the executor offloads and reloads the op's "
               "outputs whole, and a swap of a tensor nothing reads back has no place in the schedule, so the op's "
               "saved outputs are recomputed instead (their bytes leave the device all the same)")


def recompute_unread_swaps(graph: Graph, decisions: dict[str, Decision],
                            cached_together: Sequence[Sequence[str]], saved: Collection[str]) -> list[str]:
    """Turn each swapped `cached_together` group with a candidate no step after the forward reads
    (`schedule.build.unread_swapped_candidates`) into a recomputed group, in `decisions`, until none is
    left (a recompute can leave another candidate unread); the saved tensors so recomputed."""
    changed: list[str] = []
    for _ in range(len(cached_together) + 1):
        unread = set(unread_swapped_candidates(graph, decisions))
        groups = [g for g in cached_together if unread.intersection(g)]
        if not groups:
            return changed
        for group in groups:
            for t in group:
                if t in saved:
                    decisions[t] = Decision.RECOMPUTE
                    changed.append(t)
                else:
                    decisions.pop(t, None)
    return changed


def plan_with_fixed_keep(
    planner: Planner,
    graph: Graph,
    hardware: Hardware,
    budget_bytes: int | None,
    fixed: Collection[str],
    tied: Sequence[Sequence[str]] = (),
    not_kept: Collection[str] = (),
    kept_candidates: Collection[str] = (),
    max_rounds: int = 4,
    cached_together: Sequence[Sequence[str]] = (),
    misses: list[Plan] | None = None,
) -> Plan:
    """`planner`'s plan of `graph` with the `fixed` saved tensors kept, each `tied` group deciding alike,
    no decision for the `not_kept` checkpoint candidates (the executor never keeps them: a decision a
    planner makes for one is dropped) and the `kept_candidates` kept (the executor holds them), within
    `budget_bytes` (module docstring), each `cached_together` group (the outputs of one op an executor
    caches whole) decided alike (`map_back`); `InfeasibleBudgetError` with the reason otherwise, the
    last plan over the budget appended to `misses` when given (a caller that repairs plans starts there)."""
    check_fixed(graph, fixed, tied)
    for field, names in (("not_kept", not_kept), ("kept_candidates", kept_candidates)):
        unknown = sorted(set(names) - graph.candidate_names)
        if unknown:
            raise ConfigError(field, unknown[0], "is not a checkpoint candidate of the graph")
    not_kept, kept_candidates = frozenset(not_kept), frozenset(kept_candidates)
    fixed = set(fixed)
    # A group with a fixed member is kept whole (its op's one policy saves all of it).
    tied = [tuple(g) for g in tied if len(g) > 1]
    for group in tied:
        if fixed.intersection(group):
            fixed.update(group)
    tied = [g for g in tied if fixed.isdisjoint(g)]
    # An op's outputs cached together: with a fixed member, its candidates are held and its saved ones kept.
    saved = {t.name for t in graph.saved_tensors}
    together = [tuple(g) for g in cached_together if len(g) > 1]
    held_too = {t for g in together if fixed.intersection(g) for t in g if t not in saved}
    fixed.update(t for g in together if fixed.intersection(g) for t in g if t in saved)
    kept_candidates = kept_candidates | (held_too & graph.candidate_names) - not_kept
    together = [g for g in together if fixed.isdisjoint(g)]
    derived = graph_with_fixed_keep(graph, fixed)
    notes = {"fixed_keep": len(fixed), "fixed_keep_bytes": sum(graph.tensors[t].size_bytes for t in fixed)}
    def plan_at(round_: int, plan_budget: int | None) -> Plan:
        try:
            derived_plan = planner.plan(derived, hardware, plan_budget)
        except InfeasibleBudgetError as exc:
            lowered = f" (lowered to {gib(plan_budget)} by the excess of the tied decisions)" if round_ else ""
            raise InfeasibleBudgetError(
                f"{planner.name} with {len(fixed)} tensor(s) fixed to keep ({gib(notes['fixed_keep_bytes'])}): "
                f"budget {gib(budget_bytes)}{lowered}: {exc}") from None
        plan = map_back(graph, derived_plan, fixed, hardware, tied,
                        {**notes, "fixed_keep_rounds": round_, "fixed_keep_plan_budget_bytes": plan_budget}, not_kept,
                        kept_candidates, together)
        return replace(plan, budget_bytes=budget_bytes)

    if budget_bytes is None:
        return plan_at(0, None)
    plan, peak, rounds = lower_until_within(graph, hardware, budget_bytes, max_rounds, plan_at)
    if peak <= budget_bytes:
        return plan
    if misses is not None:
        misses.append(plan)
    raise InfeasibleBudgetError(
        f"{planner.name} with {len(fixed)} tensor(s) fixed to keep: after {rounds} round(s) the plan, its "
        f"tied decisions made alike, still peaks at {gib(peak)} > budget {gib(budget_bytes)} (each round lowers "
        "the planner's budget by the excess)")


__all__ = ["UNREAD_SWAP", "check_fixed", "graph_with_fixed_keep", "map_back", "plan_with_fixed_keep",
           "recompute_unread_swaps"]
