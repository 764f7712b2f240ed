"""`dtr`: Dynamic Tensor Rematerialization (Kirisame, Lyubomirsky, Haan, Brennan, He, Roesch, Chen,
Tatlock, "Dynamic Tensor Rematerialization", ICLR 2021), run ahead of time over one training step and
turned into an explicit plan.

DTR is a runtime: whenever an allocation would exceed the budget it evicts the resident tensor of
least heuristic score, and rematerialises an evicted tensor when an op reads it. Its heuristic
(paper section 3, h_DTR) is

    h(t) = (c(t) + sum of c(t') over e*(t)) / (m(t) * s(t)),

c = compute cost of the op that produced t, m = its memory, s = staleness (time since last access),
e*(t) = t's evicted neighbourhood (the evicted tensors that rematerialising t would also need). The
paper also defines h_DTR^eq, which its PyTorch prototype implements: e*(t) approximated by union-find
equivalence classes of evicted tensors with running cost sums, so that a cost is a sum over the few
classes next to t rather than a walk of the graph. This planner uses h_DTR^eq (`_EvictedClasses`).

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
- e*(t) counts only the classes upstream of t (those of its producer and of the producers of its
  producer's inputs), not those of its readers' outputs: the cost a rematerialisation of t pays;
- a forward tensor that backward does not read counts as evicted from the moment it is made: it is
  gone by the time a plan's recompute could need it (DTR would see it still resident during forward
  and price a tensor next to the residual stream as cheap, a plan then regenerates it across layers);
- costs are summed in integer picoseconds (exact running sums);
- staleness uses the keep-all timeline's clock (rematerialisation time is not added to it);
- no swapping (DTR never swaps).

Cost (docs/planners.md, "Planning cost"): each eviction looks at one candidate per filing key
(`_Candidates`: about 20-30 keys on the analytic presets and traced graphs, whatever the depth), and
each change of a class refiles the tensors next to it, except for hub classes (`HUB_ADJACENT`), whose
cost is read at each choice: the replay is linear in depth.
"""

from __future__ import annotations

import heapq

from slackswap import validation as check
from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import FORWARD_PHASES, Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget, gib
from slackswap.planners.registry import register_planner
from slackswap.planners.support.budget_check import lower_until_within
from slackswap.planners.support.exact_time import op_durations_ps
from slackswap.schedule.build import build_schedule, keep_all_plan
from slackswap.schedule.replay import estimate_plan

#: Staleness floor (s): a tensor accessed by the op that just finished is not infinitely precious.
_MIN_STALENESS_S = 1e-9

#: A class adjacent to more than this many evictable tensors is a *hub*: the tensors next to it are
#: filed under its root and its cost is read at each choice, instead of being refiled whenever its
#: cost changes. Speed only, no effect on any choice (tests/test_dtr_classes.py replays with 0 and
#: with no hubs). On traced graphs the non-saved residual stream is one class adjacent to a few
#: tensors of every layer; refiling them all at each of its merges would be O(L) per eviction.
HUB_ADJACENT = 16


class DtrCannotFit(Exception):
    """Every resident tensor is in use or not evictable, and the device still holds too much."""

    def __init__(self, op: str, in_use_bytes: int):
        self.op = op
        self.in_use_bytes = in_use_bytes


def neighbourhoods(graph: Graph) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(forward op -> the forward ops it shares a tensor with, evictable-kind tensor -> its upstream ops).

    h_DTR's neighbours of a tensor are the tensors it shares an op with: its producer's inputs
    (upstream) and its consumers' outputs (downstream). Classes are merged across both (a class is
    a connected set of evicted tensors), but a tensor's cost counts only the upstream ones: the ops
    its rematerialisation re-runs or needs, its producer p and the producers of p's inputs (docs/
    planners.md; with the downstream ones too, Llama-7B at 50 % loses 6 points of throughput). Taken
    by op, and only forward (and loss) ops: gradients are never evicted and cannot be recomputed."""
    forward = {op.name for op in graph.ops if op.phase in FORWARD_PHASES}
    tensors = graph.tensors
    op_neighbours: dict[str, tuple[str, ...]] = {}
    for op in graph.ops:
        if op.name not in forward:
            continue
        near = {tensors[t].producer for t in op.inputs} | {
            c for t in op.outputs for c in tensors[t].consumers if c in forward
        }
        near.discard(op.name)
        op_neighbours[op.name] = tuple(sorted(near & forward))
    tensor_neighbours = {}
    for t in graph.saved_tensors:
        if t.producer not in forward or t.size_bytes <= 0:
            continue
        upstream = {tensors[i].producer for i in graph.op_by_name[t.producer].inputs}
        near = {t.producer} | upstream
        tensor_neighbours[t.name] = tuple(sorted(near & forward))
    return op_neighbours, tensor_neighbours


class _EvictedClasses:
    """h_DTR^eq's evicted neighbourhoods: union-find over the forward ops with an output off the device.

    Kirisame et al. (h_DTR^eq) approximate e*(t) by equivalence classes: a tensor leaving the
    device joins one class with its off-device neighbours, and a class carries the running sum of its
    members' costs, so the cost of a resident tensor's neighbourhood is a sum over the distinct
    classes next to it, without walking the graph. A rematerialised tensor leaves its class, which
    loses its cost but is not split (union-find cannot split). Here the members are ops: an op is in
    a class while at least one of its forward outputs is off the device (evicted, or freed after its
    last reader: DTR treats a tensor the program has released as evicted, it may still be needed to
    rematerialise a neighbour), so a multi-output op is paid once.

    It also keeps, per class root, the evictable tensors next to the class (`adjacent`), and records
    in `changed` the tensors whose cost or filing key changed, for `_Candidates` to refile.
    """

    def __init__(self, cost_ps: dict[str, int], op_neighbours: dict[str, tuple[str, ...]],
                 watchers: dict[str, tuple[str, ...]], hub_adjacent: int):
        self._op_cost = cost_ps
        self._op_neighbours = op_neighbours
        self._watchers = watchers
        self._hub_adjacent = hub_adjacent
        self._parent: list[int] = []
        self.cost_ps: list[int] = []  # at roots: the costs of the class's current members
        self._adjacent: list[set[str]] = []  # at roots
        self.hub: list[bool] = []  # at roots
        self.node_of: dict[str, int] = {}  # op -> its node, while it is a member
        self._off_outputs: dict[str, int] = {}
        self.changed: set[str] = set()

    def find(self, node: int) -> int:
        parent = self._parent
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def output_off(self, op: str) -> None:
        """One more forward output of `op` left the device."""
        off = self._off_outputs.get(op, 0) + 1
        self._off_outputs[op] = off
        if off > 1:
            return
        node = len(self._parent)
        self._parent.append(node)
        self.cost_ps.append(self._op_cost[op])
        watching = set(self._watchers.get(op, ()))
        self._adjacent.append(watching)
        self.hub.append(len(watching) > self._hub_adjacent)
        self.node_of[op] = node
        self.changed.update(watching)
        for near in self._op_neighbours[op]:
            other = self.node_of.get(near)
            if other is not None:
                self._union(node, other)
        root = self.find(node)
        if not self.hub[root]:
            self.changed.update(self._adjacent[root])

    def output_on(self, op: str) -> None:
        """A forward output of `op` came back (rematerialised)."""
        off = self._off_outputs[op] - 1
        self._off_outputs[op] = off
        if off > 0:
            return
        root = self.find(self.node_of.pop(op))
        self.cost_ps[root] -= self._op_cost[op]
        self.changed.update(self._watchers.get(op, ()))
        if not self.hub[root]:
            self.changed.update(self._adjacent[root])

    def _union(self, a: int, b: int) -> None:
        root_a, root_b = self.find(a), self.find(b)
        if root_a == root_b:
            return
        adjacent = self._adjacent
        if len(adjacent[root_a]) < len(adjacent[root_b]):
            root_a, root_b = root_b, root_a
        was_hub = self.hub[root_a]
        self._parent[root_b] = root_a
        self.cost_ps[root_a] += self.cost_ps[root_b]
        # root_b's tensors were filed under its name (a hub) or its cost (not one): either is gone.
        # root_b is the class with fewer of them, so a tensor is refiled this way O(log n) times.
        self.changed.update(adjacent[root_b])
        adjacent[root_a] |= adjacent[root_b]
        adjacent[root_b] = set()
        self.hub[root_a] = was_hub or self.hub[root_b] or len(adjacent[root_a]) > self._hub_adjacent
        if self.hub[root_a] and not was_hub:  # filed by cost until now
            self.changed.update(adjacent[root_a])

    def key(self, tensor: str, producer: str, neighbour_ops: tuple[str, ...], size: int) -> tuple:
        """(cost of the tensor and its non-hub neighbour classes, size, hub roots): the filing key.

        The tensor's cost is its producer's (unless the producer is already in a class: evicting it
        costs nothing more) plus the cost of every distinct class next to it; hubs' costs are added
        when a choice is made (`_Candidates.least`), since they change without refiling."""
        roots = set()
        for op in neighbour_ops:
            node = self.node_of.get(op)
            if node is not None:
                roots.add(self.find(node))
        fixed = 0 if producer in self.node_of else self._op_cost[producer]
        hubs = []
        for root in roots:
            if self.hub[root]:
                hubs.append(root)
            else:
                fixed += self.cost_ps[root]
        return (fixed, size, tuple(sorted(hubs)))


def _dtr_evictions(graph: Graph, hardware: Hardware, budget_bytes: int,
                   hub_adjacent: int = HUB_ADJACENT) -> tuple[list[str], int]:
    """Replay DTR's eviction (h_DTR^eq) over the keep-all op order under `budget_bytes`.

    Returns (every eviction's victim in order, rematerialisations). Raises DtrCannotFit.

    Each eviction takes the candidate of least (h, name), h = cost / (size x staleness), the cost
    from `_EvictedClasses`. Candidates are filed by their key (the part of the cost that changes only
    with a refiling, the size and their hub classes) in heaps ordered by last access (`_Candidates`):
    within one key h only falls as staleness grows, so the oldest member is the key's least, and an
    eviction looks at one member per key. The layers repeat the same tensors at the same costs, so
    the number of keys does not grow with depth; tests/test_dtr_classes.py checks every choice
    against a scan of every candidate with its cost summed over explicit classes.
    """
    timeline = estimate_plan(graph, keep_all_plan(graph), hardware)
    forward_ops = {op.name for op in graph.ops if op.phase in FORWARD_PHASES}
    forward_tensor = {t for op in graph.ops if op.phase in FORWARD_PHASES for t in op.outputs}
    unsaved_forward = {t for t in forward_tensor if not graph.tensors[t].saved}
    op_neighbours, tensor_neighbours = neighbourhoods(graph)
    watchers: dict[str, list[str]] = {}
    for t, near in tensor_neighbours.items():
        for op in near:
            watchers.setdefault(op, []).append(t)
    classes = _EvictedClasses(op_durations_ps(graph), op_neighbours,
                              {op: tuple(ts) for op, ts in watchers.items()}, hub_adjacent)
    producer = {name: t.producer for name, t in graph.tensors.items()}
    size = {name: t.size_bytes for name, t in graph.tensors.items()}
    readers_left = {name: len(t.consumers) for name, t in graph.tensors.items()}
    forward_readers_left = {
        name: sum(1 for c in t.consumers if c in forward_ops) for name, t in graph.tensors.items()
    }
    resident: set[str] = set()
    evicted: set[str] = set()
    victims: list[str] = []
    last_access: dict[str, float] = {}
    candidates = _Candidates(last_access, classes.cost_ps)
    in_use = 0
    remats = 0

    def refile(t: str) -> None:
        """t's residency, readers, last access or cost changed: file it again, or drop it."""
        if t in resident and t in tensor_neighbours and forward_readers_left[t] == 0 and readers_left[t] > 0:
            candidates.file(t, classes.key(t, producer[t], tensor_neighbours[t], size[t]))
        else:
            candidates.discard(t)

    def refile_changed() -> None:
        changed, classes.changed = classes.changed, set()
        for t in changed:
            if t in resident:
                refile(t)

    for i, op in enumerate(graph.ops):
        now = timeline.step_start_s[i]
        pinned = set(op.inputs) | set(op.outputs)
        for t in op.inputs:
            if t in evicted:  # rematerialise on demand
                evicted.discard(t)
                resident.add(t)
                in_use += size[t]
                remats += 1
                classes.output_on(producer[t])
                refile(t)
        for t in op.outputs:
            resident.add(t)
            in_use += size[t]
            last_access[t] = now
            if t in unsaved_forward:  # gone by the time backward could need it: off from the start
                classes.output_off(producer[t])
            refile(t)
        while in_use > budget_bytes:
            refile_changed()
            victim = candidates.least(now, pinned)
            if victim is None:
                raise DtrCannotFit(op.name, in_use)
            resident.discard(victim)
            evicted.add(victim)
            victims.append(victim)
            in_use -= size[victim]
            candidates.discard(victim)
            classes.output_off(producer[victim])
        end = timeline.step_end_s[i]
        for t in op.inputs:
            last_access[t] = end
            readers_left[t] -= 1
            if op.name in forward_ops:
                forward_readers_left[t] -= 1
        for t in pinned:
            if readers_left[t] == 0 and t in resident:
                resident.discard(t)
                in_use -= size[t]
                if t in forward_tensor and t not in unsaved_forward:  # released: DTR keeps it as evicted
                    classes.output_off(producer[t])
            if readers_left[t] == 0:
                evicted.discard(t)  # dead; it stays in its class
            refile(t)
    return victims, remats


class _Candidates:
    """The evictable tensors, filed for DTR's choice: least h = cost / (size x staleness), then name.

    A tensor sits in the heap of its key (`_EvictedClasses.key`: fixed cost, size, hub roots), keyed
    by (last access, name). The members of one key have the same cost (fixed part plus the hubs'
    current costs) and size, so h is a non-increasing function of staleness (now - last access,
    floored), evaluated with the same float operations for every member: the heap's top has the
    key's least h, and members with that same h (a tie) follow it in heap order. Entries are never
    removed in place: one whose tensor left the candidates, or whose key or last access changed
    since, is stale and dropped when it reaches the top. Refiling pushes a fresh entry.
    """

    def __init__(self, last_access: dict[str, float], class_cost_ps: list[int]):
        self._last_access = last_access
        self._class_cost = class_cost_ps
        self._key_of: dict[str, tuple] = {}
        self._groups: dict[tuple, list[tuple[float, str]]] = {}

    def file(self, t: str, key: tuple) -> None:
        self._key_of[t] = key
        heapq.heappush(self._groups.setdefault(key, []), (self._last_access[t], t))

    def discard(self, t: str) -> None:
        self._key_of.pop(t, None)

    def _valid(self, entry: tuple[float, str], key: tuple) -> bool:
        last, t = entry
        return self._key_of.get(t) == key and self._last_access[t] == last

    def least(self, now: float, pinned: set[str]) -> str | None:
        """The unpinned candidate of least (h, name), or None if every candidate is pinned."""
        best: tuple[float, str] | None = None
        for key in list(self._groups):
            fixed, size, hubs = key
            heap = self._groups[key]
            held: list[tuple[float, str]] = []
            group_best: tuple[float, str] | None = None
            cost = None
            while heap:
                entry = heap[0]
                if not self._valid(entry, key):
                    heapq.heappop(heap)
                    continue
                last, t = entry
                held.append(heapq.heappop(heap))
                if t in pinned:
                    continue
                if cost is None:
                    cost = fixed + sum(self._class_cost[root] for root in hubs)
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
        self.max_rounds = check.integer("planner.options.max_rounds", max_rounds, 0)

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        keep = {t.name: Decision.KEEP for t in graph.saved_tensors}
        if budget_bytes is None:
            return build_schedule(graph, keep, planner=self.name, budget_bytes=None, hardware=hardware)
        def plan_at(round_: int, replay_budget: int) -> Plan:
            try:
                victims, remats = _dtr_evictions(graph, hardware, replay_budget)
            except DtrCannotFit as exc:
                lowered = ", lowered by the excess of the earlier rounds' plans" if round_ else ""
                raise InfeasibleBudgetError(
                    f"dtr: at op {exc.op!r} the device holds {gib(exc.in_use_bytes)} > {gib(replay_budget)} "
                    f"(budget {gib(budget_bytes)}{lowered}) and every resident tensor is in use, a gradient, "
                    "or still read by the forward pass"
                ) from None
            decisions = dict(keep)
            decisions.update(dict.fromkeys(victims, Decision.RECOMPUTE))
            return build_schedule(
                graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
                notes={"dtr_evictions": len(victims), "dtr_rematerialisations": remats, "dtr_rounds": round_,
                       "dtr_replay_budget_bytes": replay_budget,
                       "heuristic": "h_DTR^eq = (cost + upstream evicted classes) / (memory * staleness)"},
            )

        plan, peak, rounds = lower_until_within(graph, hardware, budget_bytes, self.max_rounds, plan_at)
        if peak <= budget_bytes:
            return plan
        raise InfeasibleBudgetError(
            f"dtr: after {rounds} replay(s) the plan of DTR's evictions still peaks at {gib(peak)} > budget "
            f"{gib(budget_bytes)} (each round lowers the replay budget by the excess)"
        )
