"""A plan's synchronous CPU copies priced at each tensor's copies timed in the model's own profiling steps
(`OpTimeTable.copy_times`, `slackswap.experiment.prediction.predict_step`), the machine description's copy
curve for a tensor without them, both counted; the copy times round-trip with the table, and a table
cached without them is refused, never read as zeros. Core only (no torch): the measuring is
tests/test_measured_torch.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from slackswap.experiment.measured_prediction import HostCosts, predict_measured
from slackswap.experiment.prediction import predict_step
from slackswap.plan import Decision
from slackswap.profile.measured import (
    OpTimeTable,
    copy_refusal,
    load_table,
    replay_refusal,
    reuse_refusal,
    save_table,
)
from slackswap.testing import schedule_from_decisions, toy_hardware
from tests.test_measured_profile import _graph, _machine, _table


def _swap_both():
    """`_graph` (a: 100 bytes, b: 200, both read in backward) with both forward outputs swapped."""
    g = _graph()
    return g, schedule_from_decisions(g, {"a": Decision.SWAP, "b": Decision.SWAP, "gb": Decision.KEEP})


def test_a_tensors_copies_cost_its_copy_times_and_any_other_tensors_the_curve():
    g, plan = _swap_both()
    # a's offload 0.25 s and prefetch 0.5 s as timed in the step; b has none: 200 bytes out and back on
    # `_machine`'s curve (1e-6 s + bytes at 100 B/s each way).
    p = predict_step(g, plan, toy_hardware(), _machine(True), copy_times={"a": (0.25, 0.5)})
    assert p.sync_copy_s == pytest.approx(0.25 + 0.5 + 2 * (1e-6 + 2.0))
    assert p.step_s == pytest.approx(p.simulated_s + p.sync_copy_s)
    assert (p.copy_timed, p.copy_curve, p.copies) == (2, 2, 4)
    # Without copy times every copy is on the curve, as before they were timed.
    for times in (None, {}, {"gb": (9.0, 9.0)}):  # none measured, or only for a tensor not swapped
        bare = predict_step(g, plan, toy_hardware(), _machine(True), copy_times=times)
        assert bare.sync_copy_s == pytest.approx(2 * (1e-6 + 1.0) + 2 * (1e-6 + 2.0))
        assert (bare.copy_timed, bare.copy_curve) == (0, 4)


def test_nothing_is_added_where_copies_overlap_the_device():
    g, plan = _swap_both()
    p = predict_step(g, plan, toy_hardware(), _machine(False), copy_times={"a": (0.25, 0.5)})
    assert p.sync_copy_s == 0.0 and p.step_s == p.simulated_s and (p.copy_timed, p.copy_curve) == (0, 0)


def test_the_prediction_says_how_many_copies_each_source_priced():
    from pipelines.measured_console import comparison_line

    g, plan = _swap_both()
    costs = HostCosts(copy_times={"b": (0.1, 0.2)})
    f = predict_measured(g, plan, toy_hardware(), _machine(True), costs).figures
    assert (f["copies_at_copy_times"], f["copies_by_curve"], f["copy_times_measured"]) == (2, 2, True)
    measured = {"predicted_step_s": 1.0, "predicted_sync_copy_s": 0.3, "measured_step_median_s": 1.0,
                "measured_steps_compared": 2, "measured_step_min_s": 1.0, "measured_step_max_s": 1.0,
                "step_relative_error": 0.0, "machine_synchronous_copies": True}
    line = comparison_line(f | measured)
    assert "+ 300.00 ms synchronous copies (2 at their tensors' measured copy times, 2 by the copy curve)" in line
    assert "copy times of 1 tensors measured in the model's own profiling steps" in costs.line()
    bare = predict_measured(g, plan, toy_hardware(), _machine(True), HostCosts()).figures
    assert bare["copy_times_measured"] is False and bare["copies_by_curve"] == 4
    assert "+ 300.00 ms synchronous copies) vs measured" in comparison_line(bare | measured)  # no count to give


def test_copy_times_round_trip_with_the_table_and_are_taken_from_it(tmp_path):
    g = _graph()
    table = replace(_table(g, {"f1": 0.1, "f2": 0.2, "b2": 0.3, "b1": 0.4}), copy_times={"a": (1e-6, 2e-6)})
    save_table(table, tmp_path)
    loaded = load_table(table.key, tmp_path)
    assert loaded == table and dict(loaded.copy_times) == {"a": (1e-6, 2e-6)}
    assert copy_refusal(loaded) is None and HostCosts.of(loaded).copy_times == {"a": (1e-6, 2e-6)}
    # Measured with none offloaded (the plan's hook-only program refused the model) is not "not measured".
    empty = OpTimeTable.from_dict(json.loads(json.dumps(replace(table, copy_times={}).to_dict())))
    assert empty.copy_times == {} and copy_refusal(empty) is None
    assert HostCosts().attach(loaded).copy_times == loaded.copy_times  # the machine's costs keep the table's


@pytest.mark.parametrize("field, value, refusal, what", [
    ("replay_times", {"f1": 0.15}, replay_refusal, "replay times of its ops"),
    ("copy_times", {"a": (1e-6, 2e-6)}, copy_refusal, "copy times of its tensors"),
])
def test_a_table_cached_before_a_field_was_measured_is_refused_in_one_line_never_read_as_zeros(field, value, refusal,
                                                                                               what):
    g = _graph()
    table = replace(_table(g, {"f1": 0.1, "f2": 0.2, "b2": 0.3, "b1": 0.4}), notes={"load_average_1min": 0.2,
                                                                                   "cpu_count": 2}, **{field: value})
    stored = table.to_dict()
    del stored[field]  # as a table written before the field existed
    old = OpTimeTable.from_dict(stored)
    assert getattr(old, field) is None and old.times == table.times
    assert reuse_refusal(old) is None  # its load and sum are fine: only the missing field refuses it
    assert refusal(old) == f"cached op-time table {table.key.digest()} has no {what}: measuring it again"
    assert refusal(table) is None
