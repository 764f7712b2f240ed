"""The copy resolver: which device copy of a tensor each plan step reads, and when each copy dies.

`resolve_copies` walks a plan in sequence order once and records every device copy of a tensor
(made by a run step, a recompute step or a prefetch): who reads it, the offload that moves it, the
copy an alias holds, and when its storage can really be freed. Those facts are the single input of
every executor's free rule: the simulator's engine (`slackswap.simulate.engine`), the planners'
replay (`schedule.replay`), the allocator replay (`slackswap.memory.allocator_replay`) and the runtime
(`slackswap.runtime`). None of them re-derives when a storage dies. The rules a plan must satisfy
are checked around the walk in `schedule.validate` (`resolve_schedule` is the entry point).

Sequence positions: step j sits at position j; a transfer with `issue_after_step = i` sits between
step i and step i + 1 (offloads before prefetches, each list in plan order); i = -1 is before step 0.

The copies also carry what real programs add (slackswap/graph.py): an alias made by a step has no
bytes of its own and holds the base copy it was made from, so the base's storage lives while any
alias of it is read; a recompute of a random op reads the RNG state its run step stashed (a copy
named `<op>#rng_state`) and allocates every output of the op, the ones it does not materialise as
scratch freed when it ends; a copy overwritten by an in-place op may not be read by any later step;
a run copy of a tensor the model's own code still references (`Tensor.held_until`) lives until
the run step of that op has finished.

The free rule (docs/simulation.md section 2): a copy is freed once it has been produced, the step
`copy_last_use` names has finished (the last step reading it or an alias holding it, or holding it
for the model's code; -1: none), and every offload in `copy_wait_offloads` has finished (its own and
its aliases'). At one instant frees happen before allocations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from slackswap.errors import PlanValidationError
from slackswap.graph import FORWARD_PHASES, RNG_STATE_BYTES, Graph, GraphMemo
from slackswap.plan import Decision, Plan, StepKind


@dataclass(frozen=True)
class Copy:
    """One device copy of a tensor: produced by a run step, a recompute step or a prefetch, with the
    facts of its free rule (module docstring)."""

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
    #: The step after which the compute stream releases it: its last reader, the last use of any
    #: alias holding it, or the step the model's code holds it to, whichever is latest (-1: none).
    last_use: int = -1
    #: The offloads that must finish before it is freed: its own, then its aliases'.
    wait_offloads: tuple[int, ...] = ()


@dataclass(frozen=True)
class ResolvedSchedule:
    """The resolved plan: every device copy, what each step reads and writes, and the free rule's inputs.

    Copies are stored as flat parallel tuples indexed by copy id (the engine reads them in its inner
    loop). What each step reads and writes is stored flat: all reads in one tuple (`read_copies`,
    step j's from `read_starts[j]` to `read_starts[j + 1]`), and a step's outputs are consecutive copy
    ids (`write_starts[j]` up to `write_stops[j]`). The rest is derived once, on first use, and kept
    (`cached_property`: a second access returns the same object, O(1)): `copies` (one `Copy` record
    per copy), `step_reads`, `step_writes`, `copy_readers`, `prefetch_readers`, `copy_wait_offloads`,
    `offload_waiters` and `released_after`. Why lazily: the simulator needs only the last three of
    them, and a tuple per step and a record per copy were most of the objects the walk made (the
    cyclic GC's passes over them cost as much again)."""

    #: Per copy: tensor name, bytes, source ("run" / "recompute" / "prefetch"), source step or
    #: prefetch index, and the offload index (or None).
    copy_tensor: tuple[str, ...]
    copy_size: tuple[int, ...]
    copy_source: tuple[str, ...]
    copy_source_index: tuple[int, ...]
    copy_offload: tuple[int | None, ...]
    #: Per copy: the copy an alias holds (or None), and the step after which the compute stream
    #: releases it: the last step that reads it or any alias holding it, transitively, or that the
    #: model's code holds it to (-1: none). With the offloads (`copy_wait_offloads`), the free rule
    #: (module docstring) in the form every executor applies it.
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
    #: Whether some copy's last use is later than its own last reader (an alias holds it, or the
    #: model's code does): only then can a step release a copy it does not read.
    extended_last_use: bool = False

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

    @cached_property
    def offload_waiters(self) -> tuple[tuple[int, ...], ...]:
        """Per offload: the copies that wait for it before they are freed (the copy it moves and every
        copy up its `copy_holds` chain), in copy order. The inverse of `copy_wait_offloads`."""
        holds = self.copy_holds
        waiters: list[tuple[int, ...]] = []
        for c in self.offload_copy:
            chain: list[int] = []
            while c is not None:
                chain.append(c)
                c = holds[c]
            chain.reverse()
            waiters.append(tuple(chain))
        return tuple(waiters)

    @cached_property
    def released_after(self) -> tuple[tuple[int, ...], ...]:
        """Per step j: the copies whose last use is step j although j does not read them (a base an
        alias read by j kept alive, a run copy the model's code held until j), in copy order, then the
        copies made by step j that nobody reads (released when j ends), in copy order.

        With the copies step j reads whose `copy_last_use` is j, these are all the copies the compute
        stream releases when step j ends (freed then, or when their offloads finish)."""
        n_steps = len(self.write_starts)
        last_use, read_copies, read_starts = self.copy_last_use, self.read_copies, self.read_starts
        released: list[tuple[int, ...]] = [()] * n_steps
        if self.extended_last_use:
            for c, j in enumerate(last_use):
                if j >= 0 and c not in read_copies[read_starts[j]:read_starts[j + 1]]:
                    released[j] += (c,)
        source, step_of = self.copy_source, self.copy_source_index
        c = -1
        try:
            while True:
                c = last_use.index(-1, c + 1)  # scans in C; copies nobody reads are few
                if source[c] != "prefetch":  # a prefetched copy nobody reads is freed when it lands
                    released[step_of[c]] += (c,)
        except ValueError:
            pass
        return tuple(released)

    @cached_property
    def copies(self) -> tuple[Copy, ...]:
        """One `Copy` record per copy id, built once."""
        return tuple(
            Copy(*fields)
            for fields in zip(
                self.copy_tensor, self.copy_size, self.copy_source, self.copy_source_index, self.copy_readers,
                self.copy_offload, self.copy_holds, self.copy_last_use, self.copy_wait_offloads, strict=True,
            )
        )


def fail(message: str) -> None:
    raise PlanValidationError(f"plan {message}")


def step_name(plan: Plan, j: int) -> str:
    step = plan.steps[j]
    return f"step {j} ({step.kind!s} {step.op!r})"


def _walk_tables(graph: Graph) -> tuple[dict[str, tuple[str, ...]], dict[str, int], dict[str, str]]:
    """(op -> distinct inputs, tensor -> bytes, tensor -> base ("" when it owns its storage)) as plain
    dicts, computed once per graph (`graph_tables`): the walk looks them up for every step of every plan."""
    return graph_tables(graph)[:3]


def _build_graph_tables(graph: Graph) -> tuple:
    return (
        dict(graph.distinct_inputs),
        dict(graph.size_bytes_of),
        {name: t.base for name, t in graph.tensors.items()},
        dict(graph.op_by_name),
        frozenset(op.name for op in graph.ops if op.phase in FORWARD_PHASES),
        frozenset(t.name for t in graph.saved_tensors),
    )


#: `_walk_tables`, then what the checks look up per step or tensor: op name -> Op (a plain dict), the
#: names of the forward ops, and the names of the saved tensors (frozensets); once per graph.
graph_tables: GraphMemo[tuple] = GraphMemo(_build_graph_tables)


def resolve_copies(graph: Graph, plan: Plan, offload_of: dict[str, int]) -> ResolvedSchedule:
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
                fail(f"offloads tensor {t!r} {where}, before any step has produced it")
            if c_source[c] != "run":
                fail(
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
                fail(f"{step_name(plan, j)} recomputes tensor {t!r}, whose decision is {decisions[t]!s}")
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

    # The model's own references: a run copy of a tensor the model's code holds lives until the run
    # step of the op after which the code drops it (before the alias walk, so a held view keeps its
    # base's storage too).
    has_holds = graph.has_holds
    if has_holds:
        held_until = {name: t.held_until for name, t in graph.tensors.items() if t.held_until}
        run_step_of = {st.op: i for i, st in enumerate(steps) if st.kind != recompute}
        for c in range(n_copies):
            hold = held_until.get(c_tensor[c])
            if hold is not None and c_source[c] == "run":
                last_use[c] = max(last_use[c], run_step_of[hold])

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
        extended_last_use=has_aliases or has_holds,
    )


def _unreadable(
    plan: Plan, j: int, inputs: tuple[str, ...], current: dict[str, int], overwritten: dict[int, str]
) -> None:
    """Name the first input step j cannot read, in input order (the walk's fast path only knows that
    one of them failed)."""
    for t in inputs:
        c = current.get(t)
        if c is None:
            fail(f"{step_name(plan, j)} reads tensor {t!r}, which has no device copy at that point")
        if c in overwritten:
            fail(f"{step_name(plan, j)} reads tensor {t!r} after op {overwritten[c]!r} overwrote it in place")
    raise AssertionError("unreachable: every input of the step is readable")


