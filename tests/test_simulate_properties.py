"""Property tests over random graphs, random valid plans, random links and random budgets."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap.schedule.build import keep_all_plan
from slackswap.simulate import SimResult, resolve_schedule, simulate
from slackswap.testing import random_graph, random_valid_plan, toy_hardware

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scenarios(draw):
    rng = draw(st.randoms(use_true_random=False))
    graph = random_graph(rng, max_layers=draw(st.integers(1, 6)))
    plan = random_valid_plan(graph, rng)
    hw = toy_hardware(
        d2h_bytes_per_s=draw(st.sampled_from([50.0, 100.0, 400.0, 1000.0])),
        h2d_bytes_per_s=draw(st.sampled_from([50.0, 100.0, 400.0, 1000.0])),
        latency_s=draw(st.sampled_from([0.0, 0.125, 0.5])),
        d2h_engines=draw(st.integers(1, 2)),
        h2d_engines=draw(st.integers(1, 2)),
    )
    free = simulate(graph, plan, hw, None)
    fraction = draw(st.sampled_from([None, 0.3, 0.5, 0.7, 0.85, 1.0]))
    budget = None if fraction is None else int(free.peak_activation_bytes * fraction)
    return graph, plan, hw, budget


def producer_end(result: SimResult, copy) -> float:
    stream = "h2d" if copy.source == "prefetch" else "compute"
    return next(e.end_s for e in result.events if e.stream == stream and e.index == copy.source_index)


@SETTINGS
@given(scenarios())
def test_no_two_events_overlap_on_one_stream_or_engine(scenario):
    r = simulate(*scenario)
    lanes: dict[tuple[str, int], list] = {}
    for e in r.events:
        assert e.end_s >= e.start_s >= 0.0
        lanes.setdefault((e.stream, e.engine), []).append(e)
    for events in lanes.values():
        events.sort(key=lambda e: (e.start_s, e.end_s))
        for a, b in zip(events, events[1:], strict=False):
            assert b.start_s >= a.end_s
    compute = r.stream_events("compute")
    assert [e.index for e in compute] == list(range(len(compute)))  # plan order, each step once


@SETTINGS
@given(scenarios())
def test_nothing_starts_before_what_it_needs(scenario):
    graph, plan, hw, budget = scenario
    r = simulate(graph, plan, hw, budget)
    s = resolve_schedule(graph, plan)
    for e in r.events:
        if e.stream == "compute":
            for c in s.step_reads[e.index]:
                assert producer_end(r, s.copies[c]) <= e.start_s
            issue = None
        elif e.stream == "d2h":
            issue = plan.offloads[e.index].issue_after_step
            assert producer_end(r, s.copies[s.offload_copy[e.index]]) <= e.start_s
        else:
            issue = plan.prefetches[e.index].issue_after_step
            off = next(x for x in r.events if x.stream == "d2h" and x.index == s.prefetch_offload[e.index])
            assert off.end_s <= e.start_s
        if issue is not None and issue >= 0:
            assert next(x.end_s for x in r.events if x.stream == "compute" and x.index == issue) <= e.start_s


@SETTINGS
@given(scenarios())
def test_memory_never_exceeds_the_budget_and_returns_to_zero(scenario):
    r = simulate(*scenario)
    budget = scenario[3]
    assert r.peak_activation_bytes == max(r.memory_bytes)
    assert all(b >= 0 for b in r.memory_bytes)
    assert list(r.memory_times_s) == sorted(r.memory_times_s)
    if budget is not None:
        assert r.peak_activation_bytes <= budget
    if r.feasible:
        assert r.memory_bytes[-1] == 0  # every copy is freed by the end of the step
    else:
        assert r.step_s is None and r.infeasibility.needed_bytes + r.infeasibility.in_use_bytes > budget


@SETTINGS
@given(scenarios())
def test_step_time_bounds_and_stall_accounting(scenario):
    r = simulate(*scenario)
    if not r.feasible:
        return
    tol = 1e-9 * max(1.0, r.step_s)
    assert r.step_s >= r.compute_busy_s - tol
    assert r.step_s >= r.d2h_busy_s - tol and r.step_s >= r.h2d_busy_s - tol
    # One compute stream: it is either running a step or stalled until the last step ends.
    assert r.step_s == pytest.approx(r.compute_busy_s + r.stall_s, rel=1e-9, abs=1e-12)
    assert r.stall_prefetch_s >= 0.0 and r.stall_memory_s >= 0.0
    graph = scenario[0]
    assert r.compute_busy_s >= sum(op.duration_s for op in graph.ops) - tol


@SETTINGS
@given(scenarios())
def test_keep_all_equals_ideal(scenario):
    graph, _, hw, _ = scenario
    ideal = simulate(graph, keep_all_plan(graph), hw, None)
    assert ideal.step_s == pytest.approx(sum(op.duration_s for op in graph.ops), rel=1e-12)
    assert ideal.stall_s == 0.0 and not ideal.d2h_bytes and not ideal.recompute_s
    at_peak = simulate(graph, keep_all_plan(graph), hw, ideal.peak_activation_bytes)
    assert at_peak.events == ideal.events and at_peak.memory_bytes == ideal.memory_bytes


@SETTINGS
@given(scenarios())
def test_deterministic(scenario):
    assert simulate(*scenario) == simulate(*scenario)


def test_generator_produces_swaps_recomputes_and_infeasible_budgets():
    """Guard against a generator that silently stops exercising the interesting cases."""
    swaps = recomputes = infeasible = stalls = 0
    for seed in range(200):
        rng = random.Random(seed)
        graph = random_graph(rng, max_layers=5)
        plan = random_valid_plan(graph, rng)
        r = simulate(graph, plan, toy_hardware(d2h_bytes_per_s=200.0, h2d_bytes_per_s=200.0), None)
        swaps += r.swapped_tensors > 0
        recomputes += r.recomputed_tensors > 0
        stalls += r.stall_s > 0
        infeasible += not simulate(graph, plan, toy_hardware(), r.peak_activation_bytes // 2).feasible
    assert min(swaps, recomputes, infeasible, stalls) >= 20
