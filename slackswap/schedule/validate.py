"""Plan validation: a plan must be a complete, consistent schedule before it is simulated.

`resolve_schedule` walks the plan in sequence order once. It checks every rule of
docs/simulation.md section 2 and, on the way, resolves which *copy* of a tensor each step reads
(the latest production before the step). The engine reuses that resolution, so validation and
simulation can never disagree about which copy a step reads. The first inconsistency found raises
`PlanValidationError` naming the tensor, op and step.

Sequence positions: step j sits at position j; a transfer with `issue_after_step = i` sits between
step i and step i + 1 (offloads before prefetches, each list in plan order); i = -1 is before step 0.

The copies also carry what real programs add (slackswap/graph.py): an alias made by a step has no
bytes of its own and holds the base copy it was made from; a recompute of a random op reads the RNG
state its run step stashed (a copy named `<op>#rng_state`) and allocates every output of the op,
the ones it does not materialise as scratch freed when it ends; a copy overwritten by an in-place
op may not be read by any later step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from slackswap.errors import GraphMismatchError, PlanValidationError
from slackswap.graph import FORWARD_PHASES, RNG_STATE_BYTES, Graph
from slackswap.plan import Decision, Direction, Plan, StepKind


@dataclass(frozen=True)
class Copy:
    """One device copy of a tensor: produced by a run step, a recompute step or a prefetch."""

    tensor: str
    size_bytes: int
    #: "run", "recompute" or "prefetch".
    source: str
    #: Step index (run/recompute) or index into `plan.prefetches` (prefetch).
    source_index: int
    #: Steps that read this copy, in order.
    readers: tuple[int, ...]
    #: Index into `plan.offloads` that copies it to the host, or None.
    offload: int | None
    #: For an alias made by a step: the copy whose storage it shares, kept alive while this one lives.
    holds: int | None = None


@dataclass(frozen=True)
class ResolvedSchedule:
    """Copies as flat parallel tuples indexed by copy id (the engine reads them in its inner loop);
    `copies` gives them as `Copy` records.

    What each step reads and writes is stored flat: all reads in one tuple (`read_copies`, step j's
    from `read_starts[j]` to `read_starts[j + 1]`), and a step's outputs are consecutive copy ids
    (`write_starts[j]` up to `write_stops[j]`). `step_reads`, `step_writes`, `copy_readers` (who reads
    a copy), `prefetch_readers` and `copy_wait_offloads` are derived on first use. Why: the simulator
    needs none of them; it frees a copy at `copy_last_use` and waits only for prefetched copies
    (`prefetched_read_steps` / `_copies`), and a tuple per step and a list per copy were most of the
    objects the walk made (the cyclic GC's passes over them cost as much again)."""

    #: Per copy: tensor name, bytes, source ("run" / "recompute" / "prefetch"), source step or
    #: prefetch index, and the offload index (or None).
    copy_tensor: tuple[str, ...]
    copy_size: tuple[int, ...]
    copy_source: tuple[str, ...]
    copy_source_index: tuple[int, ...]
    copy_offload: tuple[int | None, ...]
    #: Per copy: the copy an alias holds (or None), and the last step that reads it or any alias
    #: holding it, transitively (-1: none). With the offloads (`copy_wait_offloads`), the free rule of
    #: `schedule.memory` in the form the engine applies it.
    copy_holds: tuple[int | None, ...]
    copy_last_use: tuple[int, ...]
    #: The copies each step reads (each once, in op input order), all steps in order, and where each
    #: step's reads start (one entry more than steps): step j reads
    #: read_copies[read_starts[j]:read_starts[j + 1]].
    read_copies: tuple[int, ...]
    read_starts: tuple[int, ...]
    #: Per step: the ids of the copies it produces are write_starts[j] <= c < write_stops[j].
    write_starts: tuple[int, ...]
    write_stops: tuple[int, ...]
    #: Per step: bytes of the copies it produces (what it allocates when it starts).
    step_alloc_bytes: tuple[int, ...]
    #: Per offload: id of the copy it moves to the host.
    offload_copy: tuple[int, ...]
    #: Per prefetch: id of the copy it produces on the device.
    prefetch_copy: tuple[int, ...]
    #: Per prefetch: index into `plan.offloads` of its tensor's offload.
    prefetch_offload: tuple[int, ...]
    #: Every read of a prefetched copy (the only reads that can wait), in step order: the reading step
    #: and the copy. `prefetch_readers` is derived from them.
    prefetched_read_steps: tuple[int, ...]
    prefetched_read_copies: tuple[int, ...]
    #: Bytes each offload / prefetch moves (the tensor's size, even for an alias that owns no storage).
    offload_bytes: tuple[int, ...]
    prefetch_bytes: tuple[int, ...]

    @cached_property
    def copy_wait_offloads(self) -> tuple[tuple[int, ...], ...]:
        """Per copy: every offload it waits for before it is freed (its own, then its aliases'). An
        alias is made after the copy it holds, so one backward walk settles it."""
        waits: list[tuple[int, ...]] = [()] * len(self.copy_tensor)
        for k, c in enumerate(self.offload_copy):
            waits[c] = (k,)
        holds = self.copy_holds
        for c in reversed(range(len(waits))):
            h = holds[c]
            if h is not None:
                waits[h] = waits[h] + waits[c]
        return tuple(waits)

    @cached_property
    def prefetch_readers(self) -> tuple[tuple[int, ...], ...]:
        """Per prefetch: the steps that read its copy, in order."""
        readers: dict[int, list[int]] = {c: [] for c in self.prefetch_copy}
        for j, c in zip(self.prefetched_read_steps, self.prefetched_read_copies, strict=True):
            readers[c].append(j)
        return tuple([tuple(readers[c]) for c in self.prefetch_copy])

    @cached_property
    def step_reads(self) -> tuple[tuple[int, ...], ...]:
        """Per step: ids of the copies it reads (each once, in op input order)."""
        flat, starts = self.read_copies, self.read_starts
        return tuple([flat[a:b] for a, b in zip(starts, starts[1:], strict=False)])

    @cached_property
    def step_writes(self) -> tuple[tuple[int, ...], ...]:
        """Per step: ids of the copies it produces."""
        return tuple([tuple(range(a, b)) for a, b in zip(self.write_starts, self.write_stops, strict=True)])

    @cached_property
    def copy_readers(self) -> tuple[tuple[int, ...], ...]:
        """Per copy: the steps that read it, in order."""
        readers: list[list[int]] = [[] for _ in self.copy_tensor]
        for j, reads in enumerate(self.step_reads):
            for c in reads:
                readers[c].append(j)
        return tuple(map(tuple, readers))

    @property
    def copies(self) -> tuple[Copy, ...]:
        return tuple(
            Copy(*fields)
            for fields in zip(
                self.copy_tensor, self.copy_size, self.copy_source, self.copy_source_index, self.copy_readers,
                self.copy_offload, self.copy_holds, strict=True,
            )
        )


def validate_plan(graph: Graph, plan: Plan) -> None:
    """Raise `PlanValidationError` naming the first inconsistency; return None for a valid plan."""
    resolve_schedule(graph, plan)


def _fail(message: str) -> None:
    raise PlanValidationError(f"plan {message}")


def _step_name(plan: Plan, j: int) -> str:
    step = plan.steps[j]
    return f"step {j} ({step.kind!s} {step.op!r})"


def _check_steps(graph: Graph, plan: Plan) -> list[int]:
    """Steps name real ops, carry consistent outputs, and every op runs exactly once.

    Returns each step's role for `_check_reader_copies`: 0 recompute, 1 forward run, 2 other run."""
    if not plan.steps:
        _fail("has no compute steps")
    _, _, _, op_by_name, forward_ops, _ = _graph_tables(graph)
    run, recompute = StepKind.RUN, StepKind.RECOMPUTE
    run_step: dict[str, int] = {}
    roles: list[int] = []
    for j, step in enumerate(plan.steps):
        name = step.op
        op = op_by_name.get(name)
        if op is None:
            _fail(f"step {j} names op {name!r}, which is not in graph {graph.name!r}")
        kind = step.kind
        if kind == run:
            outputs = step.outputs
            if outputs is not op.outputs and outputs != op.outputs and tuple(outputs) != tuple(op.outputs):
                _fail(
                    f"step {j} runs op {name!r} with outputs {list(step.outputs)}; "
                    f"a run step materialises all of the op's outputs {list(op.outputs)}"
                )
            if name in run_step:
                _fail(f"op {name!r} is run twice (steps {run_step[name]} and {j})")
            run_step[name] = j
            roles.append(1 if name in forward_ops else 2)
        elif kind == recompute:
            if name not in forward_ops:
                _fail(f"step {j} recomputes op {name!r} of phase {op.phase.value!r}; only forward ops are recomputed")
            if name not in run_step:
                _fail(f"step {j} recomputes op {name!r} before its run step")
            if not step.outputs:
                _fail(f"step {j} recomputes op {name!r} but materialises no outputs")
            if len(set(step.outputs)) != len(step.outputs):
                _fail(f"step {j} recomputes op {name!r} with duplicate outputs {list(step.outputs)}")
            for t in step.outputs:
                if t not in op.outputs:
                    _fail(f"step {j} recomputes op {name!r} with output {t!r}, which that op does not produce")
            roles.append(0)
        else:
            _fail(f"step {j} ({name!r}) has unknown kind {kind!r}")
    if len(run_step) != len(graph.ops):
        for op in graph.ops:
            if op.name not in run_step:
                _fail(f"never runs op {op.name!r}")
    return roles


def _check_decisions(graph: Graph, plan: Plan) -> None:
    saved = _graph_tables(graph)[5]
    decisions = plan.decisions
    try:
        if decisions.keys() == saved and set(decisions.values()) <= _DECISIONS:
            return  # one decision per saved tensor, each keep/swap/recompute: set operations in C
    except TypeError:
        pass  # an unhashable decision: the loops below name it
    for t in graph.saved_tensors:
        if t.name not in plan.decisions:
            _fail(f"has no decision (keep/swap/recompute) for saved tensor {t.name!r}")
    candidates = graph.candidate_names
    for name, decision in plan.decisions.items():
        if name not in saved and name not in candidates:
            _fail(f"decides {decision!r} for tensor {name!r}, which is neither a saved tensor nor a "
                  "checkpoint candidate of the graph")
        if decision not in (Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE):
            _fail(f"decision for tensor {name!r} is {decision!r}, not keep/swap/recompute")
        if name not in saved and decision == Decision.RECOMPUTE:
            _fail(f"decides recompute for checkpoint candidate {name!r}; a candidate is kept or swapped, "
                  "or has no decision")


_DECISIONS = frozenset(Decision)


def _check_transfers(graph: Graph, plan: Plan) -> tuple[dict[str, int], dict[str, int]]:
    """Directions, ranges and one offload + one prefetch per swapped tensor. Returns tensor -> index maps."""
    n = len(plan.steps)
    by_tensor: list[dict[str, int]] = [{}, {}]
    tensors = _graph_tables(graph)[1]  # tensor name -> bytes: the graph's tensors
    decision_of = plan.decisions.get
    swap = Decision.SWAP
    for which, (label, transfers, direction) in enumerate(
        (("offload", plan.offloads, Direction.D2H), ("prefetch", plan.prefetches, Direction.H2D))
    ):
        seen = by_tensor[which]
        for k, tr in enumerate(transfers):
            t = tr.tensor
            if tr.direction != direction:
                _fail(
                    f"{label} {k} of tensor {t!r} has direction {tr.direction!r}; "
                    f"{label}s are {direction.value}"
                )
            if t not in tensors:
                _fail(f"{label} {k} moves tensor {t!r}, which is not in the graph")
            issue = tr.issue_after_step
            if not isinstance(issue, int) or not -1 <= issue < n:
                _fail(
                    f"{label} {k} of tensor {t!r} has issue_after_step={issue!r}; "
                    f"must be an integer in [-1, {n - 1}]"
                )
            if decision_of(t) != swap:
                _fail(f"{label}s tensor {t!r}, whose decision is {plan.decisions.get(t, 'none')!s}, not swap")
            if t in seen:
                _fail(f"{label}s tensor {t!r} twice ({label}s {seen[t]} and {k})")
            seen[t] = k
    offload_of, prefetch_of = by_tensor
    for t in plan.tensors_with(Decision.SWAP):
        if t not in offload_of:
            _fail(f"swaps tensor {t!r} but has no offload for it")
        if t not in prefetch_of:
            _fail(f"swaps tensor {t!r} but has no prefetch for it")
        off = plan.offloads[offload_of[t]].issue_after_step
        pre = plan.prefetches[prefetch_of[t]].issue_after_step
        if pre < off:
            _fail(f"prefetches tensor {t!r} after step {pre}, before its offload is issued (after step {off})")
    return offload_of, prefetch_of


def resolve_schedule(graph: Graph, plan: Plan) -> ResolvedSchedule:
    """Validate `plan` against `graph` and resolve the copy each step reads. Raises `PlanValidationError`
    (`GraphMismatchError` when the plan was made for another graph).

    The rules that need no copies are checked first, then `_resolve_copies` walks the plan, then the
    rules about which copy each reader reads and the FIFO order are checked on the result."""
    if plan.graph_fingerprint and plan.graph_fingerprint != graph.fingerprint:
        raise GraphMismatchError(
            f"plan of planner {plan.planner!r} was made for a graph with fingerprint {plan.graph_fingerprint}, "
            f"not for graph {graph.name!r} (fingerprint {graph.fingerprint})"
        )
    roles = _check_steps(graph, plan)
    _check_decisions(graph, plan)
    offload_of, _ = _check_transfers(graph, plan)
    s = _resolve_copies(graph, plan, offload_of)
    _check_reader_copies(plan, roles, s.copy_tensor, s.copy_source, s.read_copies, s.read_starts)
    _check_fifo_order(plan, s.prefetch_offload, s.prefetch_readers)
    return s


def _walk_tables(graph: Graph) -> tuple[dict[str, tuple[str, ...]], dict[str, int], dict[str, str]]:
    """(op -> distinct inputs, tensor -> bytes, tensor -> base ("" when it owns its storage)) as plain
    dicts, cached on the graph (derived data of a frozen object, like its cached properties): the walk
    looks them up for every step of every plan."""
    return _graph_tables(graph)[:3]


def _graph_tables(graph: Graph) -> tuple:
    """`_walk_tables`, then what the checks look up per step or tensor: op name -> Op (a plain dict),
    the names of the forward ops, and the names of the saved tensors (frozensets)."""
    cached = graph.__dict__.get("_validate_tables")
    if cached is None:
        cached = (
            dict(graph.distinct_inputs),
            dict(graph.size_bytes_of),
            {name: t.base for name, t in graph.tensors.items()},
            dict(graph.op_by_name),
            frozenset(op.name for op in graph.ops if op.phase in FORWARD_PHASES),
            frozenset(t.name for t in graph.saved_tensors),
        )
        graph.__dict__["_validate_tables"] = cached
    return cached


def _resolve_copies(graph: Graph, plan: Plan, offload_of: dict[str, int]) -> ResolvedSchedule:
    """One walk in sequence order over flat lists (no object per copy). It fails only where a copy
    cannot be resolved (a read or an offload of a tensor with no device copy, an offload of a
    non-run copy, a recompute of a keep/swap tensor); the other rules are checked around it. The
    simulator runs it for every plan, so it is written for speed like the engine's loop, and
    `benchmarks/bench_simulate.py` times it with the engine against the SimPy peer's own resolution.
    Reads and outputs are handled inline (a read of a tensor with no copy falls back to `_unreadable`,
    which names the first bad input); reads are appended to one flat list, a step's outputs get
    consecutive ids; no list per copy is kept (a copy's readers are only recorded as its last use, and
    for prefetched copies); and what only real programs have (views, in-place writes, RNG states of
    recomputed random ops) costs a flag test per step on the analytic graphs."""
    decisions = plan.decisions
    inputs_of, size_of, base_of = _walk_tables(graph)
    steps = plan.steps

    # Each transfer list in the order of the steps that issue them (list order among one step's), with
    # a sentinel issue step no step reaches; `next_issue` is the first step after which one is issued.
    # `_check_transfers` has checked every issue step is in [-1, len(steps) - 1].
    off_issue = [tr.issue_after_step for tr in plan.offloads]
    pre_issue = [tr.issue_after_step for tr in plan.prefetches]
    off_queue = sorted(range(len(off_issue)), key=off_issue.__getitem__)
    pre_queue = sorted(range(len(pre_issue)), key=pre_issue.__getitem__)
    off_issue.append(len(steps))
    pre_issue.append(len(steps))
    off_queue.append(len(off_queue))
    pre_queue.append(len(pre_queue))
    off_next = pre_next = 0  # positions in the queues

    c_tensor: list[str] = []
    c_source: list[str] = []
    c_index: list[int] = []
    c_size: list[int] = []
    c_holds: list[int | None] = []  # filled only when the graph has aliases; all None otherwise
    last_use: list[int] = []  # per copy: the last step that reads it (-1: none)
    prefetched: set[int] = set()  # the prefetched copies
    prefetched_read_steps: list[int] = []
    prefetched_read_copies: list[int] = []
    current: dict[str, int] = {}
    op_by_name = graph.op_by_name
    has_aliases = graph.has_aliases
    overwritten: dict[int, str] = {}  # copy -> the in-place op that overwrote it
    random_recomputed = {s.op for s in steps if s.kind == StepKind.RECOMPUTE and op_by_name[s.op].random}
    rng_state: dict[str, int] = {}  # random op -> the copy of its stashed RNG state
    offload_copy = [0] * len(plan.offloads)
    prefetch_copy = [0] * len(plan.prefetches)
    read_copies: list[int] = []
    read_starts: list[int] = [0]
    write_starts: list[int] = []
    write_stops: list[int] = []
    step_alloc: list[int] = []

    def issue_transfers(after: int) -> int:
        """Resolve the transfers issued after step `after`; return the next step that issues one."""
        nonlocal off_next, pre_next
        where = "at time zero" if after < 0 else f"after step {after}"
        while off_issue[off_queue[off_next]] == after:
            k = off_queue[off_next]
            off_next += 1
            t = plan.offloads[k].tensor
            c = current.get(t)
            if c is None:
                _fail(f"offloads tensor {t!r} {where}, before any step has produced it")
            if c_source[c] != "run":
                _fail(
                    f"offloads tensor {t!r} {where} from its {c_source[c]} copy; "
                    "a swap offloads the copy its run step produced"
                )
            offload_copy[k] = c
        while pre_issue[pre_queue[pre_next]] == after:
            k = pre_queue[pre_next]
            pre_next += 1
            t = plan.prefetches[k].tensor
            prefetch_copy[k] = current[t] = len(c_tensor)
            c_tensor.append(t)
            c_source.append("prefetch")
            c_index.append(k)
            c_size.append(size_of[t])
            last_use.append(-1)
            prefetched.add(prefetch_copy[k])
            if has_aliases:
                c_holds.append(None)
        return min(off_issue[off_queue[off_next]], pre_issue[pre_queue[pre_next]])

    def new_copy(t: str, source: str, j: int, size: int, holds: int | None) -> int:
        """A copy made by step j that is not the tensor's current copy (RNG state, scratch outputs)."""
        c = len(c_tensor)
        c_tensor.append(t)
        c_source.append(source)
        c_index.append(j)
        c_size.append(size)
        last_use.append(-1)
        if has_aliases:
            c_holds.append(holds)
        return c

    next_issue = issue_transfers(-1)
    recompute = StepKind.RECOMPUTE
    keep_or_swap = (Decision.KEEP, Decision.SWAP)
    for j, step in enumerate(steps):
        name = step.op
        inputs = inputs_of[name]
        try:
            for t in inputs:
                c = current[t]
                read_copies.append(c)
                last_use[c] = j
                if c in prefetched:
                    prefetched_read_steps.append(j)
                    prefetched_read_copies.append(c)
        except KeyError:
            _unreadable(plan, j, inputs, current, overwritten)
        if overwritten:
            for c in read_copies[read_starts[j]:]:
                if c in overwritten:
                    _unreadable(plan, j, inputs, current, overwritten)
        source = "recompute" if step.kind == recompute else "run"
        write_starts.append(len(c_tensor))
        alloc = 0
        for t in step.outputs:
            if source == "recompute" and decisions.get(t) in keep_or_swap:
                _fail(f"{_step_name(plan, j)} recomputes tensor {t!r}, whose decision is {decisions[t]!s}")
            c = current[t] = len(c_tensor)
            if has_aliases:
                # An alias (a view) owns no bytes and holds the base copy the step read.
                base = base_of[t]
                size = 0 if base else size_of[t]
                c_holds.append(current[base] if base else None)
            else:
                size = size_of[t]
            c_tensor.append(t)
            c_source.append(source)
            c_index.append(j)
            c_size.append(size)
            last_use.append(-1)
            alloc += size
        if random_recomputed and name in random_recomputed:
            op = op_by_name[name]
            if source == "recompute":
                # The replayed kernel reads the stashed RNG state and writes every output again; the
                # ones this step does not materialise are scratch, freed when it ends.
                c = rng_state[name]
                last_use[c] = j
                read_copies.append(c)
                for t in op.outputs:
                    if t not in step.outputs:
                        base = base_of[t] if has_aliases else ""
                        size = 0 if base else size_of[t]
                        new_copy(t, source, j, size, current[base] if base else None)
                        alloc += size
            else:
                rng_state[name] = new_copy(f"{name}#rng_state", "run", j, RNG_STATE_BYTES, None)
                alloc += RNG_STATE_BYTES
        if has_aliases and source == "run":
            for t in op_by_name[name].writes:
                overwritten[read_copies[read_starts[j] + inputs.index(t)]] = name
        read_starts.append(len(read_copies))
        write_stops.append(len(c_tensor))
        step_alloc.append(alloc)
        if j == next_issue:
            next_issue = issue_transfers(j)
    n_copies = len(c_tensor)
    if not has_aliases:
        c_holds = [None] * n_copies
    c_offload: list[int | None] = [None] * n_copies
    for k, c in enumerate(offload_copy):
        c_offload[c] = k

    prefetch_offload = tuple([offload_of[tr.tensor] for tr in plan.prefetches])

    # The free rule with aliases: a copy lives until its last reader, its offload and every alias
    # holding it are done (the offloads: `copy_wait_offloads`). An alias is made after the copy it
    # holds, so one backward walk settles the last use.
    if has_aliases:
        for c in reversed(range(n_copies)):
            h = c_holds[c]
            if h is not None:
                last_use[h] = max(last_use[h], last_use[c])

    return ResolvedSchedule(
        copy_tensor=tuple(c_tensor),
        copy_size=tuple(c_size),
        copy_source=tuple(c_source),
        copy_source_index=tuple(c_index),
        copy_offload=tuple(c_offload),
        copy_holds=tuple(c_holds),
        copy_last_use=tuple(last_use),
        read_copies=tuple(read_copies),
        read_starts=tuple(read_starts),
        write_starts=tuple(write_starts),
        write_stops=tuple(write_stops),
        step_alloc_bytes=tuple(step_alloc),
        offload_copy=tuple(offload_copy),
        prefetch_copy=tuple(prefetch_copy),
        prefetch_offload=prefetch_offload,
        prefetched_read_steps=tuple(prefetched_read_steps),
        prefetched_read_copies=tuple(prefetched_read_copies),
        offload_bytes=tuple([size_of[tr.tensor] for tr in plan.offloads]),
        prefetch_bytes=tuple([size_of[tr.tensor] for tr in plan.prefetches]),
    )


def _unreadable(
    plan: Plan, j: int, inputs: tuple[str, ...], current: dict[str, int], overwritten: dict[int, str]
) -> None:
    """Name the first input step j cannot read, in input order (the walk's fast path only knows that
    one of them failed)."""
    for t in inputs:
        c = current.get(t)
        if c is None:
            _fail(f"{_step_name(plan, j)} reads tensor {t!r}, which has no device copy at that point")
        if c in overwritten:
            _fail(f"{_step_name(plan, j)} reads tensor {t!r} after op {overwritten[c]!r} overwrote it in place")
    raise AssertionError("unreachable: every input of the step is readable")


def _check_reader_copies(
    plan: Plan, roles: list[int], c_tensor: Sequence[str], c_source: Sequence[str],
    read_copies: Sequence[int], read_starts: Sequence[int],
) -> None:
    """Each decision fixes which copy the forward and backward readers of a saved tensor read.

    Names the first problem in step order (the lowest copy id among one step's problems)."""
    wanted = {Decision.KEEP: "run", Decision.SWAP: "prefetch", Decision.RECOMPUTE: "recompute"}
    decisions = plan.decisions
    for j, role in enumerate(roles):
        if role == 0:
            continue  # a recompute step may read any resident copy
        forward = role == 1
        problem = None
        if forward:  # needs the run copy of every decided tensor: a run copy needs no lookup
            for c in read_copies[read_starts[j]:read_starts[j + 1]]:
                if c_source[c] != "run" and decisions.get(c_tensor[c]) is not None and (problem is None or c < problem):
                    problem = c
        else:
            for c in read_copies[read_starts[j]:read_starts[j + 1]]:
                decision = decisions.get(c_tensor[c])
                if decision is not None and c_source[c] != wanted[decision] and (problem is None or c < problem):
                    problem = c
        if problem is not None:
            c = problem
            t = c_tensor[c]
            decision = decisions[t]
            source = c_source[c]
            need = "run" if forward else wanted[decision]
            role_name = "forward" if forward else "backward"
            if decision == Decision.SWAP and forward:
                why = "its prefetch is issued before this forward reader"
            elif decision == Decision.SWAP:
                why = "its prefetch is issued after this backward reader (or it reads a recomputed copy)"
            elif decision == Decision.RECOMPUTE and not forward:
                why = "no recompute step materialises it between its forward use and this reader"
            else:
                why = f"a {source} copy exists where the {need} copy is required"
            _fail(
                f"{_step_name(plan, j)}, a {role_name} reader of {decision!s} tensor {t!r}, "
                f"reads its {source} copy: {why}"
            )


def _check_fifo_order(
    plan: Plan, prefetch_offload: Sequence[int], prefetch_readers: Sequence[Sequence[int]]
) -> None:
    """A transfer starts no earlier than the one before it in its FIFO list, and a prefetch no earlier
    than its offload. If that pushes a prefetch past its first reader, the plan deadlocks by construction."""
    off_effective: list[int] = []
    last = -1
    for tr in plan.offloads:
        last = max(last, tr.issue_after_step)
        off_effective.append(last)
    last = -1
    for k, tr in enumerate(plan.prefetches):
        last = max(last, tr.issue_after_step, off_effective[prefetch_offload[k]])
        readers = prefetch_readers[k]
        if readers and readers[0] <= last:
            _fail(
                f"prefetch {k} of tensor {tr.tensor!r} cannot start before step {last} finishes "
                f"(FIFO order of the offload/prefetch lists), but {_step_name(plan, readers[0])} reads it: "
                "the schedule would deadlock"
            )
