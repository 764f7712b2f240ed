"""`dtr`: Dynamic Tensor Rematerialization (Kirisame, Lyubomirsky, Haan, Brennan, He, Roesch, Chen,
Tatlock, "Dynamic Tensor Rematerialization", ICLR 2021), run ahead of time over one training step and
turned into an explicit plan.

DTR is a runtime: whenever an allocation would exceed the budget it evicts the resident tensor of
least heuristic score, and rematerialises an evicted tensor when an op reads it. Its heuristic
(paper section 3, h_DTR) is

    h(t) = (c(t) + sum of c(t') over e*(t)) / (m(t) * s(t)),

c = compute cost of the op that produced t, m = its memory, s = staleness (time since last access),
e*(t) = t's evicted neighbourhood (the evicted tensors that rematerialising t would also need).

Here the heuristic is replayed over the keep-all op order (`_dtr_evictions`): op by op, a read of an
evicted tensor rematerialises it (allocated again, its staleness restarts), outputs are allocated,
and while the device holds more than the budget the evictable tensor of least h is evicted. Every
saved forward tensor DTR ever evicts becomes `recompute` in the plan; everything else is kept; the
schedule is the shared `build_schedule`. If that schedule still peaks above the budget (DTR can
rematerialise and evict the same tensor several times; a plan recomputes each once and holds the
copy until its last reader), the replay is repeated with the budget lowered by the excess, at most
`max_rounds` times; then it is infeasible, with the figures.

Departures from the paper (docs/planners.md):
- only tensors whose forward readers have all run are evictable, and only saved forward activations
  (a plan can recompute a forward tensor only in backward; gradients cannot be recomputed);
- e*(t) is the upstream part of the evicted neighbourhood: the ops `analysis.regen_chain` re-runs to
  rebuild t with the tensors evicted so far missing (the cost a rematerialisation of t pays);
- staleness uses the keep-all timeline's clock (rematerialisation time is not added to it);
- no swapping (DTR never swaps).
"""

from __future__ import annotations

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import FORWARD_PHASES, Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget, gib
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import regen_walk
from slackswap.schedule.build import build_schedule, keep_all_plan
from slackswap.schedule.replay import estimate_plan

#: Staleness floor (s): a tensor accessed by the op that just finished is not infinitely precious.
_MIN_STALENESS_S = 1e-9


class DtrCannotFit(Exception):
    """Every resident tensor is in use or not evictable, and the device still holds too much."""

    def __init__(self, op: str, in_use_bytes: int):
        self.op = op
        self.in_use_bytes = in_use_bytes


def _chain_cost(graph: Graph, tensor: str, evicted: set[str]) -> tuple[float, frozenset[str]]:
    """(c(t) + costs of its upstream evicted neighbourhood, saved inputs the chain stops at).

    The chain walks back through evicted tensors and non-saved forward tensors (gone after forward);
    it stops at resident saved tensors: the `frontier`, whose eviction changes this cost."""
    ops, frontier = regen_walk(graph, tensor, evicted)
    return sum(graph.op_by_name[o].duration_s for o in ops), frozenset(frontier)


def _dtr_evictions(graph: Graph, hardware: Hardware, budget_bytes: int) -> tuple[set[str], int, int]:
    """Replay DTR's eviction over the keep-all op order under `budget_bytes`.

    Returns (tensors ever evicted, evictions, rematerialisations). Raises DtrCannotFit."""
    timeline = estimate_plan(graph, keep_all_plan(graph), hardware)
    forward_tensor = {t for op in graph.ops if op.phase in FORWARD_PHASES for t in op.outputs}
    evictable_kind = {t.name for t in graph.saved_tensors if t.name in forward_tensor and t.size_bytes > 0}
    size = {name: t.size_bytes for name, t in graph.tensors.items()}
    readers_left = {name: len(t.consumers) for name, t in graph.tensors.items()}
    forward_readers_left = {
        name: sum(1 for c in t.consumers if graph.op_by_name[c].phase in FORWARD_PHASES)
        for name, t in graph.tensors.items()
    }
    resident: set[str] = set()
    evicted: set[str] = set()
    ever: set[str] = set()
    last_access: dict[str, float] = {}
    cost_cache: dict[str, float] = {}
    frontier_users: dict[str, set[str]] = {}
    in_use = 0
    evictions = remats = 0

    def cost(t: str) -> float:
        if t not in cost_cache:
            c, frontier = _chain_cost(graph, t, evicted)
            cost_cache[t] = c
            for f in frontier:
                frontier_users.setdefault(f, set()).add(t)
        return cost_cache[t]

    for i, op in enumerate(graph.ops):
        now = timeline.step_start_s[i]
        pinned = set(op.inputs) | set(op.outputs)
        for t in op.inputs:
            if t in evicted:  # rematerialise on demand
                evicted.discard(t)
                resident.add(t)
                in_use += size[t]
                remats += 1
                for user in frontier_users.pop(t, ()):  # a chain through t now stops at t again
                    cost_cache.pop(user, None)
        for t in op.outputs:
            resident.add(t)
            in_use += size[t]
            last_access[t] = now
        while in_use > budget_bytes:
            candidates = [
                t for t in resident
                if t in evictable_kind and t not in pinned and forward_readers_left[t] == 0 and readers_left[t] > 0
            ]
            if not candidates:
                raise DtrCannotFit(op.name, in_use)
            victim = min(
                candidates,
                key=lambda t: (cost(t) / (size[t] * max(now - last_access[t], _MIN_STALENESS_S)), t),
            )
            resident.discard(victim)
            evicted.add(victim)
            ever.add(victim)
            in_use -= size[victim]
            evictions += 1
            for user in frontier_users.pop(victim, ()):  # chains that stopped at the victim grow
                cost_cache.pop(user, None)
        end = timeline.step_end_s[i]
        for t in op.inputs:
            last_access[t] = end
            readers_left[t] -= 1
            if op.phase in FORWARD_PHASES:
                forward_readers_left[t] -= 1
        for t in pinned:
            if readers_left[t] == 0 and t in resident:
                resident.discard(t)
                in_use -= size[t]
            if readers_left[t] == 0:
                evicted.discard(t)
    return ever, evictions, remats


@register_planner("dtr")
class Dtr:
    name = "dtr"

    def __init__(self, max_rounds: int = 8):
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 0:
            raise ConfigError("planner.options.max_rounds", max_rounds, "must be an integer >= 0")
        self.max_rounds = max_rounds

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        keep = {t.name: Decision.KEEP for t in graph.saved_tensors}
        if budget_bytes is None:
            return build_schedule(graph, keep, planner=self.name, budget_bytes=None, hardware=hardware)
        replay_budget = budget_bytes
        peak = None
        for round_ in range(self.max_rounds + 1):
            try:
                evicted, evictions, remats = _dtr_evictions(graph, hardware, replay_budget)
            except DtrCannotFit as exc:
                lowered = ", lowered by the excess of the earlier rounds' plans" if round_ else ""
                raise InfeasibleBudgetError(
                    f"dtr: at op {exc.op!r} the device holds {gib(exc.in_use_bytes)} > {gib(replay_budget)} "
                    f"(budget {gib(budget_bytes)}{lowered}) and every resident tensor is in use, a gradient, "
                    "or still read by the forward pass",
                    min_feasible_bytes=peak,
                ) from None
            decisions = dict(keep)
            decisions.update(dict.fromkeys(evicted, Decision.RECOMPUTE))
            plan = build_schedule(
                graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
                notes={"dtr_evictions": evictions, "dtr_rematerialisations": remats, "dtr_rounds": round_,
                       "dtr_replay_budget_bytes": replay_budget, "heuristic": "h_DTR = cost / (memory * staleness)"},
            )
            peak = estimate_plan(graph, plan, hardware).peak_bytes
            if peak <= budget_bytes:
                return plan
            replay_budget -= peak - budget_bytes
            if replay_budget <= 0:
                break
        raise InfeasibleBudgetError(
            f"dtr: after {round_ + 1} replay(s) the plan of DTR's evictions still peaks at {gib(peak)} > budget "
            f"{gib(budget_bytes)} (each round lowers the replay budget by the excess)",
            min_feasible_bytes=peak,
        )
