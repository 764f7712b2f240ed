"""build_schedule: decisions -> explicit schedule. Checked against the simulator, which is the judge."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slackswap.errors import ConfigError
from slackswap.plan import Decision, Direction, StepKind
from slackswap.schedule.build import build_schedule
from slackswap.schedule.replay import estimate_plan
from slackswap.simulate import simulate, validate_plan
from slackswap.testing import bwd, fwd, make_graph, random_decisions, random_graph, toy_hardware

HW = toy_hardware(d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0)
#: make_graph marks gradients read by a later backward op as saved too; keep them.
GRADS = {"gz": "keep", "gy": "keep", "gx": "keep"}


def chain_graph():
    """a -> f1 -> x (saved) -> f2 -> y (not saved) -> f3 -> z (saved); backward reads x and z."""
    specs = [
        fwd("f1", [], ["x", "m"], 1.0),
        fwd("f2", ["x"], ["y"], 1.0),
        fwd("f3", ["y"], ["z"], 2.0),
        fwd("loss", ["z"], ["l"], 1.0),
        bwd("b_loss", ["l"], ["gz"], 1.0),
        bwd("b3", ["gz", "z"], ["gy"], 4.0),
        bwd("b2", ["gy"], ["gx"], 4.0),
        bwd("b1", ["gx", "x", "m"], [], 4.0),
    ]
    return make_graph(specs, {"x": 100, "m": 50, "y": 100, "z": 100, "l": 10, "gz": 100, "gy": 100, "gx": 100})


def test_recompute_chain_regenerates_the_non_saved_input_first_right_before_first_use():
    g = chain_graph()
    dec = {"x": "keep", "m": "keep", "z": "recompute", "l": "keep", **GRADS}
    plan = build_schedule(g, dec, planner="t", budget_bytes=None, hardware=HW)
    validate_plan(g, plan)
    names = [(s.op, s.kind) for s in plan.steps]
    i = names.index(("b3", StepKind.RUN))
    # y is not saved (its forward copy is gone), so f2 is re-run before f3, both right before b3.
    assert names[i - 2 : i] == [("f2", StepKind.RECOMPUTE), ("f3", StepKind.RECOMPUTE)]
    assert plan.steps[i - 1].outputs == ("z",)


def test_multi_output_producer_is_recomputed_once_for_all_its_recomputed_outputs():
    g = chain_graph()
    dec = {"x": "recompute", "m": "recompute", "z": "keep", "l": "keep", **GRADS}
    plan = build_schedule(g, dec, planner="t", budget_bytes=None, hardware=HW)
    validate_plan(g, plan)
    recomputes = [s for s in plan.steps if s.kind == StepKind.RECOMPUTE]
    assert [(s.op, s.outputs) for s in recomputes] == [("f1", ("x", "m"))]


def test_offload_after_producer_and_prefetch_hides_as_late_as_possible():
    g = chain_graph()
    dec = {"x": "swap", "m": "keep", "z": "keep", "l": "keep", **GRADS}
    plan = build_schedule(g, dec, planner="t", budget_bytes=None, hardware=HW)
    (off,) = plan.offloads
    (pre,) = plan.prefetches
    assert off.direction == Direction.D2H and plan.steps[off.issue_after_step].op == "f1"
    first_use = [s.op for s in plan.steps].index("b1")
    assert pre.direction == Direction.H2D and pre.issue_after_step < first_use
    result = simulate(g, plan, HW, None)
    assert result.stall_prefetch_s == 0.0  # x (1 s of copy) hides under b2 (4 s)
    # As late as possible: x needs 1 s of copy; b2 (4 s) is the last step before b1, so issuing after
    # b3 (the step before b2) is the latest issue that still hides.
    assert plan.steps[pre.issue_after_step].op == "b3"


def test_layer_ahead_policy_issues_at_the_start_of_the_next_layer_backward():
    specs = [
        fwd("f0", [], ["a0"], 1.0, layer=0),
        fwd("f1", ["a0"], ["a1"], 1.0, layer=1),
        fwd("loss", ["a1"], ["l"], 1.0, layer=1),
        bwd("b1", ["l", "a1"], ["g1"], 2.0, layer=1),
        bwd("b0", ["g1", "a0"], [], 2.0, layer=0),
    ]
    g = make_graph(specs, {"a0": 10, "a1": 10, "l": 1, "g1": 10})
    plan = build_schedule(g, {"a0": "swap", "a1": "keep", "l": "keep", "g1": "keep"}, planner="t", budget_bytes=None,
                          hardware=HW, prefetch="layer_ahead")
    (pre,) = plan.prefetches
    assert plan.steps[pre.issue_after_step].op == "loss"  # just before b1, the first backward op of layer 1
    validate_plan(g, plan)


@pytest.mark.parametrize(
    ("decisions", "match"),
    [
        ({"x": "keep", "m": "keep", "z": "keep"}, "have no decision"),
        ({"x": "keep", "m": "keep", "z": "keep", "l": "keep", "nope": "keep", **GRADS},
         "neither a saved tensor nor a checkpoint candidate"),
        # y: a forward tensor autograd does not save (a checkpoint candidate): keep or swap, never recompute
        ({"x": "keep", "m": "keep", "z": "keep", "l": "keep", "y": "recompute", **GRADS}, "a checkpoint candidate"),
        ({"x": "drop", "m": "keep", "z": "keep", "l": "keep", **GRADS}, "must be one of"),
        ({"x": "keep", "m": "keep", "z": "keep", "l": "keep", **GRADS, "gy": "recompute"}, "only forward tensors"),
    ],
)
def test_bad_decisions_are_rejected_naming_the_tensor(decisions, match):
    with pytest.raises(ConfigError, match=match):
        build_schedule(chain_graph(), decisions, planner="t", budget_bytes=None, hardware=HW)


def test_unknown_prefetch_policy_is_rejected():
    with pytest.raises(ConfigError, match="prefetch"):
        build_schedule(chain_graph(), {"x": "keep", "m": "keep", "z": "keep", "l": "keep", **GRADS}, planner="t",
                       budget_bytes=None, hardware=HW, prefetch="eager")


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from(["alap", "layer_ahead"]))
def test_any_decisions_give_a_valid_schedule_whose_timeline_matches_the_simulator(rng, policy):
    g = random_graph(rng)
    dec = random_decisions(g, rng)
    hw = toy_hardware(d2h_bytes_per_s=rng.choice([50.0, 500.0]), h2d_bytes_per_s=rng.choice([50.0, 500.0]),
                      latency_s=rng.choice([0.0, 0.1]))
    plan = build_schedule(g, dec, planner="t", budget_bytes=None, hardware=hw, prefetch=policy)
    validate_plan(g, plan)
    assert dict(plan.decisions) == {t: Decision(d) for t, d in dec.items()}
    assert sorted(t.tensor for t in plan.offloads) == sorted(plan.tensors_with(Decision.SWAP))
    issue = [t.issue_after_step for t in plan.prefetches]
    assert issue == sorted(issue)
    est = estimate_plan(g, plan, hw)
    sim = simulate(g, plan, hw, None)
    assert est.peak_bytes == sim.peak_activation_bytes
    assert est.step_s == pytest.approx(sim.step_s, rel=1e-12, abs=1e-12)
    # Under a budget equal to the estimated peak, the simulator never waits for memory.
    tight = simulate(g, plan, hw, max(est.peak_bytes, 1))
    assert tight.feasible and tight.stall_memory_s == 0.0


def test_seeded_random_graphs_also_cover_larger_shapes():
    rng = random.Random(7)
    for _ in range(5):
        g = random_graph(rng, max_layers=8)
        plan = build_schedule(g, random_decisions(g, rng), planner="t", budget_bytes=None, hardware=HW)
        validate_plan(g, plan)
