"""Plan validation: a plan must be a complete, consistent schedule before it is simulated.

`resolve_schedule` checks every rule of docs/simulation.md section 2 and returns the plan's
`ResolvedSchedule`: the rules that need no copies first, then the copy resolver
(`slackswap.schedule.copies`) walks the plan once, then the rules about which copy each reader
reads and the FIFO order are checked on its result. Every executor reuses that one resolution, so
validation, simulation, the replays and the runtime can never disagree about which copy a step
reads or when a copy dies. The first inconsistency found raises `PlanValidationError` naming the
tensor, op and step.
"""

from __future__ import annotations

from collections.abc import Sequence

from slackswap.errors import GraphMismatchError
from slackswap.graph import Graph
from slackswap.plan import Decision, Direction, Plan, StepKind
from slackswap.schedule.copies import Copy, ResolvedSchedule, fail, graph_tables, resolve_copies, step_name

__all__ = ["Copy", "ResolvedSchedule", "resolve_schedule", "validate_plan"]


def validate_plan(graph: Graph, plan: Plan) -> None:
    """Raise `PlanValidationError` naming the first inconsistency; return None for a valid plan."""
    resolve_schedule(graph, plan)


def _check_steps(graph: Graph, plan: Plan) -> list[int]:
    """Steps name real ops, carry consistent outputs, and every op runs exactly once.

    Returns each step's role for `_check_reader_copies`: 0 recompute, 1 forward run, 2 other run."""
    if not plan.steps:
        fail("has no compute steps")
    _, _, _, op_by_name, forward_ops, _ = graph_tables(graph)
    run, recompute = StepKind.RUN, StepKind.RECOMPUTE
    run_step: dict[str, int] = {}
    roles: list[int] = []
    for j, step in enumerate(plan.steps):
        name = step.op
        op = op_by_name.get(name)
        if op is None:
            fail(f"step {j} names op {name!r}, which is not in graph {graph.name!r}")
        kind = step.kind
        if kind == run:
            outputs = step.outputs
            if outputs is not op.outputs and outputs != op.outputs and tuple(outputs) != tuple(op.outputs):
                fail(
                    f"step {j} runs op {name!r} with outputs {list(step.outputs)}; "
                    f"a run step materialises all of the op's outputs {list(op.outputs)}"
                )
            if name in run_step:
                fail(f"op {name!r} is run twice (steps {run_step[name]} and {j})")
            run_step[name] = j
            roles.append(1 if name in forward_ops else 2)
        elif kind == recompute:
            if name not in forward_ops:
                fail(f"step {j} recomputes op {name!r} of phase {op.phase.value!r}; only forward ops are recomputed")
            if name not in run_step:
                fail(f"step {j} recomputes op {name!r} before its run step")
            if not step.outputs:
                fail(f"step {j} recomputes op {name!r} but materialises no outputs")
            if len(set(step.outputs)) != len(step.outputs):
                fail(f"step {j} recomputes op {name!r} with duplicate outputs {list(step.outputs)}")
            for t in step.outputs:
                if t not in op.outputs:
                    fail(f"step {j} recomputes op {name!r} with output {t!r}, which that op does not produce")
            roles.append(0)
        else:
            fail(f"step {j} ({name!r}) has unknown kind {kind!r}")
    if len(run_step) != len(graph.ops):
        for op in graph.ops:
            if op.name not in run_step:
                fail(f"never runs op {op.name!r}")
    return roles


def _check_decisions(graph: Graph, plan: Plan) -> None:
    saved = graph_tables(graph)[5]
    decisions = plan.decisions
    try:
        if decisions.keys() == saved and set(decisions.values()) <= _DECISIONS:
            return  # one decision per saved tensor, each keep/swap/recompute: set operations in C
    except TypeError:
        pass  # an unhashable decision: the loops below name it
    for t in graph.saved_tensors:
        if t.name not in plan.decisions:
            fail(f"has no decision (keep/swap/recompute) for saved tensor {t.name!r}")
    candidates = graph.candidate_names
    for name, decision in plan.decisions.items():
        if name not in saved and name not in candidates:
            fail(f"decides {decision!r} for tensor {name!r}, which is neither a saved tensor nor a "
                  "checkpoint candidate of the graph")
        if decision not in (Decision.KEEP, Decision.SWAP, Decision.RECOMPUTE):
            fail(f"decision for tensor {name!r} is {decision!r}, not keep/swap/recompute")
        if name not in saved and decision == Decision.RECOMPUTE:
            fail(f"decides recompute for checkpoint candidate {name!r}; a candidate is kept or swapped, "
                  "or has no decision")


_DECISIONS = frozenset(Decision)


def _check_transfers(graph: Graph, plan: Plan) -> tuple[dict[str, int], dict[str, int]]:
    """Directions, ranges and one offload + one prefetch per swapped tensor. Returns tensor -> index maps."""
    n = len(plan.steps)
    by_tensor: list[dict[str, int]] = [{}, {}]
    tensors = graph_tables(graph)[1]  # tensor name -> bytes: the graph's tensors
    decision_of = plan.decisions.get
    swap = Decision.SWAP
    for which, (label, transfers, direction) in enumerate(
        (("offload", plan.offloads, Direction.D2H), ("prefetch", plan.prefetches, Direction.H2D))
    ):
        seen = by_tensor[which]
        for k, tr in enumerate(transfers):
            t = tr.tensor
            if tr.direction != direction:
                fail(
                    f"{label} {k} of tensor {t!r} has direction {tr.direction!r}; "
                    f"{label}s are {direction.value}"
                )
            if t not in tensors:
                fail(f"{label} {k} moves tensor {t!r}, which is not in the graph")
            issue = tr.issue_after_step
            if not isinstance(issue, int) or not -1 <= issue < n:
                fail(
                    f"{label} {k} of tensor {t!r} has issue_after_step={issue!r}; "
                    f"must be an integer in [-1, {n - 1}]"
                )
            if decision_of(t) != swap:
                fail(f"{label}s tensor {t!r}, whose decision is {plan.decisions.get(t, 'none')!s}, not swap")
            if t in seen:
                fail(f"{label}s tensor {t!r} twice ({label}s {seen[t]} and {k})")
            seen[t] = k
    offload_of, prefetch_of = by_tensor
    for t in plan.tensors_with(Decision.SWAP):
        if t not in offload_of:
            fail(f"swaps tensor {t!r} but has no offload for it")
        if t not in prefetch_of:
            fail(f"swaps tensor {t!r} but has no prefetch for it")
        off = plan.offloads[offload_of[t]].issue_after_step
        pre = plan.prefetches[prefetch_of[t]].issue_after_step
        if pre < off:
            fail(f"prefetches tensor {t!r} after step {pre}, before its offload is issued (after step {off})")
    return offload_of, prefetch_of


def resolve_schedule(graph: Graph, plan: Plan) -> ResolvedSchedule:
    """Validate `plan` against `graph` and resolve the copy each step reads. Raises `PlanValidationError`
    (`GraphMismatchError` when the plan was made for another graph).

    The rules that need no copies are checked first, then `copies.resolve_copies` walks the plan, then the
    rules about which copy each reader reads and the FIFO order are checked on the result."""
    if plan.graph_fingerprint and plan.graph_fingerprint != graph.fingerprint:
        raise GraphMismatchError(
            f"plan of planner {plan.planner!r} was made for a graph with fingerprint {plan.graph_fingerprint}, "
            f"not for graph {graph.name!r} (fingerprint {graph.fingerprint})"
        )
    roles = _check_steps(graph, plan)
    _check_decisions(graph, plan)
    offload_of, _ = _check_transfers(graph, plan)
    s = resolve_copies(graph, plan, offload_of)
    _check_reader_copies(plan, roles, s.copy_tensor, s.copy_source, s.read_copies, s.read_starts)
    _check_fifo_order(plan, s.prefetch_offload, s.prefetch_readers)
    return s


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
            fail(
                f"{step_name(plan, j)}, a {role_name} reader of {decision!s} tensor {t!r}, "
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
            fail(
                f"prefetch {k} of tensor {tr.tensor!r} cannot start before step {last} finishes "
                f"(FIFO order of the offload/prefetch lists), but {step_name(plan, readers[0])} reads it: "
                "the schedule would deadlock"
            )
