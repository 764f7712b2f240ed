"""Cross-check the engine against an independent SimPy model of the same schedule semantics
(`tests/simpy_model.py`, which is also the speed peer of `benchmarks/bench_simulate.py`)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap.simulate import simulate
from slackswap.testing import random_graph, random_valid_plan, toy_hardware
from tests.simpy_model import simpy_model


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rng=st.randoms(use_true_random=False),
    layers=st.integers(1, 5),
    bw=st.sampled_from([(100.0, 100.0), (50.0, 400.0), (1000.0, 200.0)]),
    latency=st.sampled_from([0.0, 0.25]),
    engines=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]),
    fraction=st.sampled_from([None, 0.4, 0.6, 0.8, 1.0]),
)
def test_engine_matches_simpy_model(rng, layers, bw, latency, engines, fraction):
    graph = random_graph(rng, max_layers=layers)
    plan = random_valid_plan(graph, rng)
    hw = toy_hardware(bw[0], bw[1], latency, engines[0], engines[1])
    budget = None if fraction is None else int(simulate(graph, plan, hw, None).peak_activation_bytes * fraction)
    result = simulate(graph, plan, hw, budget)
    feasible, events, peak = simpy_model(graph, plan, hw, budget)
    assert result.feasible == feasible
    assert result.peak_activation_bytes == peak
    ours = {(e.stream, e.index): (e.start_s, e.end_s) for e in result.events}
    assert ours.keys() == events.keys()
    for key, (start, end) in events.items():
        assert ours[key] == pytest.approx((start, end), rel=1e-12, abs=1e-12), key
    if feasible:
        assert result.step_s == pytest.approx(max(end for _, end in events.values()), rel=1e-12)
