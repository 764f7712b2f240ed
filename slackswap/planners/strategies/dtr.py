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

Cost (docs/planners.md, "Planning cost"): each eviction looks at one candidate per (cost, size)
group (`_Candidates`), and each chain whose frontier was evicted is priced again. On the analytic
presets chains are 2-3 ops and the replay is linear in depth. On traced graphs, whose residual stream
is not saved, a chain through evicted tensors runs back across layers, and the number of chains
priced again grows as L^2: those are not walked op by op but rebuilt from memoised sub-chains
(`_ChainMemo`, set unions) and priced with `math.fsum`, so the quadratic part is C-level set work.
"""

from __future__ import annotations

import heapq
import math

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import FORWARD_PHASES, Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget, gib
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import regen_walk, walk_table
from slackswap.schedule.build import build_schedule, keep_all_plan
from slackswap.schedule.replay import estimate_plan

#: Staleness floor (s): a tensor accessed by the op that just finished is not infinitely precious.
_MIN_STALENESS_S = 1e-9


class DtrCannotFit(Exception):
    """Every resident tensor is in use or not evictable, and the device still holds too much."""

    def __init__(self, op: str, in_use_bytes: int):
        self.op = op
        self.in_use_bytes = in_use_bytes


def _chain_cost(graph: Graph, tensor: str, evicted: set[str]) -> tuple[float, set[str]]:
    """(c(t) + costs of its upstream evicted neighbourhood, saved inputs the chain stops at).

    The chain walks back through evicted tensors and non-saved forward tensors (gone after forward);
    it stops at resident saved tensors: the `frontier`, whose eviction changes this cost. The sum is
    exact (`math.fsum`, correctly rounded), so it does not depend on the order of the op set and
    `_ChainMemo` can build the same set another way and price it the same."""
    ops, frontier = regen_walk(graph, tensor, evicted)
    return math.fsum([graph.op_by_name[o].duration_s for o in ops]), frontier


class _Chain:
    """The regeneration walk from one tensor (`regen_walk`'s ops and stop set), built from the walks
    of the tensors its producer pushes. `ops` and `frontier` are dropped once it is stale."""

    __slots__ = ("tensor", "ops", "frontier", "parents", "stale")

    def __init__(self, tensor: str, ops: frozenset[str], frontier: frozenset[str]):
        self.tensor = tensor
        self.ops = ops
        self.frontier = frontier
        self.parents: list[_Chain] = []
        self.stale = False


class _ChainMemo:
    """`regen_walk(graph, t, missing)` for every t, memoised while `missing` changes one tensor at a time.

    On traced graphs the residual stream is not saved, so the walk from a tensor of layer L runs back
    across every earlier layer, and DTR walks again every chain whose frontier it evicts: O(L) walks
    of O(L) ops per layer. But the walk from a tensor depends only on its producer's inputs: it is
    the producer plus the union of the walks of the inputs it pushes (non-saved or missing), stopping
    at the others. So each tensor's walk is kept (`_Chain`) and rebuilt from its inputs' walks (a
    set union, no op-by-op walk) only when the status of one of its producer's saved inputs changed
    (`status_changed`), or one of the walks it was built from was rebuilt. The sets are the walk's
    sets (tests/test_planner_scaling.py checks them against `regen_walk` at every cost DTR asks for)."""

    def __init__(self, graph: Graph, missing: set[str]):
        self._table = walk_table(graph)
        self._missing = missing
        self._memo: dict[str, _Chain] = {}
        self._status_users: dict[str, list[_Chain]] = {}

    def chain(self, tensor: str) -> _Chain:
        memo, table, missing = self._memo, self._table, self._missing
        stack = [tensor]
        while stack:
            name = stack[-1]
            if name in memo:
                stack.pop()
                continue
            pending = [t for t, saved in table[name][1] if (not saved or t in missing) and t not in memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self._build(name)
        return memo[tensor]

    def _build(self, name: str) -> None:
        producer, inputs = self._table[name]
        pushed: list[_Chain] = []
        stops: list[str] = []
        for t, saved in inputs:
            if not saved or t in self._missing:
                pushed.append(self._memo[t])
            else:
                stops.append(t)
        ops = frozenset((producer,)).union(*(c.ops for c in pushed))
        frontier = frozenset(stops).union(*(c.frontier for c in pushed))
        node = _Chain(name, ops, frontier)
        for c in pushed:
            c.parents.append(node)
        for t, saved in inputs:
            if saved:
                self._status_users.setdefault(t, []).append(node)
        self._memo[name] = node

    def status_changed(self, tensor: str) -> None:
        """`tensor` (saved) became missing or present: the walks its readers built are stale."""
        stack = self._status_users.pop(tensor, [])
        while stack:
            node = stack.pop()
            if node.stale:
                continue
            node.stale = True
            if self._memo.get(node.tensor) is node:
                del self._memo[node.tensor]
            stack.extend(node.parents)
            node.parents = []
            node.ops = node.frontier = frozenset()


def _dtr_evictions(graph: Graph, hardware: Hardware, budget_bytes: int) -> tuple[set[str], int, int]:
    """Replay DTR's eviction over the keep-all op order under `budget_bytes`.

    Returns (tensors ever evicted, evictions, rematerialisations). Raises DtrCannotFit.

    Each eviction takes the candidate of least (h, name). Scanning every resident candidate for it
    made the replay O(evictions x resident tensors), quadratic in depth. Instead the candidates are
    filed by (cost, size) in heaps ordered by last access (`_Candidates`): within one such group h
    only falls as staleness grows, so the oldest member is the group's least, and an eviction looks
    at one member per group (about 20-30 groups on the analytic presets, whatever the depth: the
    layers repeat the same tensors at the same costs). Costs are computed exactly when the scan
    computed them (for every unpinned candidate without a cached cost, at each eviction), so the
    cache, and with it every choice, is the scan's; tests/test_planner_scaling.py compares the two.
    """
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
    frontier_users: dict[str, set[str]] = {}  # f -> tensors registered under f since f's last eviction
    registered: dict[str, set[str]] = {}  # the converse: t -> every f with t in frontier_users[f]
    candidates = _Candidates(size, last_access, cost_cache)
    in_use = 0
    evictions = remats = 0

    def refile(t: str) -> None:
        """t's residency, readers or last access changed: add it to, or drop it from, the candidates."""
        if t in resident and t in evictable_kind and forward_readers_left[t] == 0 and readers_left[t] > 0:
            candidates.add(t)
        else:
            candidates.discard(t)

    def invalidate(frontier_tensor: str) -> None:
        """The costs whose chains stopped at `frontier_tensor` (when they were computed) are dropped."""
        for user in frontier_users.pop(frontier_tensor, ()):
            registered[user].discard(frontier_tensor)
            cost_cache.pop(user, None)
            candidates.cost_changed(user)

    duration = {op.name: op.duration_s for op in graph.ops}
    chains = _ChainMemo(graph, evicted)

    def cost(t: str) -> float:
        chain = chains.chain(t)
        c = cost_cache[t] = math.fsum(map(duration.__getitem__, chain.ops))
        # Register t under each f of its frontier, as the scan did, but only where it is not
        # registered already: the chain's frontier mostly repeats the last one's (O(L) on traced graphs).
        known = registered.setdefault(t, set())
        for f in chain.frontier - known:
            frontier_users.setdefault(f, set()).add(t)
        known |= chain.frontier
        return c

    for i, op in enumerate(graph.ops):
        now = timeline.step_start_s[i]
        pinned = set(op.inputs) | set(op.outputs)
        for t in op.inputs:
            if t in evicted:  # rematerialise on demand
                evicted.discard(t)
                chains.status_changed(t)
                resident.add(t)
                in_use += size[t]
                remats += 1
                invalidate(t)  # a chain through t now stops at t again
                refile(t)
        for t in op.outputs:
            resident.add(t)
            in_use += size[t]
            last_access[t] = now
            refile(t)
        while in_use > budget_bytes:
            for t in candidates.uncached(pinned):
                cost(t)
                candidates.cost_changed(t)
            victim = candidates.least(now, pinned)
            if victim is None:
                raise DtrCannotFit(op.name, in_use)
            resident.discard(victim)
            evicted.add(victim)
            chains.status_changed(victim)
            ever.add(victim)
            in_use -= size[victim]
            evictions += 1
            invalidate(victim)  # chains that stopped at the victim grow
            refile(victim)
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
            if readers_left[t] == 0 and t in evicted:
                evicted.discard(t)
                chains.status_changed(t)
            refile(t)
    return ever, evictions, remats


class _Candidates:
    """The evictable tensors, filed for DTR's choice: least h = cost / (size x staleness), then name.

    A tensor with a cached cost sits in the heap of its (cost, size) group, keyed by (last access,
    name). Within a group h is a non-increasing function of staleness (now - last access, floored),
    evaluated with the same float operations for every member, so the heap's top has the group's
    least h, and members with that same h (a tie) follow it in heap order. Entries are never removed
    in place: one whose tensor left the candidates, or whose cost or last access changed since, is
    stale and dropped when it reaches the top. Re-filing pushes a fresh entry.
    """

    def __init__(self, size: dict[str, int], last_access: dict[str, float], cost_cache: dict[str, float]):
        self._size = size
        self._last_access = last_access
        self._cost = cost_cache
        self._members: set[str] = set()
        self._uncached: set[str] = set()
        self._groups: dict[tuple[float, int], list[tuple[float, str]]] = {}

    def add(self, t: str) -> None:
        self._members.add(t)
        self.cost_changed(t)

    def discard(self, t: str) -> None:
        self._members.discard(t)
        self._uncached.discard(t)

    def cost_changed(self, t: str) -> None:
        """File t under its cached cost (or as uncached), if it is a candidate."""
        if t not in self._members:
            return
        cost = self._cost.get(t)
        if cost is None:
            self._uncached.add(t)
            return
        self._uncached.discard(t)
        heapq.heappush(self._groups.setdefault((cost, self._size[t]), []), (self._last_access[t], t))

    def uncached(self, pinned: set[str]) -> list[str]:
        """Candidates (not pinned) whose cost must be computed before the next choice."""
        return [t for t in self._uncached if t not in pinned]

    def _valid(self, entry: tuple[float, str], cost: float) -> bool:
        last, t = entry
        return t in self._members and self._cost.get(t) == cost and self._last_access[t] == last

    def least(self, now: float, pinned: set[str]) -> str | None:
        """The unpinned candidate of least (h, name), or None if every candidate is pinned."""
        best: tuple[float, str] | None = None
        for key in list(self._groups):
            cost, size = key
            heap = self._groups[key]
            held: list[tuple[float, str]] = []
            group_best: tuple[float, str] | None = None
            while heap:
                entry = heap[0]
                if not self._valid(entry, cost):
                    heapq.heappop(heap)
                    continue
                last, t = entry
                held.append(heapq.heappop(heap))
                if t in pinned:
                    continue
                h = cost / (size * max(now - last, _MIN_STALENESS_S))
                if group_best is not None and h != group_best[0]:
                    break  # h only grows from here on
                if group_best is None or t < group_best[1]:
                    group_best = (h, t)
            for entry in held:
                heapq.heappush(heap, entry)
            if not heap:
                del self._groups[key]
            if group_best is not None and (best is None or group_best < best):
                best = group_best
        return None if best is None else best[1]


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
