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

from dataclasses import dataclass

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
    copies: tuple[Copy, ...]
    #: Per step: ids of the copies it reads (each once, in op input order).
    step_reads: tuple[tuple[int, ...], ...]
    #: Per step: ids of the copies it produces.
    step_writes: tuple[tuple[int, ...], ...]
    #: Per offload: id of the copy it moves to the host.
    offload_copy: tuple[int, ...]
    #: Per prefetch: id of the copy it produces on the device.
    prefetch_copy: tuple[int, ...]
    #: Per prefetch: index into `plan.offloads` of its tensor's offload.
    prefetch_offload: tuple[int, ...]
    #: Bytes each offload / prefetch moves (the tensor's size, even for an alias that owns no storage).
    offload_bytes: tuple[int, ...] = ()
    prefetch_bytes: tuple[int, ...] = ()


def validate_plan(graph: Graph, plan: Plan) -> None:
    """Raise `PlanValidationError` naming the first inconsistency; return None for a valid plan."""
    resolve_schedule(graph, plan)


def _fail(message: str) -> None:
    raise PlanValidationError(f"plan {message}")


def _step_name(plan: Plan, j: int) -> str:
    step = plan.steps[j]
    return f"step {j} ({step.kind!s} {step.op!r})"


def _check_steps(graph: Graph, plan: Plan) -> dict[str, int]:
    """Steps name real ops, carry consistent outputs, and every op runs exactly once. Returns op -> run step."""
    if not plan.steps:
        _fail("has no compute steps")
    run_step: dict[str, int] = {}
    for j, step in enumerate(plan.steps):
        op = graph.op_by_name.get(step.op)
        if op is None:
            _fail(f"step {j} names op {step.op!r}, which is not in graph {graph.name!r}")
        if step.kind not in (StepKind.RUN, StepKind.RECOMPUTE):
            _fail(f"step {j} ({step.op!r}) has unknown kind {step.kind!r}")
        if step.kind == StepKind.RUN:
            if tuple(step.outputs) != tuple(op.outputs):
                _fail(
                    f"step {j} runs op {op.name!r} with outputs {list(step.outputs)}; "
                    f"a run step materialises all of the op's outputs {list(op.outputs)}"
                )
            if op.name in run_step:
                _fail(f"op {op.name!r} is run twice (steps {run_step[op.name]} and {j})")
            run_step[op.name] = j
        else:
            if op.phase not in FORWARD_PHASES:
                _fail(
                    f"step {j} recomputes op {op.name!r} of phase {op.phase.value!r}; only forward ops are recomputed"
                )
            if op.name not in run_step:
                _fail(f"step {j} recomputes op {op.name!r} before its run step")
            if not step.outputs:
                _fail(f"step {j} recomputes op {op.name!r} but materialises no outputs")
            if len(set(step.outputs)) != len(step.outputs):
                _fail(f"step {j} recomputes op {op.name!r} with duplicate outputs {list(step.outputs)}")
            for t in step.outputs:
                if t not in op.outputs:
                    _fail(f"step {j} recomputes op {op.name!r} with output {t!r}, which that op does not produce")
    for op in graph.ops:
        if op.name not in run_step:
            _fail(f"never runs op {op.name!r}")
    return run_step


def _check_decisions(graph: Graph, plan: Plan) -> None:
    saved = {t.name for t in graph.saved_tensors}
    for t in graph.saved_tensors:
        if t.name not in plan.decisions:
            _fail(f"has no decision (keep/swap/recompute) for saved tensor {t.name!r}")
    for name, decision in plan.decisions.items():
        if name not in saved:
            _fail(f"decides {decision!r} for tensor {name!r}, which is not a saved tensor of the graph")
        if decision not in (Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE):
            _fail(f"decision for tensor {name!r} is {decision!r}, not keep/swap/recompute")


def _check_transfers(graph: Graph, plan: Plan) -> tuple[dict[str, int], dict[str, int]]:
    """Directions, ranges and one offload + one prefetch per swapped tensor. Returns tensor -> index maps."""
    n = len(plan.steps)
    by_tensor: list[dict[str, int]] = [{}, {}]
    for which, (label, transfers, direction) in enumerate(
        (("offload", plan.offloads, Direction.D2H), ("prefetch", plan.prefetches, Direction.H2D))
    ):
        for k, tr in enumerate(transfers):
            if tr.direction != direction:
                _fail(
                    f"{label} {k} of tensor {tr.tensor!r} has direction {tr.direction!r}; "
                    f"{label}s are {direction.value}"
                )
            if tr.tensor not in graph.tensors:
                _fail(f"{label} {k} moves tensor {tr.tensor!r}, which is not in the graph")
            if not isinstance(tr.issue_after_step, int) or not -1 <= tr.issue_after_step < n:
                _fail(
                    f"{label} {k} of tensor {tr.tensor!r} has issue_after_step={tr.issue_after_step!r}; "
                    f"must be an integer in [-1, {n - 1}]"
                )
            if plan.decisions.get(tr.tensor) != Decision.SWAP:
                _fail(
                    f"{label}s tensor {tr.tensor!r}, whose decision is "
                    f"{plan.decisions.get(tr.tensor, 'none')!s}, not swap"
                )
            if tr.tensor in by_tensor[which]:
                _fail(f"{label}s tensor {tr.tensor!r} twice ({label}s {by_tensor[which][tr.tensor]} and {k})")
            by_tensor[which][tr.tensor] = k
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
    (`GraphMismatchError` when the plan was made for another graph)."""
    if plan.graph_fingerprint and plan.graph_fingerprint != graph.fingerprint:
        raise GraphMismatchError(
            f"plan of planner {plan.planner!r} was made for a graph with fingerprint {plan.graph_fingerprint}, "
            f"not for graph {graph.name!r} (fingerprint {graph.fingerprint})"
        )
    _check_steps(graph, plan)
    _check_decisions(graph, plan)
    offload_of, _ = _check_transfers(graph, plan)
    n = len(plan.steps)
    tensors = graph.tensors
    decisions = plan.decisions

    # Transfers bucketed by the position they are issued at (index 0 = before step 0).
    offloads_at: list[list[int]] = [[] for _ in range(n + 1)]
    prefetches_at: list[list[int]] = [[] for _ in range(n + 1)]
    for k, tr in enumerate(plan.offloads):
        offloads_at[tr.issue_after_step + 1].append(k)
    for k, tr in enumerate(plan.prefetches):
        prefetches_at[tr.issue_after_step + 1].append(k)

    c_tensor: list[str] = []
    c_source: list[str] = []
    c_index: list[int] = []
    c_readers: list[list[int]] = []
    c_offload: list[int | None] = []
    c_size: list[int] = []
    c_holds: list[int | None] = []
    current: dict[str, int] = {}
    overwritten: dict[int, str] = {}  # copy -> the in-place op that overwrote it
    recomputed_ops = {s.op for s in plan.steps if s.kind == StepKind.RECOMPUTE}
    rng_state: dict[str, int] = {}  # random op -> the copy of its stashed RNG state
    offload_copy = [0] * len(plan.offloads)
    prefetch_copy = [0] * len(plan.prefetches)
    step_reads: list[tuple[int, ...]] = []
    step_writes: list[tuple[int, ...]] = []

    def new_copy(
        t: str, source: str, index: int, size: int, holds: int | None = None, current_copy: bool = True
    ) -> int:
        c_tensor.append(t)
        c_source.append(source)
        c_index.append(index)
        c_readers.append([])
        c_offload.append(None)
        c_size.append(size)
        c_holds.append(holds)
        if current_copy:
            current[t] = len(c_tensor) - 1
        return len(c_tensor) - 1

    def step_copy(t: str, kind: str, j: int, current_copy: bool = True) -> int:
        """A copy made by step j: an alias owns no bytes and holds the base copy the step read."""
        base = tensors[t].base
        if base:
            return new_copy(t, kind, j, 0, holds=current[base], current_copy=current_copy)
        return new_copy(t, kind, j, tensors[t].size_bytes, current_copy=current_copy)

    def issue_transfers(bucket: int) -> None:
        where = "at time zero" if bucket == 0 else f"after step {bucket - 1}"
        for k in offloads_at[bucket]:
            t = plan.offloads[k].tensor
            c = current.get(t)
            if c is None:
                _fail(f"offloads tensor {t!r} {where}, before any step has produced it")
            if c_source[c] != "run":
                _fail(
                    f"offloads tensor {t!r} {where} from its {c_source[c]} copy; "
                    "a swap offloads the copy its run step produced"
                )
            c_offload[c] = k
            offload_copy[k] = c
        for k in prefetches_at[bucket]:
            t = plan.prefetches[k].tensor
            prefetch_copy[k] = new_copy(t, "prefetch", k, tensors[t].size_bytes)

    issue_transfers(0)
    for j, step in enumerate(plan.steps):
        op = graph.op_by_name[step.op]
        reads = []
        for t in dict.fromkeys(op.inputs):
            c = current.get(t)
            if c is None:
                _fail(f"{_step_name(plan, j)} reads tensor {t!r}, which has no device copy at that point")
            if c in overwritten:
                _fail(f"{_step_name(plan, j)} reads tensor {t!r} after op {overwritten[c]!r} overwrote it in place")
            c_readers[c].append(j)
            reads.append(c)
        if op.random and step.kind == StepKind.RECOMPUTE:
            c = rng_state[op.name]
            c_readers[c].append(j)
            reads.append(c)
        writes = []
        for t in step.outputs:
            if step.kind == StepKind.RECOMPUTE:
                decision = decisions.get(t)
                if decision is not None and decision != Decision.RECOMPUTE:
                    _fail(f"{_step_name(plan, j)} recomputes tensor {t!r}, whose decision is {decision!s}")
            writes.append(step_copy(t, str(step.kind), j))
        if op.random and step.kind == StepKind.RECOMPUTE:
            # The replayed kernel writes every output; the ones not materialised are scratch.
            writes.extend(step_copy(t, "recompute", j, current_copy=False) for t in op.outputs if t not in step.outputs)
        if op.random and step.kind == StepKind.RUN and op.name in recomputed_ops:
            rng_state[op.name] = new_copy(f"{op.name}#rng_state", "run", j, RNG_STATE_BYTES, current_copy=False)
            writes.append(rng_state[op.name])
        if step.kind == StepKind.RUN:
            for t in op.writes:
                overwritten[current[t]] = op.name
        step_reads.append(tuple(reads))
        step_writes.append(tuple(writes))
        issue_transfers(j + 1)

    _check_reader_copies(graph, plan, c_tensor, c_source, c_readers)
    prefetch_offload = tuple(offload_of[tr.tensor] for tr in plan.prefetches)
    _check_fifo_order(plan, prefetch_copy, prefetch_offload, c_readers)

    copies = tuple(
        Copy(t, size, src, idx, tuple(rd), off, holds)
        for t, size, src, idx, rd, off, holds in zip(
            c_tensor, c_size, c_source, c_index, c_readers, c_offload, c_holds, strict=True
        )
    )
    return ResolvedSchedule(
        copies=copies,
        step_reads=tuple(step_reads),
        step_writes=tuple(step_writes),
        offload_copy=tuple(offload_copy),
        prefetch_copy=tuple(prefetch_copy),
        prefetch_offload=prefetch_offload,
        offload_bytes=tuple(tensors[tr.tensor].size_bytes for tr in plan.offloads),
        prefetch_bytes=tuple(tensors[tr.tensor].size_bytes for tr in plan.prefetches),
    )


def _check_reader_copies(
    graph: Graph, plan: Plan, c_tensor: list[str], c_source: list[str], c_readers: list[list[int]]
) -> None:
    """Each decision fixes which copy the forward and backward readers of a saved tensor read."""
    wanted = {Decision.KEEP: "run", Decision.SWAP: "prefetch", Decision.RECOMPUTE: "recompute"}
    first_problem: tuple[int, str] | None = None
    for c, t in enumerate(c_tensor):
        decision = plan.decisions.get(t)
        if decision is None:
            continue
        for j in c_readers[c]:
            step = plan.steps[j]
            if step.kind != StepKind.RUN:
                continue  # a recompute step may read any resident copy
            forward = graph.op_by_name[step.op].phase in FORWARD_PHASES
            need = "run" if forward else wanted[decision]
            if c_source[c] == need:
                continue
            role = "forward" if forward else "backward"
            if decision == Decision.SWAP and forward:
                why = "its prefetch is issued before this forward reader"
            elif decision == Decision.SWAP:
                why = "its prefetch is issued after this backward reader (or it reads a recomputed copy)"
            elif decision == Decision.RECOMPUTE and not forward:
                why = "no recompute step materialises it between its forward use and this reader"
            else:
                why = f"a {c_source[c]} copy exists where the {need} copy is required"
            msg = (
                f"{_step_name(plan, j)}, a {role} reader of {decision!s} tensor {t!r}, "
                f"reads its {c_source[c]} copy: {why}"
            )
            if first_problem is None or j < first_problem[0]:
                first_problem = (j, msg)
    if first_problem is not None:
        _fail(first_problem[1])


def _check_fifo_order(
    plan: Plan, prefetch_copy: list[int], prefetch_offload: tuple[int, ...], c_readers: list[list[int]]
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
        readers = c_readers[prefetch_copy[k]]
        if readers and readers[0] <= last:
            _fail(
                f"prefetch {k} of tensor {tr.tensor!r} cannot start before step {last} finishes "
                f"(FIFO order of the offload/prefetch lists), but {_step_name(plan, readers[0])} reads it: "
                "the schedule would deadlock"
            )
