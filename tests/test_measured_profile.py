"""Measured op times (slackswap.profile.measured), the measured machine (slackswap.profile.machine) and
the prediction on it: the table round-trips, a version or shape change misses the cache, an op the
table lacks keeps its roofline time and is counted. Core only (no torch); the measuring itself is
tests/test_measured_torch.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from slackswap.errors import ConfigError
from slackswap.experiment.measured_timing import MeasuredTiming
from slackswap.experiment.prediction import compare_steps, predict_step, runtime_host_counts
from slackswap.plan import Decision
from slackswap.profile.machine import Machine, fit_link, machine_description
from slackswap.profile.measured import (
    ExportHostCost,
    MeasurementError,
    OpTime,
    OpTimeKey,
    OpTimeTable,
    load_table,
    retime,
    save_table,
    table_path,
)
from slackswap.testing import bwd, fwd, make_graph, schedule_from_decisions, toy_hardware


def _graph():
    return make_graph([fwd("f1", [], ["a"], 1.0), fwd("f2", ["a"], ["b"], 2.0), bwd("b2", ["b"], ["gb"], 3.0),
                       bwd("b1", ["a", "gb"], ["ga"], 4.0)], {"a": 100, "b": 200, "gb": 200, "ga": 100})


def _key(graph, **change) -> OpTimeKey:
    fields = dict(graph_fingerprint=graph.fingerprint, model_signature="m0",
                  input_signature=(((2, 16), "torch.int64"),),
                  device="cpu", versions={"torch": "2.13.0", "transformers": "5.0"}, method="perf_counter",
                  intra_op_threads=2)
    return OpTimeKey(**(fields | change))


def _table(graph, times: dict[str, float], **change) -> OpTimeTable:
    return OpTimeTable(key=_key(graph, **change), times={n: OpTime(t, t * 0.9, t * 1.2, 5) for n, t in times.items()},
                       warmup=2, repeats=5, step_median_s=sum(times.values()), step_min_s=0.0, step_max_s=1.0,
                       failed=("op9:aten.x.default: failed alone",), notes={"aten_calls": 4})


def test_table_round_trips_through_the_cache(tmp_path):
    g = _graph()
    table = _table(g, {"f1": 0.1, "f2": 0.2, "b2": 0.3, "b1": 0.4})
    table = replace(table, export_host=ExportHostCost(2.1e-5, 2e-4, 1.5e-5, "dispatch_cost: 4 blocks"))
    path = save_table(table, tmp_path)
    assert path == table_path(table.key, tmp_path) and path.is_file()
    loaded = load_table(_key(g), tmp_path)
    assert loaded == table
    assert loaded.times["b1"].max_s == pytest.approx(0.48)


@pytest.mark.parametrize("change", [
    {"versions": {"torch": "2.14.0", "transformers": "5.0"}},   # another torch
    {"input_signature": (((4, 16), "torch.int64"),)},            # another micro-batch
    {"device": "cuda:0 NVIDIA H200"},                             # another device
    {"graph_fingerprint": "0" * 16},                              # another graph
    {"intra_op_threads": 1},                                      # torch on another thread count
    {"host_allocator": "glibc 2.36, freed memory kept (...)"},    # freed host memory kept, or not
])
def test_a_version_shape_or_device_change_misses_the_cache(tmp_path, change):
    g = _graph()
    save_table(_table(g, {"f1": 0.1}), tmp_path)
    assert load_table(_key(g, **change), tmp_path) is None
    assert load_table(_key(g), tmp_path) is not None


def test_a_file_whose_stored_key_differs_is_not_used(tmp_path):
    g = _graph()
    path = save_table(_table(g, {"f1": 0.1}), tmp_path)
    data = json.loads(path.read_text())
    data["key"]["versions"]["torch"] = "1.0"  # the file under this digest says another version
    path.write_text(json.dumps(data))
    assert load_table(_key(g), tmp_path) is None
    path.write_text("{not json")
    assert load_table(_key(g), tmp_path) is None


def test_missing_ops_fall_back_to_the_roofline_with_a_count():
    g = _graph()
    retimed, sources = retime(g, _table(g, {"f1": 0.1, "b1": 0.4}))
    assert (sources.measured, sources.roofline) == (2, 2)
    assert sources.roofline_ops == ("f2", "b2")
    assert [op.duration_s for op in retimed.ops] == [0.1, 2.0, 3.0, 0.4]
    assert retimed.fingerprint == g.fingerprint and retimed.meta["timing"] == "measured"
    assert "2 measured, 2 roofline fallback (f2, b2)" in sources.line()


def test_a_table_of_another_graph_is_refused():
    g = _graph()
    other = _table(g, {"f1": 0.1}, graph_fingerprint="feedfacefeedface")
    with pytest.raises(MeasurementError, match="feedfacefeedface"):
        retime(g, other)


def test_link_fit_recovers_latency_and_bandwidth():
    fit = fit_link([(s, 2e-6 + s / 5e9) for s in (4096, 65536, 1 << 20, 1 << 24)])
    assert fit.latency_s == pytest.approx(2e-6, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(5e9, rel=1e-6)


def _machine(synchronous: bool) -> Machine:
    rows = [{"direction": d, "host_memory": "pageable", "size_bytes": s, "median_s": 1e-6 + s / bw}
            for d, bw in (("h2d", 100.0), ("d2h", 100.0), ("both", 50.0)) for s in (100, 1000)]
    return Machine.from_dict(machine_description("t", "cpu", synchronous, rows, [], ["pinned: no accelerator"], "test"))


def test_machine_description_loads_and_interpolates_copies():
    m = _machine(True)
    assert m.synchronous and m.link.d2h_effective_bytes_per_s == pytest.approx(100.0)
    assert m.copy_s("d2h", 550) == pytest.approx(1e-6 + 5.5)      # between the measured sizes
    assert m.copy_s("h2d", 2000) == pytest.approx(1e-6 + 20.0)    # beyond: the last segment's slope
    assert m.node["h2d_duplex_fraction"] == pytest.approx(0.5)


def test_synchronous_copies_add_to_the_predicted_step():
    g = _graph()
    plan = schedule_from_decisions(g, {"a": Decision.SWAP, "b": Decision.KEEP, "gb": Decision.KEEP})
    hw = toy_hardware(d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0)
    sync = predict_step(g, plan, hw, _machine(True))
    assert sync.simulated_s == pytest.approx(10.0)                  # ops alone, copies arrived when issued
    assert sync.sync_copy_s == pytest.approx(2 * (1e-6 + 1.0))      # 100 bytes out and back at 100 B/s
    assert sync.step_s == pytest.approx(sync.simulated_s + sync.sync_copy_s)
    overlapped = predict_step(g, plan, hw, _machine(False))
    assert overlapped.sync_copy_s == 0.0


def test_the_runtimes_host_costs_add_where_its_hook_only_step_makes_them():
    from slackswap.profile.measured import RuntimeHostCost

    g = _hooked_graph()  # a packed once and read back twice, b once each
    host = RuntimeHostCost(hook_per_event_s=1e-3, replay_per_step_s=1e-2, replay_per_call_s=1e-1,
                           context_per_step_s=5e-4, recompute_hook_per_event_s=2e-3, module_check_per_call_s=1e-5,
                           source="test")
    hw = toy_hardware(d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0)
    recompute = schedule_from_decisions(g, {"a": Decision.RECOMPUTE, "b": Decision.KEEP, "gb": Decision.KEEP})
    p = predict_step(g, recompute, hw, _machine(True), host)
    # The context once; a's 3 events at the recomputed tensors' rate, b's 2 at the others'; one recompute
    # step replaying op0's 3 ATen calls (op0 .. op2); the 4 module calls the recomputing plan's step checks.
    assert p.runtime_host_s == pytest.approx(5e-4 + 3 * 2e-3 + 2 * 1e-3 + 1e-2 + 3 * 1e-1 + 4 * 1e-5)
    assert p.step_s == pytest.approx(predict_step(g, recompute, hw, _machine(True)).step_s + p.runtime_host_s)
    # A swapped tensor's events are priced as a kept one's (its copies carry the rest).
    swap = schedule_from_decisions(g, {"a": Decision.SWAP, "b": Decision.KEEP, "gb": Decision.KEEP})
    assert runtime_host_counts(g, swap).hook_events == 5 and runtime_host_counts(g, swap).recompute_events == 0
    assert runtime_host_counts(g, swap).module_checks == 0  # a plan that recomputes nothing checks no module
    # On an asynchronous machine host work overlaps the device's.
    assert predict_step(g, recompute, hw, _machine(False), host).runtime_host_s == 0.0
    # The costs travel with the op-time table.
    table = replace(_table(g, {op.name: 1.0 for op in g.ops}), runtime_host=host)
    assert OpTimeTable.from_dict(json.loads(json.dumps(table.to_dict()))).runtime_host == host


def test_a_graph_whose_events_are_not_split_by_tensor_is_refused_in_one_line():
    from slackswap.graph import SAVED_EVENTS_BY_TENSOR_KEY, Graph

    g = _hooked_graph()
    unsplit = Graph(name=g.name, ops=g.ops, tensors=g.tensors, num_layers=g.num_layers,
                    meta={k: v for k, v in g.meta.items() if k != SAVED_EVENTS_BY_TENSOR_KEY})
    recompute = schedule_from_decisions(g, {"a": Decision.RECOMPUTE, "b": Decision.KEEP, "gb": Decision.KEEP})
    with pytest.raises(ValueError, match="saved_tensor_events_by_tensor' missing \\(its 5 saved-tensor events"):
        runtime_host_counts(unsplit, recompute)
    # With no events at all there is nothing to split.
    bare = Graph(name=g.name, ops=g.ops, tensors=g.tensors, num_layers=g.num_layers, meta={})
    assert runtime_host_counts(bare, recompute).recompute_events == 0


def test_an_idle_plan_takes_the_profiles_pass_through_hook_off_and_every_plan_pays_the_runtimes_context():
    from slackswap.experiment.prediction import RuntimeHostCounts
    from slackswap.profile.measured import RuntimeHostCost

    g = _hooked_graph()  # 2 packs + 3 unpacks: 5 events of the profile's pass-through hook
    hw = toy_hardware(d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0)
    host = RuntimeHostCost(hook_per_event_s=1e-3, replay_per_step_s=1e-2, replay_per_call_s=1e-1,
                           context_per_step_s=7e-4, profile_hook_per_event_s=2e-4, source="test")
    keep = schedule_from_decisions(g, {"a": Decision.KEEP, "b": Decision.KEEP, "gb": Decision.KEEP})
    assert runtime_host_counts(g, keep) == RuntimeHostCounts(0, 0, 0, 0, context_steps=1, profile_hook_events=5)
    p = predict_step(g, keep, hw, _machine(True), host)
    # No hook runs: the profile's 5 pass-through events come off, the runtime's context (once) goes on.
    assert p.runtime_host_s == pytest.approx(7e-4 - 5 * 2e-4)
    assert p.step_s == pytest.approx(predict_step(g, keep, hw, _machine(True)).step_s + 7e-4 - 1e-3)
    from pipelines.measured_console import host_text

    assert host_text({"predicted_runtime_host_s": p.runtime_host_s}) == " - 0.30 ms runtime host work"
    # A plan that is not idle runs its hooks on every event, so nothing comes off; the context goes on.
    recompute = schedule_from_decisions(g, {"a": Decision.RECOMPUTE, "b": Decision.KEEP, "gb": Decision.KEEP})
    counts = runtime_host_counts(g, recompute)
    assert (counts.context_steps, counts.profile_hook_events) == (1, 0)
    assert counts.seconds(host) == pytest.approx(7e-4 + 2 * 1e-3 + 1e-2 + 3e-1)


def test_runtime_host_costs_cached_without_a_field_are_never_read_as_zeros(tmp_path):
    from dataclasses import asdict

    from slackswap.profile.measured import RuntimeHostCost, read_table

    g = _graph()
    table = replace(_table(g, {"f1": 0.1, "f2": 0.2, "b2": 0.3, "b1": 0.4}),
                    runtime_host=RuntimeHostCost(hook_per_event_s=1e-6, replay_per_step_s=2e-5, replay_per_call_s=1e-5,
                                                 per_copy_s=2e-6, context_per_step_s=4e-5,
                                                 profile_hook_per_event_s=1e-6, recompute_hook_per_event_s=3e-6,
                                                 source="test"))
    stored = table.to_dict()
    assert OpTimeTable.from_dict(stored) == table
    # Costs stored before the context and the recomputed tensors' events were measured: the fields default
    # to 0 s, so such a table does not load at all; the cache says so in one line and it is measured again.
    old = {k: v for k, v in asdict(table.runtime_host).items()
           if k not in ("context_per_step_s", "recompute_hook_per_event_s")}
    with pytest.raises(KeyError, match="RuntimeHostCost lacks context_per_step_s, recompute_hook_per_event_s"):
        OpTimeTable.from_dict(stored | {"runtime_host": old})
    path = save_table(table, tmp_path)
    path.write_text(json.dumps(stored | {"runtime_host": old}))
    found, why = read_table(table.key, tmp_path)
    assert found is None and why == (
        f"cached op-time table {table.key.digest()} ({path.name}) is not an op-time table (KeyError: "
        "'RuntimeHostCost lacks context_per_step_s, recompute_hook_per_event_s'): measuring it again")


def _hooked_graph():
    """A captured graph's hook events: a packed once and read back twice, b packed and read back once; 4
    calls of modules without children."""
    from slackswap.graph import LEAF_MODULE_CALLS_KEY, SAVED_EVENTS_BY_TENSOR_KEY, Graph

    g = make_graph([fwd("op0:aten.mm.default", [], ["a"], 1.0), fwd("op3:aten.relu.default", ["a"], ["b"], 2.0),
                    bwd("op4:aten.threshold_backward.default", ["b"], ["gb"], 3.0),
                    bwd("op6:aten.mm.default", ["a", "gb"], ["ga"], 4.0)], {"a": 100, "b": 200, "gb": 200, "ga": 100})
    return Graph(name=g.name, ops=g.ops, tensors=g.tensors, num_layers=g.num_layers,
                 meta=dict(g.meta) | {"saved_tensor_packs": 2, "saved_tensor_unpacks": 3,
                                      SAVED_EVENTS_BY_TENSOR_KEY: {"a": [1, 2], "b": [1, 1]},
                                      LEAF_MODULE_CALLS_KEY: 4})


def test_the_training_run_predicts_as_the_benchmark_with_the_runtimes_host_costs():
    from pipelines.measured_console import comparison_line
    from slackswap.experiment.measured_prediction import HostCosts, predict_measured
    from slackswap.profile.measured import RuntimeHostCost

    g = _hooked_graph()
    hw = toy_hardware(d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0)
    plan = schedule_from_decisions(g, {"a": Decision.RECOMPUTE, "b": Decision.SWAP, "gb": Decision.KEEP})
    costs = HostCosts(RuntimeHostCost(hook_per_event_s=1e-3, replay_per_step_s=1e-2, replay_per_call_s=1e-1,
                                      per_copy_s=1e-4, recompute_hook_per_event_s=2e-3, source="test"))
    f = MeasuredTiming.compare(g, plan, hw, _machine(True), [30.0, 20.0, 22.0], costs)
    # pipelines.train's figures are the benchmark's prediction (one function), the host work in it: a's 3
    # hook events (recomputed) and b's 2, one recompute step replaying 3 ATen calls, 2 copies (b out and back).
    assert f["predicted_step_s"] == predict_measured(g, plan, hw, _machine(True), costs).prediction.step_s
    assert f["predicted_runtime_host_s"] == pytest.approx(3 * 2e-3 + 2 * 1e-3 + 1e-2 + 3e-1 + 2e-4)
    bare = MeasuredTiming.compare(g, plan, hw, _machine(True), [30.0, 20.0, 22.0], HostCosts())
    assert f["predicted_step_s"] == pytest.approx(bare["predicted_step_s"] + f["predicted_runtime_host_s"])
    # ... and the printed line says how much of the prediction it is.
    assert "+ 318.20 ms runtime host work)" in comparison_line(f)
    assert "host work" not in comparison_line(bare)


def test_the_exports_host_costs_add_per_call_region_and_saved_tensor(monkeypatch):
    import slackswap.experiment.measured_executor as executor
    from slackswap.experiment.measured_prediction import HostCosts, predict_measured

    g = _hooked_graph()
    hw = toy_hardware(d2h_bytes_per_s=100.0, h2d_bytes_per_s=100.0)
    plan = schedule_from_decisions(g, {"a": Decision.RECOMPUTE, "b": Decision.KEEP, "gb": Decision.KEEP})
    # 3 of the 7 SAC calls are replay calls the cache serves: priced at the per-call cost like the others,
    # nothing more (benchmarks/export_cached_calls.py measures that this covers the module code before them).
    monkeypatch.setattr(executor, "export_counts", lambda graph, p, model: executor.ExportCounts(7, 2, 12.5, (), 3))
    costs = HostCosts(export=ExportHostCost(sac_per_call_s=1e-3, checkpoint_per_region_s=1e-2,
                                            checkpoint_per_saved_s=1e-4, source="test"))
    bare = predict_measured(g, plan, hw, _machine(True), HostCosts(), True, object())
    priced = predict_measured(g, plan, hw, _machine(True), costs, True, object())
    assert priced.figures["predicted_dispatch_s"] == pytest.approx(7e-3)
    assert priced.figures["predicted_checkpoint_s"] == pytest.approx(2e-2 + 12.5e-4)
    assert priced.prediction.step_s == pytest.approx(bare.prediction.step_s + 7e-3 + 2e-2 + 12.5e-4)
    assert (priced.figures["checkpoint_regions"], priced.figures["checkpoint_saved"]) == (2, 12.5)
    assert priced.figures["sac_cached_calls"] == 3
    # Where copies overlap (a GPU), the host work overlaps the kernels: nothing added.
    overlapped = predict_measured(g, plan, hw, _machine(False), costs, True, object())
    assert overlapped.prediction.checkpoint_s == overlapped.prediction.dispatch_s == 0.0


def test_step_comparison_drops_the_first_step():
    c = compare_steps(1.0, [9.0, 1.0, 2.0, 1.5])
    assert (c.measured_median_s, c.measured_min_s, c.measured_max_s, c.steps) == (1.5, 1.0, 2.0, 3)
    assert c.relative_error == pytest.approx(-1 / 3)


@pytest.mark.parametrize("profile, field", [({"timing": "guess"}, "profile.timing"),
                                            ({"timing": "measured", "repeats": 0}, "profile.repeats"),
                                            ({"timing": "measured", "machine": "/no/such.yaml"}, "profile.machine")])
def test_bad_timing_settings_name_the_field(profile, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        MeasuredTiming.from_dict(profile)


@pytest.mark.parametrize("argv, field", [
    (["model=no_such_model"], "overrides"),
    (["model=hf_gpt2_2l", "profile.timing=guess"], "profile.timing"),
    (["model=hf_gpt2_2l", "--holdout-every", "1"], "--holdout-every"),
])
def test_calibrate_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, field):
    from pipelines.calibrate import main

    out = tmp_path / "fitted.yaml"
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0] and not out.exists()


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--max-mib", "0"], ["--repeats", "0"]])
def test_measure_links_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv):
    from pipelines.measure_links import main

    out = tmp_path / "machine.yaml"
    assert main(["--out", str(out), *argv]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not out.exists()


def test_the_console_line_puts_prediction_measurement_error_and_load_together():
    from pipelines.measured_console import comparison_line

    line = comparison_line({"predicted_step_s": 0.02, "measured_step_median_s": 0.025, "measured_step_min_s": 0.024,
                            "measured_step_max_s": 0.03, "measured_steps_compared": 4, "step_relative_error": -0.2,
                            "predicted_sync_copy_s": 0.001, "machine_synchronous_copies": True})
    assert "predicted step 20.00 ms" in line and "+ 1.00 ms synchronous copies" in line
    assert "measured 25.00 ms median of 4 steps after the first (min 24.00, max 30.00)" in line
    assert "error -20.0 %" in line and "load " in line


@pytest.mark.parametrize("after_times_s, median_s, exceeds", [([0.5, 0.0199, 0.0198, 0.0197], 0.0198, True),
                                                            ([0.5, 0.0141, 0.0139, 0.0140], 0.0140, False),
                                                            ([0.5, 0.0118, 0.0110, 0.0120], 0.0118, True)])
def test_the_plain_steps_drift_is_the_median_after_the_first_against_before(after_times_s, median_s, exceeds):
    from pipelines.measured_console import drift_line
    from slackswap.experiment.measured_timing import PLAIN_DRIFT_LIMIT, PlainDrift

    d = PlainDrift.of([0.4, 0.0137, 0.0138, 0.0139], after_times_s)  # the first (warm-up) steps left out
    drift = (median_s - 0.0138) / 0.0138
    assert d.after_s == pytest.approx(median_s)
    assert d.drift == pytest.approx(drift) and d.exceeds is exceeds is (abs(drift) > PLAIN_DRIFT_LIMIT)
    line = drift_line(d.figures())
    assert f"plain step 13.80 ms before the plan's steps, {d.after_s * 1e3:.2f} ms after" in line
    assert f"drift {drift * 100:+.1f} %" in line
    assert ("inside the machine's own variation" in line) is exceeds
    assert drift_line({"step_relative_error": 0.1}) is None  # no re-measured plain step, no line


def test_the_paired_prediction_scales_by_the_plain_steps_around_the_plans_over_the_simulated_one():
    from pipelines.measured_console import drift_line
    from slackswap.experiment.measured_timing import PairedPrediction, PlainDrift

    # Worked by hand: the table simulates the plain step at 6.0 ms and the plan at 6.6 ms; the plain steps
    # around the plan's took 7.0 and 8.0 ms (the machine ran 1.25x slower than when the table was
    # measured), the plan's 8.4 ms: at that speed the plan is predicted 6.6 x 1.25 = 8.25 ms, -1.79 %.
    drift = PlainDrift(0.007, 0.008)
    paired = PairedPrediction(0.0066, 0.006, drift.mean_s, 0.0084)
    assert drift.mean_s == pytest.approx(0.0075) and paired.speed == pytest.approx(1.25)
    assert paired.paired_predicted_s == pytest.approx(0.00825)
    assert paired.relative_error == pytest.approx((0.00825 - 0.0084) / 0.0084)
    f = drift.figures() | paired.figures() | {"predicted_step_s": 0.0066, "measured_step_median_s": 0.0084}
    assert f["step_relative_error_paired"] == pytest.approx(-0.017857, abs=1e-6)
    line = drift_line(f)
    assert "plain step 7.50 ms around the plan's steps, simulated on the table 6.00 ms: x1.250" in line
    assert "predicted 8.25 ms vs measured 8.40 ms: error -1.8 %" in line


def test_the_drift_limit_is_strictly_over_it():
    from slackswap.experiment.measured_timing import PlainDrift

    assert not PlainDrift(1.0, 1.05, limit=0.1).exceeds and PlainDrift(1.0, 1.25, limit=0.1).exceeds
    assert PlainDrift(1.0, 0.75, limit=0.1).exceeds and not PlainDrift(1.0, 1.25, limit=0.3).exceeds


def test_the_machine_description_is_what_hardware_and_node_configs_load():
    import yaml

    from slackswap.hardware import Hardware
    from slackswap.node import Node

    conf = Path(__file__).resolve().parents[1] / "conf"
    description = machine_description("t", "cpu", True, [
        {"direction": d, "host_memory": "pageable", "size_bytes": s, "median_s": 2e-6 + s / 1e10}
        for d in ("h2d", "d2h", "both") for s in (4096, 1 << 20)], [(4096, 3e-3)], [], "test")
    hardware = yaml.safe_load((conf / "hardware" / "h200_sxm_pcie5.yaml").read_text())
    node = yaml.safe_load((conf / "node" / "pcie_workstation.yaml").read_text())
    loaded_hw = Hardware.from_dict(hardware | {"link": description["link"]})
    assert loaded_hw.link.d2h_effective_bytes_per_s == pytest.approx(1e10, rel=1e-6)
    assert loaded_hw.link.latency_s == pytest.approx(2e-6, rel=1e-6)
    loaded_node = Node.from_dict(node | description["node"])
    assert loaded_node.pin_setup_s_per_tensor == pytest.approx(3e-3)
    assert loaded_node.h2d_duplex_fraction == pytest.approx(1.0)


def test_a_file_that_cannot_be_used_is_one_line_naming_it(tmp_path):
    from slackswap.profile.measured import read_table

    g = _graph()
    assert read_table(_key(g), tmp_path) == (None, None)  # none cached: measured, nothing to say
    path = save_table(_table(g, {"f1": 0.1}), tmp_path)
    for text, why in (("{not json", "cannot be read"), ("[1, 2]", "not a JSON mapping"),
                      ('{"key": 3}', "not an op-time table")):
        path.write_text(text)
        table, line = read_table(_key(g), tmp_path)
        assert table is None and why in line and path.name in line and "\n" not in line
        assert line.endswith("measuring it again")


def _description(notes: dict | None = None, versions: dict | None = None) -> dict:
    d = machine_description("cpu", "cpu", True, [
        {"direction": d, "host_memory": "pageable", "size_bytes": s, "median_s": 2e-6 + s / 1e10}
        for d in ("h2d", "d2h", "both") for s in (4096, 1 << 20)], [], [], "test")
    d["versions"] = versions or {"torch": "2.13.0"}
    if notes is not None:
        d["notes"] = notes
    return d


def test_a_cached_machine_description_is_reused_under_the_op_time_tables_rule():
    from slackswap.profile.machine import description_refusal
    from slackswap.profile.measured import MAX_REUSE_LOAD_PER_CPU, load_refusal, reuse_refusal

    versions = {"torch": "2.13.0"}
    quiet, loaded = {"load_average_1min": 0.4, "cpu_count": 2}, {"load_average_1min": 1.6, "cpu_count": 2}
    assert 0.4 / 2 <= MAX_REUSE_LOAD_PER_CPU < 1.6 / 2
    assert description_refusal(_description(quiet), "machine description m.json", versions) is None
    why = description_refusal(_description(loaded), "machine description m.json", versions)
    # One rule for both caches: the description's refusal is the op-time table's, word for word.
    assert why == load_refusal("machine description m.json", loaded) == (
        "cached machine description m.json was measured at load 1.60 on 2 CPUs (0.80 per CPU > 0.5): "
        "measuring it again")
    g = _graph()
    table = replace(_table(g, {"f1": 0.1}), notes=loaded)
    assert reuse_refusal(table) == load_refusal(f"op-time table {table.key.digest()}", loaded)
    # A description cached before loads were recorded (no notes) is measured again, as such a table is.
    assert "has no recorded load" in description_refusal(_description(), "machine description m.json", versions)
    other = description_refusal(_description(quiet, {"torch": "2.14.0"}), "machine description m.json", versions)
    assert "measured on versions" in other
    broken = _description(quiet)
    del broken["fit"]
    assert "is not a machine description" in description_refusal(broken, "machine description m.json", versions)


def test_the_cache_line_says_reused_measured_again_or_measured():
    from slackswap.profile.measured import cache_line

    quiet = {"load_average_1min": 0.4, "cpu_count": 2}
    assert cache_line("op-time table ab", True, quiet, "c") == (
        "cached op-time table ab reused (measured at load 0.40 on 2 CPUs)")
    again = quiet | {"remeasured_because": "cached op-time table ab has no recorded load: measuring it again"}
    assert cache_line("op-time table ab", False, again, "c") == (
        "cached op-time table ab has no recorded load: measuring it again (now at load 0.40 on 2 CPUs)")
    assert cache_line("machine description m.json", False, quiet, "c").endswith("at load 0.40 on 2 CPUs: none cached")
    assert "profile.cache_dir is empty" in cache_line("op-time table ab", False, quiet, None)


def test_a_table_whose_ops_do_not_add_up_to_its_plain_step_is_said_and_not_reused():
    from slackswap.profile.measured import TABLE_SUM_TOLERANCE, reuse_refusal, sum_gap, sum_refusal

    g = _graph()
    quiet = {"load_average_1min": 0.4, "cpu_count": 2}
    table = replace(_table(g, {"f1": 0.004, "b1": 0.006}), notes=quiet)  # ops add up to the plain step: 10 ms
    assert sum_gap(table) == pytest.approx(0.0) and sum_refusal(table) is None and reuse_refusal(table) is None
    edge = replace(table, step_median_s=0.010 / (1 - TABLE_SUM_TOLERANCE) * 0.999)  # just inside the tolerance
    assert sum_refusal(edge) is None
    stalled = replace(table, step_median_s=0.028)  # torch's threads waiting for a busy core: the plain step 2.8x
    assert sum_gap(stalled) == pytest.approx(10 / 28 - 1)
    why = sum_refusal(stalled)
    assert why == (f"op-time table {table.key.digest()}: its op times add up to 10.00 ms, its plain step measured "
                   "28.00 ms (-64 %, over 20 %): the ops' times are not the step's, measured at load 0.40 on 2 CPUs "
                   "on torch's 2 intra-op threads; other work takes the cores its threads wait for: fewer threads "
                   "(OMP_NUM_THREADS) or a quieter machine")
    # Measured on one thread, there is no thread count to suggest; a cached table is measured again either way.
    one = replace(stalled, key=replace(stalled.key, intra_op_threads=1))
    assert sum_refusal(one).endswith("measured at load 0.40 on 2 CPUs on torch's 1 intra-op thread; other work "
                                     "takes the core it runs on: a quieter machine")
    assert reuse_refusal(stalled) == (f"cached op-time table {table.key.digest()}'s op times add up to -64 % of "
                                      "its plain step: measuring it again")
