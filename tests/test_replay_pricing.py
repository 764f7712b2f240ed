"""A plan's recompute steps priced at their ops' replay times measured in the model's own profiling steps
(`OpTimeTable.replay_times`, `slackswap.experiment.prediction.runtime_host_counts`), the microbenchmark's
a + b x calls for an op without one, both counted; the replay times round-trip with the table (a table
cached without them is refused, never read as zeros: tests/test_copy_pricing.py, with the copy times).
Core only (no torch): the measuring is tests/test_measured_torch.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from slackswap.experiment.measured_prediction import HostCosts, predict_measured
from slackswap.experiment.prediction import RuntimeHostCounts, predict_step, runtime_host_counts
from slackswap.plan import Decision
from slackswap.profile.measured import (
    OpTimeTable,
    RuntimeHostCost,
    load_table,
    replay_refusal,
    save_table,
)
from slackswap.testing import schedule_from_decisions, toy_hardware
from tests.test_measured_profile import _graph, _hooked_graph, _machine, _table

HOST = RuntimeHostCost(hook_per_event_s=1e-3, replay_per_step_s=1e-2, replay_per_call_s=1e-1,
                       recompute_hook_per_event_s=1e-3, source="test")
MM, RELU = "op0:aten.mm.default", "op3:aten.relu.default"


def _recompute_both():
    """`_hooked_graph` (op0 mm 1 s, its 3 calls op0..op2; op3 relu 2 s, 1 call; 2 packs + 3 unpacks) with
    both forward outputs recomputed: one recompute step of op3, one of op0."""
    g = _hooked_graph()
    return g, schedule_from_decisions(g, {"a": Decision.RECOMPUTE, "b": Decision.RECOMPUTE, "gb": Decision.KEEP})


def test_a_recompute_step_costs_its_ops_replay_time_less_the_op_time_the_simulator_counts():
    g, plan = _recompute_both()
    # op0 replayed in 1.5 s where its forward took 1 s: 0.5 s beyond the op time the simulator gives the
    # recompute. op3 has no replay time: 1e-2 per step + 1e-1 x its 1 call, from the microbenchmark.
    counts = runtime_host_counts(g, plan, {MM: 1.5})
    assert counts == RuntimeHostCounts(0, 1, 1, 0, replay_timed_steps=1, replay_timed_excess_s=pytest.approx(0.5),
                                       recompute_events=5, module_checks=4)  # a and b recomputed: their 5 events
    assert counts.seconds(HOST) == pytest.approx(5e-3 + 0.5 + 1e-2 + 1e-1)
    p = predict_step(g, plan, toy_hardware(), _machine(True), HOST, {MM: 1.5})
    assert p.runtime_host_s == pytest.approx(5e-3 + 0.5 + 1e-2 + 1e-1)
    assert p.step_s == pytest.approx(p.simulated_s + 5e-3 + 0.5 + 1e-2 + 1e-1)
    assert (p.replay_timed_steps, p.replay_fallback_steps) == (1, 1)
    # Both timed: no microbenchmark term for a replay; a replay cheaper than the op's forward (0.5 s for a
    # 2 s relu: the forward's time held module code the replay does not run) takes time off.
    both = predict_step(g, plan, toy_hardware(), _machine(True), HOST, {MM: 1.5, RELU: 0.5})
    assert both.runtime_host_s == pytest.approx(5e-3 + 0.5 - 1.5)
    assert (both.replay_timed_steps, both.replay_fallback_steps) == (2, 0)


def test_without_replay_times_every_recompute_step_falls_back_to_the_microbenchmark_and_is_counted():
    g, plan = _recompute_both()
    # op0's step replays 3 calls, op3's 1: 2 steps, 4 calls.
    for replays in (None, {}, {"op6:aten.mm.default": 9.0}):  # none measured, or only for an op not recomputed
        p = predict_step(g, plan, toy_hardware(), _machine(True), HOST, replays)
        assert p.runtime_host_s == pytest.approx(5e-3 + 2 * 1e-2 + 4 * 1e-1)
        assert (p.replay_timed_steps, p.replay_fallback_steps) == (0, 2)


def test_nothing_is_added_where_the_host_work_overlaps_the_device():
    g, plan = _recompute_both()
    p = predict_step(g, plan, toy_hardware(), _machine(False), HOST, {MM: 1.5, RELU: 0.5})
    assert p.runtime_host_s == 0.0 and p.step_s == p.simulated_s
    assert (p.replay_timed_steps, p.replay_fallback_steps) == (0, 0)


def test_the_prediction_says_how_many_recompute_steps_each_source_priced():
    from pipelines.measured_console import comparison_line

    g, plan = _recompute_both()
    costs = HostCosts(HOST, replay_times={MM: 1.5})
    f = predict_measured(g, plan, toy_hardware(), _machine(True), costs).figures
    assert (f["replay_timed_steps"], f["replay_fallback_steps"], f["replay_times_measured"]) == (1, 1, True)
    line = comparison_line(f | {"predicted_step_s": 1.0, "predicted_sync_copy_s": 0.0, "measured_step_median_s": 1.0,
                                "measured_steps_compared": 2, "measured_step_min_s": 1.0, "measured_step_max_s": 1.0,
                                "step_relative_error": 0.0, "machine_synchronous_copies": True})
    assert ("runtime host work (1 recompute steps at their ops' measured replay times, 1 at the "
            "microbenchmark's)") in line
    assert "replay times of 1 ops measured in the model's own profiling steps" in costs.line()
    bare = predict_measured(g, plan, toy_hardware(), _machine(True), HostCosts(HOST)).figures
    assert bare["replay_times_measured"] is False and bare["replay_fallback_steps"] == 2


def test_replay_times_round_trip_with_the_table_and_are_taken_from_it(tmp_path):
    g = _graph()
    table = replace(_table(g, {"f1": 0.1, "f2": 0.2, "b2": 0.3, "b1": 0.4}), replay_times={"f1": 0.15, "f2": 0.3})
    save_table(table, tmp_path)
    loaded = load_table(table.key, tmp_path)
    assert loaded == table and dict(loaded.replay_times) == {"f1": 0.15, "f2": 0.3}
    assert replay_refusal(loaded) is None and HostCosts.of(loaded).replay_times == {"f1": 0.15, "f2": 0.3}
    # Measured with none replayed (the plan's hook-only program refused the model) is not "not measured".
    empty = OpTimeTable.from_dict(json.loads(json.dumps(replace(table, replay_times={}).to_dict())))
    assert empty.replay_times == {} and replay_refusal(empty) is None
    # Attaching the machine's host costs keeps the table's own replay times.
    assert HostCosts(HOST).attach(loaded).replay_times == loaded.replay_times
