"""The planners' replay and the simulator share their rules (slackswap.schedule) and must agree exactly.

Whenever a plan never waits for memory (no budget, or a budget at the replay's peak), step time and
peak of `estimate_plan` and `simulate` are equal, to the bit, over random graphs, random plans (from
build_schedule and with transfers at random valid positions) and 1-3 copy engines per direction, on
plain graphs and on graphs with views and random (dropout-like) ops.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from slackswap.plan import ComputeStep, Decision, Direction, Plan, StepKind, Transfer
from slackswap.schedule import CopyQueue, build_schedule, estimate_plan
from slackswap.simulate import simulate
from slackswap.testing import bwd, fwd, make_graph, random_decisions, random_graph, random_valid_plan, toy_hardware


def _assert_agree(graph, plan, hw) -> None:
    est = estimate_plan(graph, plan, hw)
    free = simulate(graph, plan, hw, None)
    assert free.stall_memory_s == 0.0
    assert (est.step_s, est.peak_bytes) == (free.step_s, free.peak_activation_bytes)
    assert est.stall_s == free.stall_prefetch_s
    tight = simulate(graph, plan, hw, max(est.peak_bytes, 1))
    assert tight.feasible and tight.stall_memory_s == 0.0
    assert (tight.step_s, tight.peak_activation_bytes) == (free.step_s, free.peak_activation_bytes)


@settings(max_examples=150, deadline=None)
@given(
    st.randoms(use_true_random=False),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from(["alap", "layer_ahead", "random"]),
    st.booleans(),
)
def test_replay_equals_simulator_on_random_plans_with_1_to_3_engines(rng, d2h_engines, h2d_engines, source, real):
    graph = random_graph(rng, max_layers=6, real_program=real)
    hw = toy_hardware(
        d2h_bytes_per_s=rng.choice([50.0, 500.0, 5000.0]),
        h2d_bytes_per_s=rng.choice([50.0, 500.0, 5000.0]),
        latency_s=rng.choice([0.0, 0.1]),
        d2h_engines=d2h_engines,
        h2d_engines=h2d_engines,
    )
    if source == "random":
        plan = random_valid_plan(graph, rng)
    else:
        plan = build_schedule(graph, random_decisions(graph, rng), planner="t", budget_bytes=None, hardware=hw,
                              prefetch=source)
    _assert_agree(graph, plan, hw)


def test_replay_equals_simulator_on_many_seeded_plans():
    """A fixed sweep like the one that found the drift: 300 plans, each engine count."""
    differences = 0
    for seed in range(100):
        rng = random.Random(seed)
        graph = random_graph(rng, max_layers=8, real_program=seed % 2 == 1)
        decisions = {t.name: Decision.SWAP if rng.random() < 0.7 else Decision.KEEP for t in graph.saved_tensors}
        for engines in (1, 2, 3):
            hw = toy_hardware(d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0, latency_s=0.05,
                              d2h_engines=engines, h2d_engines=engines)
            plan = build_schedule(graph, decisions, planner="t", budget_bytes=None, hardware=hw)
            est = estimate_plan(graph, plan, hw)
            sim = simulate(graph, plan, hw, None)
            differences += (est.step_s, est.peak_bytes) != (sim.step_s, sim.peak_activation_bytes)
    assert differences == 0


def test_a_later_prefetch_never_starts_before_an_earlier_one_on_two_engines():
    """Hand-worked: prefetch of `a` waits for its (slow) offload; `b`'s host copy is ready earlier.

    d2h: offload a (size 100, 2 engines at 100 B/s: 100*2/100 = 2 s) at t=1..3 and offload b (size 10:
    0.2 s) at t=1..1.2 on the second engine. Prefetch list (a, b), both issued after step 1 (t=2).
    In order: a starts at 3 (its offload ends), so b may not start before 3 although an engine is
    free and b's host copy exists since 1.2. b ends 3.2, a ends 5; step 2 reads both.
    """
    graph = make_graph(
        [
            fwd("f", (), ("a", "b"), 1.0),
            fwd("g", ("a",), ("y",), 1.0),
            bwd("h", ("y", "a", "b"), (), 1.0),
        ],
        {"a": 100, "b": 10, "y": 1},
    )
    plan = Plan(
        planner="hand",
        budget_bytes=None,
        decisions={"a": Decision.SWAP, "b": Decision.SWAP, "y": Decision.KEEP},
        steps=tuple(ComputeStep(op.name, StepKind.RUN, op.outputs) for op in graph.ops),
        offloads=(Transfer("a", Direction.D2H, 0), Transfer("b", Direction.D2H, 0)),
        prefetches=(Transfer("a", Direction.H2D, 1), Transfer("b", Direction.H2D, 1)),
    )
    hw = toy_hardware(d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0, d2h_engines=2, h2d_engines=2)
    est = estimate_plan(graph, plan, hw)
    assert est.prefetch_start_s == (3.0, 3.0)
    assert est.prefetch_end_s == (5.0, 3.2)
    assert est.step_s == 6.0
    sim = simulate(graph, plan, hw, None)
    starts = {e.tensor: e.start_s for e in sim.events if e.stream == "h2d"}
    assert starts == {"a": 3.0, "b": 3.0}
    assert sim.step_s == est.step_s and sim.peak_activation_bytes == est.peak_bytes


def test_copy_queue_serves_in_list_order_on_the_engine_free_first():
    queue = CopyQueue(2)
    assert queue.start(5.0, 1.0) == (5.0, 6.0)
    assert queue.start(0.0, 1.0) == (5.0, 6.0)  # ready earlier, but not before its predecessor started
    assert queue.start(0.0, 1.0) == (6.0, 7.0)  # both engines busy until 6
