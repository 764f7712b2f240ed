"""One copy resolver feeds every executor: the simulator's engine, the planners' replay and the
allocator replay free a copy at the same instant, from the same facts (`slackswap.schedule.copies`).

The graphs are real programs (`random_graph(real_program=True, in_place=True)`): views that share a
base's storage, in-place writes, random (dropout-like) ops whose recompute replays an RNG state.
Before the allocator replay took `copy_last_use` from the resolver it freed a base storage while a
view of it was still read (on such graphs 59 of 229 plans replayed a lower peak than the simulator).
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap.memory.allocator_replay import allocator_report, memory_ops
from slackswap.schedule import estimate_plan, resolve_schedule
from slackswap.simulate import simulate
from slackswap.testing import (
    aliasing_graph,
    bwd,
    fwd,
    make_graph,
    random_graph,
    random_valid_plan,
    schedule_from_decisions,
    toy_hardware,
)

MiB = 1 << 20
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _hardware(rng: random.Random):
    return toy_hardware(
        d2h_bytes_per_s=rng.choice([1e6, 1e8, 1e10]),
        h2d_bytes_per_s=rng.choice([1e6, 1e8, 1e10]),
        latency_s=rng.choice([0.0, 1e-4]),
        d2h_engines=rng.randint(1, 2),
        h2d_engines=rng.randint(1, 2),
    )


@SETTINGS
@given(st.randoms(use_true_random=False), st.sampled_from([None, 0.5, 0.8, 1.0]))
def test_allocator_replay_peak_equals_the_simulator_peak_on_real_programs(rng, fraction):
    graph = random_graph(rng, max_layers=5, max_size_bytes=8 * MiB, real_program=True, in_place=True,
                         held=rng.random() < 0.5)
    plan = random_valid_plan(graph, rng)
    hw = _hardware(rng)
    free = simulate(graph, plan, hw, None)
    budget = None if fraction is None else max(1, int(free.peak_activation_bytes * fraction))
    result = simulate(graph, plan, hw, budget)
    report = allocator_report(graph, plan, result, budget)
    assert report.peak_allocated_bytes == result.peak_activation_bytes
    # Live bytes after every instant equal the engine's memory curve at that instant.
    engine_at = dict(zip(result.memory_times_s, result.memory_bytes, strict=True))
    live = 0
    replay_at: dict[float, int] = {}
    for op in memory_ops(graph, plan, result):
        live += op.size_bytes if op.alloc else -op.size_bytes
        replay_at[op.time_s] = live
    assert all(engine_at[t] == v for t, v in replay_at.items())
    if result.feasible:
        assert live == result.memory_bytes[-1]


@SETTINGS
@given(st.randoms(use_true_random=False))
def test_planners_replay_equals_the_simulator_on_real_programs(rng):
    graph = random_graph(rng, max_layers=6, real_program=True, in_place=True, held=rng.random() < 0.5)
    plan = random_valid_plan(graph, rng)
    hw = _hardware(rng)
    est = estimate_plan(graph, plan, hw)
    sim = simulate(graph, plan, hw, None)
    assert (est.step_s, est.peak_bytes) == (sim.step_s, sim.peak_activation_bytes)


def test_a_view_still_read_keeps_its_base_alive_in_the_allocator_replay():
    """aliasing_graph: q, k, v are views of qkv (300 B). Keep all: q and k are read by scores_bwd, late
    in backward, so the 300 B storage of qkv lives until then although qkv itself is last read by
    `split`. The allocator replay must free qkv when scores_bwd ends, as the engine does."""
    graph = aliasing_graph()
    plan = schedule_from_decisions(graph, {t.name: "keep" for t in graph.saved_tensors})
    hw = toy_hardware()
    result = simulate(graph, plan, hw, None)
    s = resolve_schedule(graph, plan)
    qkv = next(c for c in s.copies if c.tensor == "qkv")
    scores_bwd = next(j for j, step in enumerate(plan.steps) if step.op == "scores_bwd")
    assert qkv.readers == (plan.steps.index(next(st for st in plan.steps if st.op == "split")),)
    assert qkv.last_use == scores_bwd
    frees = {op.tensor: op.time_s for op in memory_ops(graph, plan, result) if not op.alloc}
    scores_bwd_end = next(e.end_s for e in result.events if e.stream == "compute" and e.index == scores_bwd)
    assert frees["qkv"] == scores_bwd_end
    assert allocator_report(graph, plan, result, None).peak_allocated_bytes == result.peak_activation_bytes


def test_the_resolved_facts_are_built_once():
    graph = aliasing_graph()
    plan = random_valid_plan(graph, random.Random(3))
    s = resolve_schedule(graph, plan)
    assert s.copies is s.copies
    assert s.released_after is s.released_after and s.offload_waiters is s.offload_waiters
    for c, copy in enumerate(s.copies):
        assert copy.last_use == s.copy_last_use[c] and copy.wait_offloads == s.copy_wait_offloads[c]
    # offload_waiters is the inverse of copy_wait_offloads.
    for k, waiting in enumerate(s.offload_waiters):
        assert all(k in s.copy_wait_offloads[c] for c in waiting)
    assert sum(map(len, s.offload_waiters)) == sum(map(len, s.copy_wait_offloads))


def _held_chain(held_until: dict[str, str]):
    """a (100 B) -> b (10 B) -> c (1000 B) -> loss; backward reads only b. `a` dies with its reader `f1`
    unless the model's code holds it."""
    specs = [fwd("f0", (), ("a",), 1.0), fwd("f1", ("a",), ("b",), 1.0), fwd("f2", ("b",), ("c",), 1.0),
             fwd("f3", ("c",), ("loss",), 1.0), bwd("b0", ("loss", "b"), (), 1.0)]
    return make_graph(specs, {"a": 100, "b": 10, "c": 1000, "loss": 1}, held_until=held_until)


def test_a_tensor_the_model_still_references_lives_until_its_hold():
    """Worked by hand. Without a hold, `a` is freed when f1 ends: the peak is at f3, b + c + loss =
    1011 B. Held until f2, `a` is alive through f2: 100 + 10 + 1000 = 1110 B. Every executor agrees."""
    hw = toy_hardware()
    for holds, peak in (({}, 1011), ({"a": "f2"}, 1110), ({"a": "f1"}, 1011)):
        graph = _held_chain(holds)
        plan = schedule_from_decisions(graph, {"b": "keep", "loss": "keep"})
        result = simulate(graph, plan, hw, None)
        assert result.peak_activation_bytes == peak
        assert estimate_plan(graph, plan, hw).peak_bytes == peak
        assert allocator_report(graph, plan, result, None).peak_allocated_bytes == peak
        a = next(c for c in resolve_schedule(graph, plan).copies if c.tensor == "a")
        assert a.readers == (1,) and a.last_use == (2 if holds.get("a") == "f2" else 1)
    # A budget below the held peak is infeasible (the hold is a fact of the workload, not a plan choice).
    held = _held_chain({"a": "f2"})
    assert not simulate(held, schedule_from_decisions(held, {"b": "keep", "loss": "keep"}), hw, 1109).feasible
