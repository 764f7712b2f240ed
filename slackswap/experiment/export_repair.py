"""The plan made for the export, repaired where PyTorch's placement of every plan the planner made is over
the budget (docs/runtime.md, "A plan made for the export").

Why: `within_pytorchs_peak` searches the budget a planner plans at, which helps where a lower planning
budget makes a plan PyTorch runs within the real one. It cannot help where the planner's plans, priced
as PyTorch's eager checkpointing runs them, stay over at every planning budget the planner meets: the
swapping planners offload what the eager replay reloads whole at once, and a planner whose plan follows
its own schedule closely keeps what the replay's block then holds beside its recomputes. On the zoo at
70 % that refused most planners on most architectures (the zoo's Llama: 3 of 16 ran) while the plan
recomputing every decidable tensor fitted. `repair_for_export` takes the planner's nearest plan (the
lowest price PyTorch's placement gave) and moves its decisions to recompute, those that cost most as
PyTorch places them first: whole offloaded groups (reloaded at once at the replay), then kept groups,
largest first, each group what one policy decides together (`ExportFacts.tied`, `cached_together`),
never a tensor PyTorch keeps whatever a plan says, a held layer input or a tensor a recompute cannot
yield (`slackswap.planners.support.replay_rule`); then every move the fit does not need is restored
(`slackswap.planners.support.recompute_repair`). The result is within the budget both in the plan's own
replay and as PyTorch runs it, and it is named: the notes `export_repaired*` say what moved and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.support.recompute_repair import movable_groups, repair_by_recompute

#: Why a plan made for the export was repaired (the plan's notes, `export_repaired_reason`).
REPAIRED = ("every plan the planner made for the export peaked over the budget as PyTorch's eager checkpointing "
            "runs it (a layer's recomputes and reloads at once, at its replay); its nearest plan was repaired by "
            "moving the groups named in export_repaired_tensors to recompute, offloaded ones first, then kept "
            "ones, largest first, and restoring every move the fit did not need")


def repair_for_export(graph: Graph, pytorch_peak: Callable[[Plan], int], facts: object, held: list[str],
                      hardware: Hardware, budget_bytes: int | None, mode: str, attempts: list,
                      misses: list[Plan], reason: str) -> Plan | None:
    """The planner's nearest plan for the export repaired to fit `budget_bytes` (module docstring), or None
    (no budget, no plan to start from, eager placement not in question, or even every movable group
    recomputed does not fit). `graph`: the plan's graph; `pytorch_peak`: a plan's peak as PyTorch's
    placement runs it (`export_plan.pytorch_peak_bytes` on `pytorch_graph`, passed in so that this
    module, which `export_plan` calls, does not import it back); `facts`: `ExportFacts`; `attempts`:
    the budget search's (`Attempt`: each
    plan with its price as PyTorch runs it); `misses`: plans over the budget in their own replay; `reason`: why
    the search failed (kept in the notes)."""
    from slackswap.planners.support.fixed_keep import recompute_unread_swaps
    from slackswap.planners.support.replay_rule import replay_rule
    from slackswap.schedule.build import build_schedule
    from slackswap.schedule.replay import estimate_plan

    if budget_bytes is None or mode != "eager":
        return None
    over = [(a.budget_bytes, a.plan, a.peak_bytes) for a in attempts if a.plan is not None]
    candidates = over or [(budget_bytes, m, pytorch_peak(m)) for m in misses]
    if not candidates:
        return None
    nearest = min(candidates, key=lambda a: a[2])  # the first such: the largest planning budget
    nearest_budget, base, base_peak = nearest
    saved = {t.name for t in graph.saved_tensors}
    frozen = (set(facts.fixed_keep) | set(held) | set(replay_rule(graph).fixed) | set(facts.version_readers)
              | set(facts.not_kept))
    groups = movable_groups(base.decisions, saved, frozen, [*facts.tied, *facts.cached_together])

    def group_bytes(group: tuple[str, ...]) -> int:
        return sum(graph.tensors[t].size_bytes for t in group if t in saved or t in base.decisions)

    groups.sort(key=lambda g: (not any(base.decisions.get(t) == Decision.SWAP for t in g), -group_bytes(g)))

    def build(decisions: dict[str, Decision]) -> Plan:
        recompute_unread_swaps(graph, decisions, facts.cached_together, saved)
        return build_schedule(graph, decisions, planner=base.planner, budget_bytes=budget_bytes, hardware=hardware,
                              bound_step_s=base.bound_step_s, notes=base.notes)

    def price(plan: Plan) -> int | None:
        if estimate_plan(graph, plan, hardware).peak_bytes > budget_bytes:
            return None
        peak = pytorch_peak(plan)
        return peak if peak <= budget_bytes else None

    repaired = repair_by_recompute(base, groups, saved, build, price)
    if repaired is None:
        return None
    moved = sorted({t for g in repaired.moved for t in g})
    return replace(repaired.plan, notes={
        **dict(repaired.plan.notes), "pytorch_peak_bytes": repaired.peak_bytes,
        "pytorch_plan_budget_bytes": nearest_budget, "pytorch_plannings": len(attempts) or len(misses),
        "export_repaired": True, "export_repaired_tensors": moved,
        "export_repaired_bytes": sum(group_bytes(g) for g in repaired.moved),
        "export_repaired_from_peak_bytes": base_peak,
        "export_repaired_pricings": repaired.pricings, "export_repaired_reason": REPAIRED,
        "export_repaired_search": reason})


__all__ = ["REPAIRED", "repair_for_export"]
