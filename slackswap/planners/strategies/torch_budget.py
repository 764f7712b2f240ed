"""`torch_budget`: torch.compile's `activation_memory_budget` (torch/_functorch/partitioners.py,
`choose_saved_values_set`, torch 2.13) on the traced graph.

What torch does, and what this planner does the same way:
- the budget is a fraction of the *default* partition's saved bytes, measured up from saving nothing
  but the inputs: 0 saves only the inputs (everything is recomputed), 1 is the default min-cut
  partition (`solve_min_cut` with compute-intensive and random ops banned from recompute);
- if the aggressive partition (only compute-intensive ops banned; random ops recomputed too) is
  already below the fraction, it is the answer;
- otherwise a 0/1 knapsack over the banned ops that backward needs (sorted by size, largest first):
  memory = the op's output bytes over (default - inputs), runtime = its FLOPs (torch's default
  `activation_memory_budget_runtime_estimator = "flops"`, at least 1), torch's default solver `dp`
  (memories quantised to 1/10000, float32 table, the same backtracking), capacity = the fraction;
  the ops the knapsack does not save are unbanned and the aggressive min cut is solved again;
- every op that is not banned (pointwise ops, norms, softmax) is recomputable *for free*: the cut
  only minimises saved bytes, so recompute chains of pointwise ops cost nothing in its model.
The saved set is the cut: tensors autograd saves and checkpoint candidates alike (the min cut may
save what eager never saves). A node's capacity is its bytes; aliases and tensors overwritten in
place cannot be cut (a saved view is its base). The min cut is scipy's maximum flow on the forward
tensors (split into in and out nodes), so the planner needs no torch.

`fraction`: torch's budget, or `fit`: the largest fraction in steps of 1/100 whose plan fits the
budget (what a user tuning the knob for a memory limit finds: scanned down from 1, each distinct
partition scheduled once; the min cuts and the knapsack table are shared by all fractions). The
partitions and their replayed peaks are kept with the graph (`GraphMemo`, per hardware): a peak does
not depend on the budget, so the floor's bisection (about 20 plannings of one graph,
`slackswap.experiment.floor`) and a budget sweep schedule each partition once, not once per
planning; only the returned plan is built again, with its own budget. Differences
from the compiled step, measured on the CPU, are in docs/planners.md ("torch_sac and torch_budget
against PyTorch").
"""

from __future__ import annotations

import numpy as np

from slackswap.errors import ConfigError
from slackswap.graph import FORWARD_PHASES, Graph, GraphMemo, OpClass
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.support.budget_check import over_budget, scheduled_peak
from slackswap.schedule.build import build_schedule

#: torch's dp_knapsack quantisation (torch/_functorch/_activation_checkpointing/knapsack.py: S = 10000).
KNAPSACK_SCALE = 10000
#: `fraction: fit` tries 1, 0.99, .., 0 (torch's knob is usually set in such steps).
FIT_STEPS = 100
#: scipy's maximum_flow takes int32 capacities: bytes are counted in units that keep the sum of all
#: tensors below 2^29, and "cannot be cut" is 2^30 (above any finite cut).
_INF = 1 << 30
_TOTAL_UNITS = 1 << 29


def _compute_intensive(graph: Graph, op_name: str) -> bool:
    return graph.op_by_name[op_name].op_class in (OpClass.MATMUL, OpClass.ATTENTION)


class _ForwardNetwork:
    """The forward tensors as torch's min-cut network: in -> out per tensor (capacity = bytes),
    out -> in of every tensor its readers make, source -> in of tensors made from nothing but
    weights and the batch, and of banned tensors; out -> sink for what backward reads."""

    def __init__(self, graph: Graph):
        self.graph = graph
        ops = [op for op in graph.ops if op.phase in FORWARD_PHASES]
        self.tensors = [t for op in ops for t in op.outputs]
        self.index = {t: i for i, t in enumerate(self.tensors)}
        written = {t for op in ops for t in op.writes}
        n = len(self.tensors)
        total = sum(graph.tensors[t].size_bytes for t in self.tensors)
        unit = max(1, -(-total // _TOTAL_UNITS))
        self.source, self.sink = 2 * n, 2 * n + 1
        rows, cols, caps = [], [], []
        for t in self.tensors:
            i = self.index[t]
            tensor = graph.tensors[t]
            # Saving a version an in-place op wrote (a dropout mask bernoulli_ fills) saves its storage;
            # a version overwritten later cannot be saved; a view is never cut on its own (its base is).
            size = graph.tensors[graph.storage_root(t)].size_bytes if tensor.base and tensor.saved else \
                (-1 if tensor.base else tensor.size_bytes)
            rows.append(2 * i)
            cols.append(2 * i + 1)
            caps.append(_INF if size < 0 or t in written else max(1, size // unit))
            if tensor.saved:
                rows.append(2 * i + 1)
                cols.append(self.sink)
                caps.append(_INF)
        self.fixed = (rows, cols, caps)
        self.inputs_of: dict[str, list[int]] = {}
        for op in ops:
            sources = [self.index[t] for t in dict.fromkeys(op.inputs) if t in self.index]
            for t in op.outputs:
                self.inputs_of[t] = sources
        self.producer = {t: graph.tensors[t].producer for t in self.tensors}

    def cut(self, banned: set[str]) -> set[str]:
        """The tensors the minimum cut saves when the ops in `banned` may not be recomputed."""
        # scipy's sparse graphs only here: a run of another planner does not import scipy's solvers.
        from scipy.sparse import csr_matrix
        from scipy.sparse.csgraph import maximum_flow

        rows, cols, caps = (list(x) for x in self.fixed)
        for t in self.tensors:
            i = self.index[t]
            sources = self.inputs_of[t]
            if not sources or self.producer[t] in banned:
                rows.append(self.source)
                cols.append(2 * i)
                caps.append(_INF)
            for j in sources:
                rows.append(2 * j + 1)
                cols.append(2 * i)
                caps.append(_INF)
        size = 2 * len(self.tensors) + 2
        matrix = csr_matrix((np.array(caps, dtype=np.int32), (rows, cols)), shape=(size, size))
        matrix.sum_duplicates()
        flow = maximum_flow(matrix, self.source, self.sink).flow
        residual = (matrix - flow).tocsr()
        reach = np.zeros(size, dtype=bool)
        reach[self.source] = True
        stack = [self.source]
        indptr, indices, data = residual.indptr, residual.indices, residual.data
        while stack:
            u = stack.pop()
            for k in range(indptr[u], indptr[u + 1]):
                v = indices[k]
                if data[k] > 0 and not reach[v]:
                    reach[v] = True
                    stack.append(v)
        return {t for t in self.tensors if reach[2 * self.index[t]] and not reach[2 * self.index[t] + 1]}


def dp_table(memory: list[float], runtime: list[float], capacity: float) -> tuple[np.ndarray, list[int]]:
    """torch's `dp_knapsack` table (memories quantised to 1/10000, float32) up to `capacity`. Column j
    of a table built for a larger capacity is the same as in one built for capacity j, so one table
    serves every fraction."""
    quantised = [round(m * KNAPSACK_SCALE) for m in memory]
    width = round(capacity * KNAPSACK_SCALE)
    n = len(memory)
    dp = np.zeros((n + 1, width + 1), dtype=np.float32)
    for i in range(1, n + 1):
        w, r = quantised[i - 1], np.float32(runtime[i - 1])
        dp[i, :] = dp[i - 1, :]
        if w == 0:
            dp[i, :] = dp[i - 1, :] + r
        elif w <= width:
            dp[i, w:] = np.maximum(dp[i - 1, w:], dp[i - 1, :-w] + r)
    return dp, quantised


def dp_backtrack(dp: np.ndarray, quantised: list[int], max_memory: float) -> list[int]:
    """torch's backtracking: item i - 1 is saved where dp[i][j] != dp[i - 1][j]."""
    saved, j = [], round(max_memory * KNAPSACK_SCALE)
    for i in range(len(quantised), 0, -1):
        if dp[i][j] != dp[i - 1][j]:
            saved.append(i - 1)
            j -= quantised[i - 1]
    return saved[::-1]


def dp_knapsack(memory: list[float], runtime: list[float], max_memory: float) -> list[int]:
    """torch's `dp_knapsack`: the items saved."""
    dp, quantised = dp_table(memory, runtime, max_memory)
    return dp_backtrack(dp, quantised, max_memory)


class TorchPartitioner:
    """`choose_saved_values_set` on one graph; the cuts and the knapsack table that do not depend on
    the fraction are computed once."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.net = _ForwardNetwork(graph)
        forward = [op for op in graph.ops if op.phase in FORWARD_PHASES]
        self.intensive = {op.name for op in forward if _compute_intensive(graph, op.name)}
        self.random = {op.name for op in forward if op.random}
        sizes = graph.size_bytes_of
        self.default = self.net.cut(self.intensive | self.random)
        self.max_bytes = sum(sizes[t] for t in self.default)
        self._aggressive: set[str] | None = None
        self._table = None
        self._by_fraction: dict[float, tuple[frozenset[str], dict[str, object]]] = {}

    def _own_bytes(self, op: str) -> int:
        return sum(self.graph.size_bytes_of[t] for t in self.graph.op_by_name[op].outputs
                   if not self.graph.tensors[t].base)

    def saved(self, fraction: float) -> tuple[set[str], dict[str, object]]:
        """The saved set at `fraction` and how it was found (a fresh set and dict: the caller's to keep)."""
        if fraction not in self._by_fraction:
            saved, facts = self._saved(fraction)
            self._by_fraction[fraction] = (frozenset(saved), facts)
        saved, facts = self._by_fraction[fraction]
        return set(saved), dict(facts)

    def _saved(self, fraction: float) -> tuple[set[str], dict[str, object]]:
        if fraction == 0:
            return set(), {"stage": "inputs_only"}
        if fraction == 1 or self.max_bytes == 0:
            return set(self.default), {"stage": "default", "default_saved_bytes": self.max_bytes}
        if self._aggressive is None:
            self._aggressive = self.net.cut(self.intensive)
        sizes = self.graph.size_bytes_of
        if sum(sizes[t] for t in self._aggressive) / self.max_bytes < fraction:
            return set(self._aggressive), {"stage": "aggressive", "default_saved_bytes": self.max_bytes}
        if self._table is None:
            needed = _needed_by_backward(self.graph)
            # torch sorts by size, largest first (a stable sort: ties in graph order)
            items = sorted((op.name for op in self.graph.ops if op.name in self.intensive and op.name in needed),
                           key=lambda op: -self._own_bytes(op))
            memory = [self._own_bytes(op) / self.max_bytes for op in items]
            runtime = [max(self.graph.op_by_name[op].flops, 1.0) for op in items]
            self._table = (items, *dp_table(memory, runtime, 1.0))
        items, dp, quantised = self._table
        kept = {items[i] for i in dp_backtrack(dp, quantised, fraction)}
        saved = self.net.cut((self.intensive - set(items)) | kept)
        return saved, {"stage": "knapsack", "default_saved_bytes": self.max_bytes, "knapsack_saved_ops": len(kept)}


#: One partitioner per graph: its cuts, knapsack table and saved sets depend on the graph alone.
_partitioner: GraphMemo[TorchPartitioner] = GraphMemo(TorchPartitioner)
#: Per graph, per hardware (compared by value): each partition's replayed peak (module docstring).
_peaks: GraphMemo[list[tuple[Hardware, dict[frozenset[str], int]]]] = GraphMemo(lambda graph: [])


def _peaks_on(graph: Graph, hardware: Hardware) -> dict[frozenset[str], int]:
    tables = _peaks(graph)
    for known, table in tables:
        if known == hardware:
            return table
    tables.append((hardware, {}))
    return tables[-1][1]


def torch_budget_saved(graph: Graph, fraction: float) -> tuple[set[str], dict[str, object]]:
    """The saved set torch's `choose_saved_values_set` picks at `fraction`, and how it got there."""
    return _partitioner(graph).saved(fraction)


def _needed_by_backward(graph: Graph) -> set[str]:
    """Forward ops from whose outputs some tensor backward reads is reachable (torch: dist_from_bw finite)."""
    needed: set[str] = set()
    frontier = [t.producer for t in graph.saved_tensors if graph.op_by_name[t.producer].phase in FORWARD_PHASES]
    while frontier:
        op = frontier.pop()
        if op in needed:
            continue
        needed.add(op)
        frontier.extend(graph.tensors[t].producer for t in graph.op_by_name[op].inputs)
    return needed


def decisions_for(graph: Graph, saved: set[str]) -> dict[str, Decision]:
    out = {t.name: Decision.KEEP if t.name in saved else Decision.RECOMPUTE for t in graph.saved_tensors
           if graph.op_by_name[t.producer].phase in FORWARD_PHASES}
    out |= {t.name: Decision.KEEP for t in graph.saved_tensors if t.name not in out}
    out |= {t.name: Decision.KEEP for t in graph.candidate_tensors if t.name in saved}
    return out


@register_planner("torch_budget")
class TorchBudget:
    name = "torch_budget"

    def __init__(self, fraction: float | str = "fit"):
        if fraction != "fit" and not (isinstance(fraction, int | float) and not isinstance(fraction, bool)
                                      and 0 <= fraction <= 1):
            raise ConfigError("planner.options.fraction", fraction, "must be 'fit' or a number in [0, 1]")
        self.fraction = fraction

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        partitioner = _partitioner(graph)
        peaks = _peaks_on(graph, hardware)
        # Per partition, the notes of the first fraction of this planning that gave it (many fractions
        # give one partition); the plan is built for the one returned.
        first: dict[frozenset[str], dict[str, object]] = {}

        def probe(fraction: float) -> tuple[frozenset[str], int]:
            saved, facts = partitioner.saved(fraction)
            key = frozenset(saved)
            first.setdefault(key, {"fraction": fraction, **facts,
                                   "kept_candidates": sum(1 for t in graph.candidate_tensors if t.name in saved)})
            if key not in peaks:
                peaks[key] = scheduled_peak(graph, decisions_for(graph, saved), planner=self.name,
                                            budget_bytes=budget_bytes, hardware=hardware)[1]
            return key, peaks[key]

        def plan_of(key: frozenset[str]) -> Plan:
            return build_schedule(graph, decisions_for(graph, set(key)), planner=self.name,
                                  budget_bytes=budget_bytes, hardware=hardware, notes=first[key])

        if self.fraction != "fit":
            key, peak = probe(float(self.fraction))
            if budget_bytes is not None and peak > budget_bytes:
                raise over_budget(self.name, budget_bytes, f"torch's partition at budget {self.fraction}")
            return plan_of(key)
        # The largest fraction that fits, scanned down from 1 in steps of 0.01 (the peak is not monotone
        # in the fraction: a small one saves little but regenerates long chains in backward at once).
        for k in range(FIT_STEPS, -1, -1):
            key, peak = probe(k / FIT_STEPS)
            if budget_bytes is None or peak <= budget_bytes:
                return plan_of(key)
        raise over_budget(self.name, budget_bytes, "torch's partition at every budget 0, 0.01, .., 1")
