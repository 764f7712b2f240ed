"""Each kind of inconsistent plan is rejected, and the message names the tensor / op / step at fault."""

from __future__ import annotations

import dataclasses
import random

import pytest

from slackswap.errors import PlanValidationError
from slackswap.plan import ComputeStep, Decision, Direction, Plan, StepKind, Transfer
from slackswap.schedule.build import keep_all_plan
from slackswap.simulate import resolve_schedule, validate_plan
from slackswap.testing import bwd, fwd, make_graph, random_graph, random_valid_plan

GRAPH = make_graph(
    [
        fwd("F1", (), ("a",), 1.0),
        fwd("F2", ("a",), ("b", "m"), 1.0),
        fwd("F3", ("b",), ("c",), 1.0),
        bwd("B3", ("c", "m"), ("g2",), 1.0),
        bwd("B2", ("g2", "b"), ("g1",), 1.0),
        bwd("B1", ("g1", "a"), (), 1.0),
    ],
    {"a": 100, "b": 200, "m": 20, "c": 50, "g2": 10, "g1": 10},
)
RUN = {op.name: ComputeStep(op.name, StepKind.RUN, op.outputs) for op in GRAPH.ops}
ORDER = [op.name for op in GRAPH.ops]  # F1 F2 F3 B3 B2 B1


def keep_all() -> Plan:
    return keep_all_plan(GRAPH)


def with_decisions(plan: Plan, **changes: Decision) -> Plan:
    return dataclasses.replace(plan, decisions={**plan.decisions, **changes})


def swap_b(offload_after: int = 1, prefetch_after: int = 3) -> Plan:
    """b produced by F2 (step 1), last forward reader F3 (step 2), first backward reader B2 (step 4)."""
    return dataclasses.replace(
        with_decisions(keep_all(), b=Decision.SWAP),
        offloads=(Transfer("b", Direction.D2H, offload_after),),
        prefetches=(Transfer("b", Direction.H2D, prefetch_after),),
    )


def recompute_b() -> Plan:
    steps = [RUN[n] for n in ORDER]
    steps.insert(4, ComputeStep("F2", StepKind.RECOMPUTE, ("b",)))  # before B2
    return dataclasses.replace(with_decisions(keep_all(), b=Decision.RECOMPUTE), steps=tuple(steps))


def rejected(plan: Plan, *parts: str) -> None:
    with pytest.raises(PlanValidationError) as info:
        validate_plan(GRAPH, plan)
    for part in parts:
        assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"


def test_valid_plans_pass_and_resolve_copies():
    for plan in (keep_all(), swap_b(), swap_b(1, 2), recompute_b()):
        validate_plan(GRAPH, plan)
    s = resolve_schedule(GRAPH, recompute_b())
    b_copies = [c for c in s.copies if c.tensor == "b"]
    assert [(c.source, c.source_index, c.readers) for c in b_copies] == [("run", 1, (2,)), ("recompute", 4, (5,))]
    s = resolve_schedule(GRAPH, swap_b())
    b_copies = [c for c in s.copies if c.tensor == "b"]
    assert [(c.source, c.readers, c.offload) for c in b_copies] == [("run", (2,), 0), ("prefetch", (4,), None)]


def test_random_valid_plans_pass():
    for seed in range(50):
        rng = random.Random(seed)
        graph = random_graph(rng)
        validate_plan(graph, random_valid_plan(graph, rng))


def test_unknown_op():
    steps = (*keep_all().steps, ComputeStep("nope", StepKind.RUN, ()))
    rejected(dataclasses.replace(keep_all(), steps=steps), "step 6", "'nope'")


def test_empty_plan():
    rejected(dataclasses.replace(keep_all(), steps=()), "no compute steps")


def test_run_step_with_wrong_outputs():
    steps = list(keep_all().steps)
    steps[1] = ComputeStep("F2", StepKind.RUN, ("b",))
    rejected(dataclasses.replace(keep_all(), steps=tuple(steps)), "step 1", "'F2'", "'m'")


def test_op_run_twice_or_never():
    rejected(
        dataclasses.replace(keep_all(), steps=(*keep_all().steps, RUN["F3"])), "'F3'", "run twice", "steps 2 and 6"
    )
    rejected(dataclasses.replace(keep_all(), steps=keep_all().steps[:-1]), "never runs op 'B1'")


def test_recompute_step_rules():
    def with_step(at: int, step: ComputeStep, plan: Plan | None = None) -> Plan:
        plan = plan or with_decisions(keep_all(), b=Decision.RECOMPUTE)
        steps = list(plan.steps)
        steps.insert(at, step)
        return dataclasses.replace(plan, steps=tuple(steps))

    rejected(with_step(4, ComputeStep("B3", StepKind.RECOMPUTE, ("g2",))), "step 4", "'B3'", "only forward ops")
    rejected(with_step(0, ComputeStep("F2", StepKind.RECOMPUTE, ("b",))), "step 0", "'F2'", "before its run step")
    rejected(with_step(4, ComputeStep("F2", StepKind.RECOMPUTE, ("c",))), "step 4", "'c'", "does not produce")
    rejected(with_step(4, ComputeStep("F2", StepKind.RECOMPUTE, ())), "step 4", "no outputs")
    rejected(with_step(4, ComputeStep("F2", StepKind.RECOMPUTE, ("b", "b"))), "step 4", "duplicate")
    # m is decided keep: recomputing it contradicts the decision.
    rejected(with_step(4, ComputeStep("F2", StepKind.RECOMPUTE, ("b", "m"))), "step 4", "'m'", "decision is keep")


def test_decisions_cover_exactly_the_saved_tensors():
    decisions = dict(keep_all().decisions)
    del decisions["m"]
    rejected(dataclasses.replace(keep_all(), decisions=decisions), "no decision", "'m'")
    rejected(with_decisions(keep_all(), zzz=Decision.KEEP), "'zzz'",
             "neither a saved tensor nor a checkpoint candidate")
    rejected(dataclasses.replace(keep_all(), decisions={**keep_all().decisions, "a": "maybe"}), "'a'", "'maybe'")


def test_transfer_fields():
    plan = swap_b()
    rejected(dataclasses.replace(plan, offloads=(Transfer("b", Direction.H2D, 1),)), "offload 0", "'b'", "direction")
    rejected(
        dataclasses.replace(plan, offloads=(Transfer("q", Direction.D2H, 1),)), "offload 0", "'q'", "not in the graph"
    )
    rejected(
        dataclasses.replace(plan, prefetches=(Transfer("b", Direction.H2D, 6),)),
        "prefetch 0",
        "'b'",
        "issue_after_step=6",
        "[-1, 5]",
    )
    rejected(dataclasses.replace(plan, offloads=(Transfer("b", Direction.D2H, -2),)), "issue_after_step=-2")


def test_transfer_of_a_tensor_not_decided_swap():
    plan = dataclasses.replace(swap_b(), offloads=(*swap_b().offloads, Transfer("c", Direction.D2H, 2)))
    rejected(plan, "'c'", "keep, not swap")


def test_swap_needs_exactly_one_offload_and_one_prefetch():
    plan = swap_b()
    rejected(dataclasses.replace(plan, offloads=()), "swaps tensor 'b'", "no offload")
    rejected(dataclasses.replace(plan, prefetches=()), "swaps tensor 'b'", "no prefetch")
    rejected(dataclasses.replace(plan, offloads=plan.offloads * 2), "'b'", "twice")


def test_prefetch_issued_before_its_offload():
    rejected(swap_b(offload_after=3, prefetch_after=2), "'b'", "after step 2", "offload is issued (after step 3)")


def test_offload_before_the_tensor_exists():
    rejected(
        swap_b(offload_after=0, prefetch_after=3), "offloads tensor 'b' after step 0", "before any step has produced it"
    )


def test_read_without_a_resident_copy():
    steps = [RUN[n] for n in ("F2", "F1", "F3", "B3", "B2", "B1")]
    rejected(dataclasses.replace(keep_all(), steps=tuple(steps)), "step 0", "'F2'", "'a'", "no device copy")


def test_prefetch_before_the_last_forward_reader():
    # Prefetch issued after step 1, but F3 (step 2) still reads b in forward.
    rejected(swap_b(offload_after=1, prefetch_after=1), "step 2", "'F3'", "forward reader", "'b'")


def test_backward_reader_of_a_swapped_tensor_reads_the_original():
    # Prefetch issued after B2 (step 4): B2 reads the original copy, which a swap must not keep.
    rejected(swap_b(offload_after=1, prefetch_after=4), "step 4", "'B2'", "backward reader", "swap tensor 'b'")


def test_recompute_decision_without_a_recompute_step():
    rejected(
        with_decisions(keep_all(), b=Decision.RECOMPUTE), "step 4", "'B2'", "recompute tensor 'b'", "no recompute step"
    )


def test_recompute_of_a_swapped_tensor():
    plan = swap_b()
    steps = list(plan.steps)
    steps.insert(4, ComputeStep("F2", StepKind.RECOMPUTE, ("b",)))
    plan = dataclasses.replace(plan, steps=tuple(steps), prefetches=(Transfer("b", Direction.H2D, 3),))
    rejected(plan, "step 4", "'b'", "decision is swap")


def test_offload_and_prefetch_issued_at_the_same_position():
    # c has no forward reader: offload and prefetch both issued after F3 (step 2); offloads come first
    # at one position, so the offload copies the run copy and B3 reads the prefetched one.
    plan = dataclasses.replace(
        with_decisions(keep_all(), c=Decision.SWAP),
        offloads=(Transfer("c", Direction.D2H, 2),),
        prefetches=(Transfer("c", Direction.H2D, 2),),
    )
    s = resolve_schedule(GRAPH, plan)
    assert [(c.source, c.readers) for c in s.copies if c.tensor == "c"] == [("run", ()), ("prefetch", (3,))]


def test_fifo_order_that_deadlocks_is_rejected():
    # Two swapped tensors; the h2d list serves c's prefetch (issued after B3, step 3) before m's
    # (issued after F3, step 2), but B3 reads m: m's prefetch cannot start before B3 ends.
    plan = dataclasses.replace(
        with_decisions(keep_all(), c=Decision.KEEP, m=Decision.SWAP, b=Decision.SWAP),
        offloads=(Transfer("b", Direction.D2H, 1), Transfer("m", Direction.D2H, 1)),
        prefetches=(Transfer("b", Direction.H2D, 3), Transfer("m", Direction.H2D, 2)),
    )
    rejected(plan, "prefetch 1", "'m'", "cannot start before step 3", "step 3 (run 'B3')", "deadlock")
    # The same plan with the list in issue order is fine.
    ok = dataclasses.replace(plan, prefetches=tuple(reversed(plan.prefetches)))
    validate_plan(GRAPH, ok)


def test_plain_string_enums_behave_like_the_enums():
    """A plan read back from JSON may carry plain strings; validation and simulation must not care."""
    from slackswap.simulate import simulate
    from slackswap.testing import toy_hardware

    rng = random.Random(3)
    graph = random_graph(rng, max_layers=5)
    plan = random_valid_plan(graph, rng)
    plain = Plan(
        plan.planner,
        None,
        {k: str(v) for k, v in plan.decisions.items()},
        tuple(ComputeStep(s.op, str(s.kind), s.outputs) for s in plan.steps),
        tuple(Transfer(t.tensor, str(t.direction), t.issue_after_step) for t in plan.offloads),
        tuple(Transfer(t.tensor, str(t.direction), t.issue_after_step) for t in plan.prefetches),
    )
    assert type(plain.steps[0].kind) is str
    assert simulate(graph, plain, toy_hardware(), None) == simulate(graph, plan, toy_hardware(), None)
    kept = next(t for t, d in plain.decisions.items() if d == "keep")
    bad = dataclasses.replace(plain, decisions={**plain.decisions, kept: "recompute"})
    with pytest.raises(PlanValidationError, match=f"recompute tensor '{kept}'"):
        validate_plan(graph, bad)
