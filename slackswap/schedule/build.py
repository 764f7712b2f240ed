"""Turn per-tensor keep / swap / recompute decisions into the explicit schedule the simulator runs.

Every planner (including the MILP) decides *what* happens to each saved activation and calls
`build_schedule` to decide *when*, so all planners are judged on the same scheduling rules:

- compute: the forward and loss ops run in graph order; then the backward (and optimizer) ops in
  graph order, and right before each backward op every input it lacks is regenerated: a recompute
  step of the input's forward producer, preceded (recursively, in forward order) by the recompute of
  whatever that producer itself lacks. A regenerated copy is shared by every later reader, so a
  recompute chain shared by several tensors runs once. "Lacks" means: a recompute-decided saved
  tensor, or a non-saved forward tensor without a decision (its forward copy was freed after the
  forward pass; reading it in backward would keep it alive all along). Kept and swapped tensors, the
  checkpoint candidates a plan decides included (`Graph.candidate_tensors`), are never regenerated:
  a kept candidate's run copy lives until its last recompute reader. Nor is a forward tensor the
  model's code holds into the backward pass (`Tensor.held_until` a backward op) and no op overwrites
  in place: its run copy is on the device anyway, so a recompute reads it as it would a kept one
  (on captured graphs only the loss value is held so; `slackswap.planners.support.fixed_keep`
  holds tensors so on purpose).
  When a producer is recomputed, its other recompute-decided outputs not yet regenerated are
  materialised by the same step (one recompute per op, not one per output).
- offloads: one per swapped tensor, issued right after its producer's run step, in production order.
- prefetches: one per swapped tensor, in the order of first backward use (the first step after the
  forward pass that reads it, a recompute step included). The `prefetch` policy picks the issuing step:
  - "alap" (default): as late as possible such that, on the no-stall compute timeline of this
    schedule and with the H2D engine serving the prefetches back to back, each prefetch still
    completes before its first use (minus `prefetch_lead_s`). Late enough to hold as little memory
    as possible, early enough to hide.
  - "layer_ahead" (vDNN): issued when the backward pass of the next-higher layer begins, i.e. one
    layer ahead of use; tensors outside the layer stack or of the top layer at the start of backward.
  - "at_unpack": as the offloaders people run fetch (`slackswap.schedule.offloader`): when the
    step `unpack_lookahead_steps` before the first backward reader finishes (0: right before the
    reader, which waits for the copy), never before the forward pass ends.
  - `prefetch_after_op` overrides the policy per tensor: issue after the run step of that op.
  Every prefetch is issued no earlier than the tensor's last forward reader and before its first
  backward use, and issue steps are non-decreasing in FIFO order so the H2D engine never blocks a
  ready prefetch behind one issued later.

The signature is stable: the MILP planner and the tests call it. `keep_all_plan` is the trivial
schedule (every op run once, nothing moved) that the simulator's ideal and keep_all use.
"""

from __future__ import annotations

from collections.abc import Mapping

from slackswap.errors import ConfigError, PlanValidationError
from slackswap.graph import FORWARD_PHASES, Graph, GraphMemo, Phase
from slackswap.hardware import Hardware
from slackswap.plan import ComputeStep, Decision, Direction, Plan, StepKind, Transfer
from slackswap.schedule.transfer import h2d_s

PREFETCH_POLICIES: tuple[str, ...] = ("alap", "layer_ahead", "at_unpack")


def keep_all_plan(graph: Graph, budget_bytes: int | None = None) -> Plan:
    """Keep every saved activation: each op runs once in graph order and nothing is copied."""
    return Plan(
        planner="keep_all",
        budget_bytes=budget_bytes,
        decisions={t.name: Decision.KEEP for t in graph.saved_tensors},
        steps=tuple(ComputeStep(op.name, StepKind.RUN, op.outputs) for op in graph.ops),
        graph_fingerprint=graph.fingerprint,
    )


def check_decisions(graph: Graph, decisions: Mapping[str, Decision | str]) -> dict[str, Decision]:
    """Exactly one valid decision per saved tensor, and keep or swap for any checkpoint candidate
    decided (`Graph.candidate_tensors`); names the first missing, unknown or bad entry."""
    saved = _saved_forward(graph)
    out: dict[str, Decision] = {}
    recompute = Decision.RECOMPUTE
    candidates = 0
    for name, value in decisions.items():
        forward = saved.get(name)
        if forward is None:
            if name not in graph.candidate_names:
                raise ConfigError(f"decisions[{name!r}]", value,
                                  "is neither a saved tensor nor a checkpoint candidate of the graph")
            candidates += 1
            forward = True
        if value.__class__ is not Decision:  # planners pass Decision members: skip the enum lookup
            try:
                value = Decision(value)
            except ValueError:
                raise ConfigError(
                    f"decisions[{name!r}]", value, f"must be one of {[d.value for d in Decision]}"
                ) from None
        out[name] = value
        if value is recompute and name not in saved:
            raise ConfigError(f"decisions[{name!r}]", value, "a checkpoint candidate is kept or swapped; "
                              "recomputing it is what happens without a decision, so leave it out")
        if value is recompute and not forward:
            producer = graph.op_by_name[graph.tensors[name].producer]
            raise ConfigError(f"decisions[{name!r}]", value, f"only forward tensors can be recomputed, "
                              f"this one is produced by {producer.phase.value} op {producer.name!r}")
    if len(out) - candidates == len(saved):
        return out
    missing = [t.name for t in graph.saved_tensors if t.name not in out]
    if missing:
        raise ConfigError("decisions", missing[:5], f"{len(missing)} saved tensor(s) have no decision")
    return out


def _build_saved_forward(graph: Graph) -> dict[str, bool]:
    return {t.name: graph.op_by_name[t.producer].phase in FORWARD_PHASES for t in graph.saved_tensors}


#: Saved tensor -> produced by a forward (or loss) op; once per graph: planners build many schedules of one.
_saved_forward: GraphMemo[dict[str, bool]] = GraphMemo(_build_saved_forward)


def _build_run_steps(graph: Graph) -> tuple[list[ComputeStep], list[tuple[ComputeStep, tuple[str, ...]]], set[str]]:
    forward = [ComputeStep(op.name, StepKind.RUN, op.outputs) for op in graph.ops if op.phase in FORWARD_PHASES]
    rest = [
        (ComputeStep(op.name, StepKind.RUN, op.outputs), op.inputs)
        for op in graph.ops
        if op.phase not in FORWARD_PHASES
    ]
    forward_tensors = {t for op in graph.ops if op.phase in FORWARD_PHASES for t in op.outputs}
    return forward, rest, forward_tensors


#: (forward run steps, (run step, inputs) of every other op, forward tensors), once per graph. ComputeStep
#: is immutable, so every schedule of the graph shares these objects.
_run_steps: GraphMemo[tuple[list[ComputeStep], list[tuple[ComputeStep, tuple[str, ...]]], set[str]]] = GraphMemo(
    _build_run_steps)


def build_schedule(
    graph: Graph,
    decisions: Mapping[str, Decision | str],
    *,
    planner: str,
    budget_bytes: int | None,
    hardware: Hardware,
    prefetch: str = "alap",
    prefetch_lead_s: float = 0.0,
    prefetch_after_op: Mapping[str, str] | None = None,
    bound_step_s: float | None = None,
    notes: Mapping[str, object] | None = None,
    unpack_lookahead_steps: int = 0,
) -> Plan:
    """Build the explicit schedule for `decisions` (saved tensor name -> keep/swap/recompute).

    `hardware` gives the op and copy times the "alap" prefetch placement is computed from.
    Raises ConfigError for a bad decision or option, PlanValidationError for an impossible override.
    """
    if prefetch not in PREFETCH_POLICIES:
        raise ConfigError("prefetch", prefetch, f"unknown prefetch policy; known: {PREFETCH_POLICIES}")
    if not prefetch_lead_s >= 0:
        raise ConfigError("prefetch_lead_s", prefetch_lead_s, "must be >= 0")
    lookahead = unpack_lookahead_steps
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
        raise ConfigError("unpack_lookahead_steps", unpack_lookahead_steps, "must be an integer >= 0")
    decided = check_decisions(graph, decisions)
    steps = _compute_steps(graph, decided)
    offloads = _offloads(graph, decided, steps)
    prefetches = _prefetches(
        graph, decided, steps, hardware, prefetch, prefetch_lead_s, dict(prefetch_after_op or {}),
        unpack_lookahead_steps,
    )
    return Plan(
        planner=planner,
        budget_bytes=budget_bytes,
        decisions=decided,
        steps=steps,
        offloads=offloads,
        prefetches=prefetches,
        bound_step_s=bound_step_s,
        notes=dict(notes or {}),
        graph_fingerprint=graph.fingerprint,
    )


def unread_swapped_candidates(graph: Graph, decisions: Mapping[str, Decision | str]) -> list[str]:
    """The checkpoint candidates `decisions` swap that no step after the forward pass reads (in
    production order): `build_schedule` refuses such a plan (a swap is a reload for a reader). Why
    public: an executor that decides an op's outputs together (selective checkpointing caches them
    whole) makes a candidate share a saved tensor's swap, and the plan made for it must find out which
    candidates no recompute would read before it asks for a schedule (`planners.support.fixed_keep`)."""
    decided = check_decisions(graph, decisions)
    candidates = graph.candidate_names
    swapped = [t.name for t in _swapped(graph, decided) if t.name in candidates]
    if not swapped:
        return []
    first_bwd = _first_backward_reads(graph, _compute_steps(graph, decided))[2]
    return [t for t in swapped if t not in first_bwd]


def _compute_steps(graph: Graph, decided: Mapping[str, Decision]) -> tuple[ComputeStep, ...]:
    forward, rest, forward_tensors = _run_steps(graph)
    steps = list(forward)
    # Tensors whose latest copy a backward-region step may read.
    recompute = Decision.RECOMPUTE
    available = {name for name, d in decided.items() if d is not recompute} | _held_into_backward(graph)
    for step, inputs in rest:
        for t in inputs:
            if t in forward_tensors and t not in available:
                _regenerate(graph, t, decided, available, steps)
        steps.append(step)
        available.update(step.outputs)
    return tuple(steps)


def _build_held_into_backward(graph: Graph) -> frozenset[str]:
    ops = graph.op_by_name
    written = {t for op in graph.ops for t in op.writes}  # a later op overwrites it: the copy is stale
    return frozenset(t.name for t in graph.tensors.values() if t.held_until and not t.saved
                     and ops[t.producer].phase in FORWARD_PHASES and ops[t.held_until].phase == Phase.BACKWARD
                     and t.name not in written)


#: Forward tensors autograd does not save whose run copy the model's code holds into the backward pass:
#: readable by a recompute without regenerating them (module docstring); once per graph.
_held_into_backward: GraphMemo[frozenset[str]] = GraphMemo(_build_held_into_backward)


def _regenerate(
    graph: Graph, target: str, decided: Mapping[str, Decision], available: set[str], steps: list[ComputeStep]
) -> None:
    """Append recompute steps that materialise `target`, producers first (iterative post-order DFS)."""
    stack: list[tuple[str, bool]] = [(target, False)]
    while stack:
        name, inputs_done = stack.pop()
        if name in available:
            continue
        producer = graph.op_by_name[graph.tensors[name].producer]
        if not inputs_done:
            stack.append((name, True))
            stack.extend((t, False) for t in reversed(producer.inputs) if t not in available)
            continue
        outputs = tuple(
            t
            for t in producer.outputs
            if t == name or (t not in available and decided.get(t) == Decision.RECOMPUTE)
        )
        steps.append(ComputeStep(producer.name, StepKind.RECOMPUTE, outputs))
        available.update(outputs)


def _build_forward_facts(graph: Graph) -> tuple[int, dict[str, int], dict[str, int]]:
    forward_ops = [op for op in graph.ops if op.phase in FORWARD_PHASES]
    last_fwd: dict[str, int] = {}
    for i, op in enumerate(forward_ops):
        for t in (*op.inputs, *op.outputs):
            last_fwd[t] = i
    index = {op.name: i for i, op in enumerate(forward_ops)}
    return len(forward_ops), last_fwd, index


#: (forward step count, last forward reader or producer per tensor over the forward steps, forward op
#: -> its step index), once per graph: the forward steps of every schedule are the same run steps in
#: graph order.
_forward_facts: GraphMemo[tuple[int, dict[str, int], dict[str, int]]] = GraphMemo(_build_forward_facts)


def _first_backward_reads(graph: Graph, steps: tuple[ComputeStep, ...]) -> tuple[int, dict[str, int], dict[str, int]]:
    """(number of forward steps, last forward reader or producer index, first backward reader index).

    A tensor produced after the forward pass (a gradient read by a later backward op) has its
    producer step as "last forward reader": its offload and prefetch both happen in backward."""
    n_fwd, forward_last, _ = _forward_facts(graph)
    last_fwd = dict(forward_last)
    first_bwd: dict[str, int] = {}
    distinct_inputs = graph.distinct_inputs
    run = StepKind.RUN
    for i in range(n_fwd, len(steps)):
        step = steps[i]
        for t in distinct_inputs[step.op]:
            if t not in first_bwd:
                first_bwd[t] = i
        if step.kind == run:
            for t in step.outputs:
                if t not in last_fwd:
                    last_fwd[t] = i
    return n_fwd, last_fwd, first_bwd


def _swapped(graph: Graph, decided: Mapping[str, Decision]) -> list:
    """The swapped tensors in production order (saved tensors and checkpoint candidates)."""
    swap = Decision.SWAP
    if len(decided) == len(_saved_forward(graph)):  # no candidate decided: the saved tensors' order
        return [t for t in graph.saved_tensors if decided[t.name] is swap]
    tensors = graph.tensors
    return [tensors[t] for op in graph.ops for t in op.outputs if decided.get(t) is swap]


def _run_index(steps: tuple[ComputeStep, ...]) -> dict[str, int]:
    run = StepKind.RUN
    return {s.op: i for i, s in enumerate(steps) if s.kind == run}


def _offloads(graph: Graph, decided: Mapping[str, Decision], steps: tuple[ComputeStep, ...]) -> tuple[Transfer, ...]:
    swapped = _swapped(graph, decided)
    forward_index = _forward_facts(graph)[2]  # a forward producer's run step is its forward position
    if all(t.producer in forward_index for t in swapped):
        return tuple(Transfer(t.name, Direction.D2H, forward_index[t.producer]) for t in swapped)
    run_index = _run_index(steps)
    return tuple(Transfer(t.name, Direction.D2H, run_index[t.producer]) for t in swapped)


def _prefetches(
    graph: Graph,
    decided: Mapping[str, Decision],
    steps: tuple[ComputeStep, ...],
    hardware: Hardware,
    policy: str,
    lead_s: float,
    after_op: dict[str, str],
    lookahead_steps: int = 0,
) -> tuple[Transfer, ...]:
    swapped = [t.name for t in _swapped(graph, decided)]
    unknown = sorted(set(after_op) - set(swapped))
    if unknown:
        raise ConfigError("prefetch_after_op", unknown, "names tensor(s) that are not swapped")
    if not swapped:
        return ()
    n_fwd, last_fwd, first_bwd = _first_backward_reads(graph, steps)
    unread = [t for t in swapped if t not in first_bwd]
    if unread:
        raise ConfigError(f"decisions[{unread[0]!r}]", "swap",
                          "a swapped checkpoint candidate must be read by a recompute step; "
                          "no step reads it after the forward pass")
    order = sorted(swapped, key=lambda t: first_bwd[t])
    if policy == "alap":
        issue = _alap_issue(graph, steps, hardware, order, first_bwd, lead_s)
    elif policy == "at_unpack":
        issue = {t: max(first_bwd[t] - 1 - lookahead_steps, n_fwd - 1) for t in order}
    else:
        issue = _layer_ahead_issue(graph, steps, n_fwd, order)
    run_index = _run_index(steps) if after_op else {}
    for t, op_name in after_op.items():
        if op_name not in run_index:
            raise ConfigError(f"prefetch_after_op[{t!r}]", op_name, "is not an op of the graph")
        k = run_index[op_name]
        if not last_fwd[t] <= k < first_bwd[t]:
            raise PlanValidationError(
                f"prefetch_after_op[{t!r}]={op_name!r} (step {k}) must lie between the last forward reader "
                f"(step {last_fwd[t]}) and the first backward reader (step {first_bwd[t]})"
            )
        issue[t] = k
    out = []
    previous = -1
    for t in order:
        # A policy's pick never lands at or after the first use (layer_ahead on an odd graph could).
        k = max(min(issue[t], first_bwd[t] - 1), last_fwd[t], previous)
        if k >= first_bwd[t]:
            raise PlanValidationError(f"prefetch of {t!r} cannot be issued before its first backward reader")
        out.append(Transfer(t, Direction.H2D, k))
        previous = k
    return tuple(out)


def _alap_issue(
    graph: Graph,
    steps: tuple[ComputeStep, ...],
    hardware: Hardware,
    order: list[str],
    first_bwd: Mapping[str, int],
    lead_s: float,
) -> dict[str, int]:
    duration = graph.op_duration_s
    durations = [duration[step.op] for step in steps]
    ends: list[float] = []
    now = 0.0
    for d in durations:
        now += d
        ends.append(now)
    starts = [e - d for d, e in zip(durations, ends, strict=True)]
    latest_start: dict[str, float] = {}
    horizon = float("inf")
    for t in reversed(order):
        dur = h2d_s(graph.tensors[t].size_bytes, hardware)
        horizon = min(horizon, starts[first_bwd[t]] - lead_s) - dur
        latest_start[t] = horizon
    issue: dict[str, int] = {}
    k = -1
    for t in order:  # latest_start is non-decreasing along `order`, so one forward sweep suffices
        while k + 1 < first_bwd[t] and ends[k + 1] <= latest_start[t]:
            k += 1
        issue[t] = k
    return issue


def _layer_ahead_issue(graph: Graph, steps: tuple[ComputeStep, ...], n_fwd: int, order: list[str]) -> dict[str, int]:
    first_bwd_step_of_layer: dict[int, int] = {}
    for i in range(n_fwd, len(steps)):
        op = graph.op_by_name[steps[i].op]
        if op.phase == Phase.BACKWARD:
            first_bwd_step_of_layer.setdefault(op.layer, i)
    issue: dict[str, int] = {}
    for t in order:
        layer = graph.tensors[t].layer
        start = first_bwd_step_of_layer.get(layer + 1) if layer >= 0 else None
        issue[t] = (start - 1) if start is not None else n_fwd - 1
    return issue
