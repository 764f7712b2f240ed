"""A plan made for the export to PyTorch: any planner's plan inside the space PyTorch's checkpointing
executes decision for decision, priced at the bytes the executor that runs it stores (docs/runtime.md,
"A plan made for the export").

Here, in the experiment layer, because it joins two layers below it: the facts of the export and the
graph as each executor stores it come from the runtime (`slackswap.runtime.export_facts`,
`slackswap.runtime.export_graph`, which read ATen tags and kernels and need torch), the planning with
tensors fixed to keep from the planners (`slackswap.planners.support.fixed_keep`, no torch). torch is
imported when the function runs, so importing this module needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.planners.base import Planner, gib
from slackswap.planners.support.fixed_keep import plan_with_fixed_keep
from slackswap.schedule.replay import estimate_plan


def export_plan_graph(graph: Graph, model: object, compile: bool = False) -> Graph:
    """The graph `plan_for_export(..., compile=compile)` plans on: compiled, each dropout's mask inside a
    layer at its compiled bytes (`slackswap.runtime.export_graph.graph_for_compile`); eager, `graph`. The
    simulator run on it prices that plan as the executor stores it."""
    from slackswap.runtime.export_facts import layer_paths
    from slackswap.runtime.export_graph import export_graph

    return export_graph(graph, layer_paths(model), compile)


def plan_for_export(planner: Planner, graph: Graph, model: object, hardware: Hardware,
                    budget_bytes: int | None, compile: bool = False, fit_pytorch_placement: bool = True) -> Plan:
    """`planner`'s plan of `graph` (captured by `slackswap.runtime.capture_graph` from `model`) with every
    tensor PyTorch keeps whatever a plan says kept, the tensors one policy decides together decided
    alike and no decision for a candidate nothing keeps, its peak within `budget_bytes`
    and, unless `fit_pytorch_placement` is false, its peak as PyTorch places the decisions
    (`within_pytorchs_peak`) too, the planner's nearest plan repaired where no planning budget gives one
    (`slackswap.experiment.export_repair`: decisions moved to recompute, named in the notes
    `export_repaired*`), `InfeasibleBudgetError` with the reason otherwise, every tensor at
    the bytes the export's executor stores: `compile`, the compiled step's (`export_plan_graph`), else
    CPU eager's. `PlanExport(plan, graph, model)` then executes every decision as planned (eager:
    `step_differences()` is empty; compiled, with `compile`: the partition saves the planned bytes).
    The plan's notes say which executor it was made for (`export_executor`), and `PlanExport` checks
    against that graph."""
    from slackswap.runtime.export_facts import export_facts, layer_paths
    from slackswap.runtime.export_graph import priced_for

    graph = export_plan_graph(graph, model, compile)
    facts = export_facts(graph, layer_paths(model))
    held = [t for t in facts.held_inputs if t in graph.candidate_names]

    misses: list[Plan] = []  # plans over the budget in their own replay (`plan_with_fixed_keep`)

    def plan_at(inner_budget: int | None) -> Plan:
        return plan_with_fixed_keep(planner, graph, hardware, inner_budget, facts.fixed_keep, facts.tied,
                                    facts.not_kept, held, cached_together=facts.cached_together, misses=misses)

    if not fit_pytorch_placement:  # the plan within its own replay only (a benchmark timing a fixed budget)
        return priced_for(plan_at(budget_bytes), compile)
    priced = pytorch_graph(graph, facts, compile)
    mode = "compiled" if compile else "eager"
    every = recompute_all_plan(graph, facts, hardware, held)
    # The search's floor: the plan recomputing every decidable tensor, in its own schedule (a planner
    # asked for less must swap); its step: `search_resolution_bytes`.
    floor = estimate_plan(graph, every, hardware).peak_bytes
    decided = [t.size_bytes for t in graph.saved_tensors if t.name not in facts.fixed_keep]
    attempts: list[Attempt] = []
    try:
        plan = within_pytorchs_peak(priced, hardware, budget_bytes, mode, plan_at, planner.name, floor,
                                    search_resolution_bytes(budget_bytes, decided), attempts)
    except InfeasibleBudgetError as exc:
        from slackswap.experiment.export_repair import repair_for_export

        repaired = repair_for_export(graph, lambda p: pytorch_peak_bytes(priced, p, hardware, mode), facts, held,
                                     hardware, budget_bytes, mode, attempts, misses, exc.reason)
        if repaired is not None:
            return priced_for(repaired, compile)
        recompute_all = pytorch_peak_bytes(priced, every, hardware, mode)
        raise InfeasibleBudgetError(f"{planner.name}: budget {budget_bytes} B; "
                                    f"{what_pytorch_keeps(graph, facts, held, recompute_all, mode)}: {exc.reason}"
                                    ) from None
    return priced_for(plan, compile)


class _RecomputeEvery:
    """Every saved tensor a plan may decide recomputed."""

    name = "recompute_every_decidable"

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        from slackswap.plan import Decision
        from slackswap.schedule.build import build_schedule

        decisions = {t.name: Decision.RECOMPUTE for t in graph.saved_tensors}
        return build_schedule(graph, decisions, planner=self.name, budget_bytes=None, hardware=hardware)


def recompute_all_peak_bytes(graph: Graph, priced: Graph, facts: object, hardware: Hardware, mode: str,
                             held: list[str]) -> int:
    """The peak, as PyTorch runs it (`mode`, priced on `priced`), of the plan that keeps only what PyTorch
    keeps whatever a plan says (`facts`: `ExportFacts`) and recomputes every other tensor. Not a floor:
    a plan that swaps, or keeps what a recompute would run a large transient again for (the attention
    scores), can peak lower as PyTorch places it (GPT-NeoX at 70 %: slackswap's 1.116 MiB, this 1.194)."""
    return pytorch_peak_bytes(priced, recompute_all_plan(graph, facts, hardware, held), hardware, mode)


def recompute_all_plan(graph: Graph, facts: object, hardware: Hardware, held: list[str]) -> Plan:
    """The plan for the export that keeps only what PyTorch keeps whatever a plan says and recomputes
    every other tensor (`recompute_all_peak_bytes`)."""
    return plan_with_fixed_keep(_RecomputeEvery(), graph, hardware, None, facts.fixed_keep, facts.tied,
                                facts.not_kept, held, cached_together=facts.cached_together)


def what_pytorch_keeps(graph: Graph, facts: object, held: list[str], recompute_all_bytes: int, mode: str) -> str:
    """What an infeasible budget for the export meets whatever the planner: the bytes PyTorch keeps whatever a
    plan says, by reason, the unsaved layer inputs its checkpoints hold, and `recompute_all_peak_bytes`."""
    by_reason: dict[str, int] = {}
    for name, why in facts.fixed_keep.items():
        short = why.split(":")[0].split(" (")[0]
        by_reason[short] = by_reason.get(short, 0) + graph.tensors[name].size_bytes
    kept = "; ".join(f"{b} B {why}" for why, b in sorted(by_reason.items(), key=lambda kv: -kv[1]))
    held_bytes = sum(graph.tensors[t].size_bytes for t in held)
    return (f"PyTorch keeps {sum(by_reason.values())} B whatever a plan says ({kept}), its checkpoints hold "
            f"{held_bytes} B of unsaved layer inputs, and recomputing every other tensor peaks at "
            f"{recompute_all_bytes} B as its {mode} checkpointing runs it")


def pytorch_graph(graph: Graph, facts: object, compile: bool) -> Graph:
    """The graph PyTorch's execution of a plan for the export is priced on: eager, with the holds of the
    checkpoint frames (`slackswap.pytorch_execution.eager_frame_holds`: the unsaved layer inputs a
    frame keeps as arguments and the layer outputs its cache keeps, until the frame dies); compiled,
    `graph` (the partition keeps no frame). `facts`: `slackswap.runtime.export_facts.ExportFacts`."""
    if compile:
        return graph
    from slackswap.pytorch_execution import eager_frame_holds
    from slackswap.runtime.export.mechanism import forced_layers
    from slackswap.runtime.export_facts import LAYER_OUTPUT

    outputs = [t for t, why in facts.fixed_keep.items() if why == LAYER_OUTPUT]
    return eager_frame_holds(graph, list(facts.held_inputs), outputs, forced_layers(graph, facts))


def pytorch_peak_bytes(graph: Graph, plan: Plan, hardware: Hardware, mode: str) -> int:
    """The replayed activation peak of `plan` as PyTorch places its decisions (`mode` "eager": each
    layer's recomputes in one block before its first backward reader, reloads there; "compiled": the
    partitioner's placement), `slackswap.pytorch_execution.pytorch_plan`. `graph` may be the plan's
    graph with other holds (`pytorch_graph`): the plan is priced on it as made for it."""
    from slackswap.pytorch_execution import (
        eager_cache_holds,
        eager_replay_peak_bytes,
        pytorch_plan,
        uncached_plain_outputs,
    )
    from slackswap.schedule.replay import estimate_plan

    if mode == "eager":  # a layer under a plain checkpoint caches no output (`slackswap.runtime.export.mechanism`)
        graph = eager_cache_holds(uncached_plain_outputs(graph, _plain_layers(graph, plan)), plan.decisions)
    plan = replace(plan, graph_fingerprint=graph.fingerprint)
    executed = pytorch_plan(graph, plan, dict(plan.decisions), hardware, mode)
    if mode == "eager":
        return eager_replay_peak_bytes(graph, executed, hardware)
    return estimate_plan(graph, executed, hardware).peak_bytes


def _plain_layers(graph: Graph, plan: Plan) -> frozenset[int]:
    """The layers the eager export runs `plan` under a plain checkpoint, from what `pytorch_graph` recorded
    (the layers the policy forces, the cached layer outputs); none on a graph it did not make."""
    from slackswap.pytorch_execution import CACHED_OUTPUTS_KEY, FORCED_LAYERS_KEY

    meta = graph.meta or {}
    if CACHED_OUTPUTS_KEY not in meta:
        return frozenset()
    from slackswap.runtime.export.mechanism import plain_checkpoint_layers

    return plain_checkpoint_layers(graph, plan.decisions, meta[FORCED_LAYERS_KEY], meta[CACHED_OUTPUTS_KEY])


#: The export's search of the planning budget stops within this share of the budget (`search_resolution_bytes`).
SEARCH_RESOLUTION_SHARE = 1 / 256


def search_resolution_bytes(budget_bytes: int | None, decided_sizes_bytes: list[int]) -> int:
    """How close `largest_fitting_budget` brings the planning budgets known fitting and over before it
    stops: the bytes of the smallest tensor a plan decides (`decided_sizes_bytes`; a closer budget
    cannot add a whole tensor), or `SEARCH_RESOLUTION_SHARE` of the budget (0.4 %) if that is more. Why
    the share: each halving is a whole planning (for milp several MILP solves, and each planning budget
    that finds no plan up to five of them), and past 0.4 % of the budget the plan it could find keeps at
    most that many more bytes. On the runtime tests' tiny GPT at 70 % it spares milp three plannings,
    and every planner's plan peaks as before."""
    smallest = min(decided_sizes_bytes, default=1)
    if budget_bytes is None:
        return smallest
    return max(smallest, int(budget_bytes * SEARCH_RESOLUTION_SHARE))


@dataclass(frozen=True)
class Attempt:
    """One planning budget tried by `largest_fitting_budget`: `plan` None when the planner found no plan
    that low (`reason` says why), else its `peak_bytes` as PyTorch runs it."""

    budget_bytes: int
    plan: Plan | None
    peak_bytes: int | None
    reason: str = ""


def largest_fitting_budget(budget_bytes: int, first_peak_bytes: int, floor_bytes: int, resolution_bytes: int,
                           attempt: Callable[[int], Attempt], excess_rounds: int = 4
                           ) -> tuple[Attempt | None, list[Attempt]]:
    """A planning budget below `budget_bytes` whose plan peaks within `budget_bytes` as PyTorch runs it, the
    largest one found: (its attempt, or None; every attempt, in order). `attempt(inner)` plans at
    `inner` and prices the plan; the plan at `budget_bytes` itself peaked at `first_peak_bytes`, over.

    Why a search: a plan's placement by PyTorch can peak over the budget the plan met in its own
    schedule, by an excess that does not shrink one for one with the planning budget (lowering by the
    excess, five times, stopped 69 KiB short on the zoo's Llama while recomputing everything fitted).
    Each try falls in one of three classes, in this order as the planning budget grows for a planner
    whose plan follows its budget: too low (no plan), fitting, over. Tried in turn:
    1. the planning budget lowered by the excess, while the plan stays over (at most `excess_rounds`
       times): what fitted before this search, kept so that no plan that fitted then is lost (DTR's
       replays do not follow their budget monotonically);
    2. with nothing fitting yet, `floor_bytes` (the caller's: the peak, in the plan's own schedule, of
       the plan recomputing every tensor a plan decides);
    3. bisection: the midpoint of the largest planning budget known not to be over (fitting or too low)
       and the smallest known over, until they are at most `resolution_bytes` apart.
    Terminates after at most `excess_rounds` + 1 + ceil(log2(`budget_bytes` / `resolution_bytes`))
    attempts (log2 of (`budget_bytes` - floor) when the floor is not over), and returns a fitting plan
    whenever one of the plans of step 1 or the plan at the floor fits: a fitting attempt is only ever
    replaced by one at a larger planning budget. Where the classes do come in that order, the result
    is the largest fitting planning budget within `resolution_bytes`."""
    tried: list[Attempt] = []
    best: Attempt | None = None
    lo, hi = 0, budget_bytes  # lo: largest budget known not over (0: none); hi: smallest known over

    def run(inner: int) -> Attempt:
        nonlocal lo, hi, best
        a = attempt(inner)
        tried.append(a)
        if a.plan is not None and a.peak_bytes > budget_bytes:
            hi = inner
        else:
            lo = inner
            if a.plan is not None:
                best = a
        return a

    inner, peak = budget_bytes, first_peak_bytes
    for _ in range(excess_rounds):
        inner -= peak - budget_bytes
        if not lo < inner < hi:
            break
        a = run(inner)
        if a.plan is None or a.peak_bytes <= budget_bytes:
            break
        peak = a.peak_bytes
    if best is None and lo < floor_bytes < hi:
        run(floor_bytes)
    step = max(1, resolution_bytes)
    while hi - lo > step:
        run((lo + hi) // 2)
    return best, tried


def within_pytorchs_peak(graph: Graph, hardware: Hardware, budget_bytes: int | None, mode: str,
                         plan_at, planner_name: str, floor_bytes: int = 0, resolution_bytes: int = 1,
                         attempts: list[Attempt] | None = None) -> Plan:
    """`plan_at(inner_budget)`'s plan whose peak as PyTorch executes it fits `budget_bytes`: PyTorch
    recomputes a layer's tensors all at once, before its first backward reader, where the plan's own
    schedule recomputes each right before its reader, so a plan within its budget can run over it.
    Over it, the planning budget is searched between `floor_bytes` and the budget
    (`largest_fitting_budget`: bisection, at most about log2 of that range over `resolution_bytes`
    planner calls) and the fitting plan of the largest planning budget is returned; none fits:
    `InfeasibleBudgetError` naming the nearest miss (the lowest peak an over plan reached, at which
    planning budget) and whether the planner's plan followed its budget at all (a fixed recipe, such
    as keep_all's or torch_sac's, decides alike at every budget, and no search changes that).
    Refused before the step runs, not after. Notes: `pytorch_peak_bytes`, and the planning budget the
    plan was made at (`pytorch_plan_budget_bytes`) with the number of plannings (`pytorch_plannings`).
    Every attempt is appended to `attempts` when given (the caller repairs the nearest miss)."""
    log = attempts if attempts is not None else []
    plan = plan_at(budget_bytes)
    if budget_bytes is None:
        return plan
    first = Attempt(budget_bytes, plan, pytorch_peak_bytes(graph, plan, hardware, mode))
    log.append(first)
    if first.peak_bytes <= budget_bytes:
        return _noted(first, 1)

    def attempt(inner: int) -> Attempt:
        try:
            p = plan_at(inner)
        except InfeasibleBudgetError as exc:
            a = Attempt(inner, None, None, exc.reason)
        else:
            a = Attempt(inner, p, pytorch_peak_bytes(graph, p, hardware, mode))
        log.append(a)
        return a

    best, tried = largest_fitting_budget(budget_bytes, first.peak_bytes, floor_bytes, resolution_bytes, attempt)
    if best is not None:
        return _noted(best, len(tried) + 1)
    over = [a for a in [first, *tried] if a.plan is not None]
    nearest = min(over, key=lambda a: (a.peak_bytes, -a.budget_bytes))
    low = [a for a in tried if a.plan is None]
    decided = {tuple(sorted(a.plan.decisions.items())) for a in over}
    why = (f"; at {max(a.budget_bytes for a in low)} B and below it found no plan ({low[-1].reason})"
           if low else "")
    fixed = (f"; its {len(over)} plan(s) decide alike at every planning budget tried (a fixed recipe: "
             "the plan does not follow its budget)" if len(over) > 1 and len(decided) == 1 else "")
    raise InfeasibleBudgetError(
        f"{planner_name}: the plan made for the export peaks over the budget {gib(budget_bytes)} ({budget_bytes} B) "
        f"as PyTorch's {mode} checkpointing runs it (a layer's recomputes at once, before its first backward "
        f"reader) at every planning budget tried ({len(tried) + 1}, from {budget_bytes} B down to "
        f"{min(a.budget_bytes for a in [first, *tried])} B); nearest: {gib(nearest.peak_bytes)} "
        f"({nearest.peak_bytes} B) planned at {nearest.budget_bytes} B{why}{fixed}")


def _noted(a: Attempt, plannings: int) -> Plan:
    return replace(a.plan, notes={**dict(a.plan.notes), "pytorch_peak_bytes": a.peak_bytes,
                                  "pytorch_plan_budget_bytes": a.budget_bytes, "pytorch_plannings": plannings})


__all__ = ["export_plan_graph", "plan_for_export", "pytorch_graph", "pytorch_peak_bytes", "recompute_all_peak_bytes",
           "recompute_all_plan", "search_resolution_bytes", "SEARCH_RESOLUTION_SHARE",
           "what_pytorch_keeps", "within_pytorchs_peak", "largest_fitting_budget",
           "Attempt"]
