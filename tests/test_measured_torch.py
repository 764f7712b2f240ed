"""Measuring on the device (slackswap.runtime.op_times, .links) and a training run on measured op
times. CPU only here: the CUDA paths are written but not run without a GPU (docs/profile.md)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tests.extras import require_torch_extra

require_torch_extra()

from slackswap.experiment.prediction import predict_step  # noqa: E402
from slackswap.graph import Graph  # noqa: E402
from slackswap.hardware import load_preset  # noqa: E402
from slackswap.profile.measured import MeasurementError, retime  # noqa: E402
from slackswap.profile.torch.links import measure_links, measurement_description  # noqa: E402
from slackswap.runtime import capture_graph  # noqa: E402
from slackswap.runtime.op_times import cached_op_times, measure_op_times  # noqa: E402
from slackswap.runtime.training_workload import build_training_workload, small_config  # noqa: E402
from slackswap.schedule.build import keep_all_plan  # noqa: E402
from tests.runtime_support import one_thread  # noqa: E402, F401 (a fixture)

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="module")
def captured():
    w = build_training_workload(*small_config("tiny"))
    return w, capture_graph(w.model, (w.batch,), w.loss_fn, load_preset("h200_sxm_pcie5"), "tiny")


def test_every_op_of_the_captured_step_is_timed(captured):
    w, graph = captured
    table = measure_op_times(graph, w.model, (w.batch,), w.loss_fn, warmup=1, repeats=3)
    assert set(table.times) == {op.name for op in graph.ops}
    assert all(0 <= t.min_s <= t.median_s <= t.max_s and t.repeats == 3 for t in table.times.values())
    assert table.key.device == "cpu" and table.key.graph_fingerprint == graph.fingerprint
    assert table.step_min_s <= table.step_median_s <= table.step_max_s
    retimed, sources = retime(graph, table)
    assert (sources.measured, sources.roofline) == (len(graph.ops), 0)
    assert all(p.grad is None for p in w.model.parameters())  # the model is left as it was


def test_the_key_says_how_the_host_allocator_ran(captured, monkeypatch):
    from slackswap.profile import host_allocator
    from slackswap.runtime import op_times

    w, graph = captured
    cpu = next(w.model.parameters()).device
    monkeypatch.setattr(host_allocator, "_applied", None)
    assert op_times.op_time_key(graph, cpu).host_allocator == host_allocator.SYSTEM_DEFAULT_ALLOCATOR
    monkeypatch.setattr(host_allocator, "_applied", host_allocator.HostAllocatorSetting(True, "kept, as set"))
    assert op_times.op_time_key(graph, cpu).host_allocator == "kept, as set"


def one_op_of(graph) -> dict:
    """A stub table's times: one op taking the whole 1 ms plain step, so that its ops add up to it (a table
    whose ops do not is measured again: tests/test_measured_profile.py)."""
    from slackswap.profile.measured import OpTime

    return {graph.ops[0].name: OpTime(1e-3, 1e-3, 1e-3, 1)}


def test_the_table_is_measured_once_then_read_from_the_cache(captured, tmp_path, monkeypatch):
    import slackswap.profile.measured as measured

    w, graph = captured
    # A quiet machine, whatever the suite's load: a table measured under load is measured again (below);
    # one cold repeat's ops need not add up to its plain step, a check tested on its own.
    monkeypatch.setattr("os.getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setattr(measured, "sum_refusal", lambda table: None)
    first, cached = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, warmup=0, repeats=1)
    again, cached_again = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, warmup=0, repeats=1)
    assert (cached, cached_again) == (False, True) and again == first
    # The load the times were measured at travels with the cached table (a reused table says it).
    assert again.notes["load_average_1min"] == first.notes["load_average_1min"] >= 0.0
    assert again.notes["cpu_count"] >= 1


def test_a_cached_table_measured_under_load_is_measured_again(captured, tmp_path, monkeypatch):
    # A stub stands in for the measurement: each call returns a table at the next load, so the test
    # sees which cached tables are reused and which are measured again, without timing a step.
    import slackswap.runtime.op_times as op_times
    from slackswap.profile.measured import MAX_REUSE_LOAD_PER_CPU, OpTimeTable

    w, graph = captured
    notes = iter([{"load_average_1min": 1.6, "cpu_count": 2}, {"load_average_1min": 0.4, "cpu_count": 2},
                  {}, {"load_average_1min": 0.2, "cpu_count": 2}])
    made = []

    def stub(graph, model, inputs, loss_fn, warmup, repeats, clock, replay_plan=None, copy_plan=None):
        key = op_times.op_time_key(graph, next(model.parameters()).device, clock)
        made.append(OpTimeTable(key=key, times=one_op_of(graph), warmup=warmup, repeats=repeats, step_median_s=1e-3,
                                step_min_s=1e-3, step_max_s=1e-3, notes=next(notes)))
        return made[-1]

    monkeypatch.setattr(op_times, "measure_op_times", stub)

    def cached():
        return cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, warmup=0, repeats=1)

    first, was_cached = cached()  # load 1.6 on 2 CPUs: 0.8 per CPU
    assert not was_cached and MAX_REUSE_LOAD_PER_CPU < 1.6 / 2
    again, was_cached = cached()  # measured again, and the new table says why
    assert not was_cached and len(made) == 2 and again.notes["load_average_1min"] == 0.4
    assert "measured at load 1.60 on 2 CPUs" in again.notes["remeasured_because"]
    reused, was_cached = cached()  # 0.2 per CPU: reused as it is
    assert was_cached and len(made) == 2 and reused == again
    # A table with no recorded load (one written before loads were recorded) is measured again too.
    op_times.save_table(replace(again, notes={}), tmp_path)
    fresh, was_cached = cached()
    assert not was_cached and len(made) == 3 and "no recorded load" in fresh.notes["remeasured_because"]


# On one intra-op thread, as the benchmark's record runs: the replays are stamped on the table's clock.
@pytest.mark.usefixtures("one_thread")
def test_the_profile_times_the_replay_of_every_op_and_the_copies_of_every_tensor_its_plans_name(captured):
    import torch

    from slackswap.experiment.measured_prediction import profiling_plans
    from slackswap.plan import StepKind

    w, graph = captured
    hardware = load_preset("h200_sxm_pcie5")
    state = torch.get_rng_state()
    table = measure_op_times(graph, w.model, (w.batch,), w.loss_fn, warmup=0, repeats=1, clock="process",
                             **profiling_plans(hardware))
    timed = retime(graph, table)[0]
    recomputed = {s.op for s in profiling_plans(hardware)["replay_plan"](timed).steps if s.kind == StepKind.RECOMPUTE}
    offloaded = {t.tensor for t in profiling_plans(hardware)["copy_plan"](timed).offloads}
    assert recomputed and set(table.replay_times) == recomputed and all(t > 0 for t in table.replay_times.values())
    assert offloaded and set(table.copy_times) == offloaded
    assert all(d2h > 0 and h2d > 0 for d2h, h2d in table.copy_times.values())
    assert f"{len(recomputed)} ops of plan 'full_recompute'" in table.notes["replay_source"]
    assert f"{len(offloaded)} tensors of plan 'save_on_cpu'" in table.notes["copy_source"]
    assert torch.equal(torch.get_rng_state(), state) and all(p.grad is None for p in w.model.parameters())
    # Without plans nothing is replayed or copied, and the table says neither was measured (None), not "none".
    bare = measure_op_times(graph, w.model, (w.batch,), w.loss_fn, warmup=0, repeats=1)
    assert bare.replay_times is None and bare.copy_times is None


def test_a_cached_table_without_replay_or_copy_times_is_measured_again_where_they_are_wanted(captured, tmp_path,
                                                                                             monkeypatch):
    import slackswap.runtime.op_times as op_times
    from slackswap.profile.measured import OpTimeTable

    w, graph = captured
    made = []

    def stub(graph, model, inputs, loss_fn, warmup, repeats, clock, replay_plan=None, copy_plan=None):
        key = op_times.op_time_key(graph, next(model.parameters()).device, clock)
        made.append(OpTimeTable(key=key, times=one_op_of(graph), warmup=warmup, repeats=repeats, step_median_s=1e-3,
                                step_min_s=1e-3, step_max_s=1e-3, notes={"load_average_1min": 0.2, "cpu_count": 2},
                                replay_times=None if replay_plan is None else {graph.ops[0].name: 2e-3},
                                copy_times=None if copy_plan is None else {"t0": (1e-6, 2e-6)}))
        return made[-1]

    monkeypatch.setattr(op_times, "measure_op_times", stub)
    cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, 0, 1)  # cached without replay times
    # A run that does not price replays (no plan) reuses it; one that does measures it again, in one line.
    reused, was_cached = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, 0, 1)
    assert was_cached and reused.replay_times is None and len(made) == 1
    fresh, was_cached = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, 0, 1,
                                        replay_plan=lambda g: None)
    assert not was_cached and len(made) == 2 and fresh.replay_times == {graph.ops[0].name: 2e-3}
    assert fresh.notes["remeasured_because"] == (f"cached op-time table {fresh.key.digest()} has no replay times of "
                                                 "its ops: measuring it again")
    again, was_cached = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, 0, 1,
                                        replay_plan=lambda g: None)
    assert was_cached and again == fresh and len(made) == 2
    # Copy times alike: a run that prices copies at them measures a table cached without them again.
    with_copies, was_cached = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, 0, 1,
                                              replay_plan=lambda g: None, copy_plan=lambda g: None)
    assert not was_cached and len(made) == 3 and with_copies.copy_times == {"t0": (1e-6, 2e-6)}
    assert with_copies.notes["remeasured_because"] == (f"cached op-time table {fresh.key.digest()} has no copy times "
                                                       "of its tensors: measuring it again")
    reused, was_cached = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, 0, 1,
                                         replay_plan=lambda g: None, copy_plan=lambda g: None)
    assert was_cached and reused == with_copies and len(made) == 3


def test_a_cached_table_that_cannot_be_read_is_one_line_and_measured_again(captured, tmp_path, monkeypatch):
    import slackswap.runtime.op_times as op_times
    from slackswap.profile.measured import OpTimeTable, table_path

    w, graph = captured
    made = []

    def stub(graph, model, inputs, loss_fn, warmup, repeats, clock, replay_plan=None, copy_plan=None):
        key = op_times.op_time_key(graph, next(model.parameters()).device, clock)
        made.append(OpTimeTable(key=key, times=one_op_of(graph), warmup=warmup, repeats=repeats, step_median_s=1e-3,
                                step_min_s=1e-3, step_max_s=1e-3, notes={"load_average_1min": 0.2, "cpu_count": 2}))
        return made[-1]

    monkeypatch.setattr(op_times, "measure_op_times", stub)
    key = op_times.op_time_key(graph, next(w.model.parameters()).device)
    table_path(key, tmp_path).write_text('{"key": {"graph_fi')  # a write cut short
    table, cached = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, warmup=0, repeats=1)
    why = table.notes["remeasured_because"]
    assert not cached and len(made) == 1 and "cannot be read" in why and "\n" not in why
    again, cached = cached_op_times(graph, w.model, (w.batch,), w.loss_fn, tmp_path, warmup=0, repeats=1)
    assert cached and again == table  # the file is whole again: the new table, nothing of the broken one


def test_a_cached_machine_description_measured_under_load_is_measured_again(tmp_path, monkeypatch):
    """What the op-time table gets, the run's machine description gets too: a description measured under
    load, one cached before loads were recorded, or a file that cannot be read is measured again, and
    the run's line for it says which happened."""
    import json

    import slackswap.profile.torch.links as links
    from slackswap.experiment.measured_timing import MeasuredTiming

    loads = iter([1.6, 0.2, 0.25, 0.3])  # one per measurement
    measured = []

    def small_links(device, max_bytes, repeats):  # a real measurement, small: the test times no 64 MiB copy
        measured.append(device)
        return measure_links(device, max_bytes=16 * 1024, repeats=1)

    monkeypatch.setattr(links, "measure_links", small_links)
    monkeypatch.setattr("os.getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    timing = MeasuredTiming(timing="measured", cache_dir=str(tmp_path))
    path = links.machine_cache_path(tmp_path, "cpu")

    _, f = timing.machine("cpu")  # none cached: measured at load 1.6 on 2 CPUs, and cached
    assert not f["machine_cached"] and f["machine_cache_line"].endswith("load 1.60 on 2 CPUs: none cached")
    _, f = timing.machine("cpu")  # 0.8 per CPU: measured again, not reused
    assert not f["machine_cached"] and len(measured) == 2
    assert f["machine_remeasured_because"] == (
        f"cached machine description {path.name} was measured at load 1.60 on 2 CPUs (0.80 per CPU > 0.5): "
        "measuring it again")
    machine, f = timing.machine("cpu")  # measured at 0.2: reused as it is
    assert f["machine_cached"] and len(measured) == 2 and machine.synchronous
    assert f["machine_cache_line"] == f"cached machine description {path.name} reused (measured at load 0.20 on 2 CPUs)"
    old = json.loads(path.read_text())
    del old["notes"]  # as the runs before this rule cached it
    path.write_text(json.dumps(old))
    _, f = timing.machine("cpu")
    assert not f["machine_cached"] and "has no recorded load" in f["machine_remeasured_because"]
    path.write_text(path.read_text()[:40])  # a write cut short
    _, f = timing.machine("cpu")
    assert not f["machine_cached"] and len(measured) == 4 and "cannot be read" in f["machine_remeasured_because"]
    assert json.loads(path.read_text())["notes"]["load_average_1min"] == 0.3  # replaced whole


def test_a_step_that_is_not_the_captured_one_is_one_line_naming_it(captured):
    w, graph = captured
    wrong_count = Graph(name=graph.name, ops=graph.ops, tensors=graph.tensors, num_layers=graph.num_layers,
                        meta=dict(graph.meta) | {"aten_calls": graph.meta["aten_calls"] + 1})
    with pytest.raises(MeasurementError, match="ATen calls"):
        measure_op_times(wrong_count, w.model, (w.batch,), w.loss_fn, warmup=0, repeats=1)
    op = graph.ops[3]
    renamed = op.name.split(":")[0] + ":aten.mm.default"
    ops = tuple(replace(o, name=renamed) if o is op else o for o in graph.ops)
    tensors = {n: replace(t, producer=renamed if t.producer == op.name else t.producer,
                          consumers=tuple(renamed if c == op.name else c for c in t.consumers))
               for n, t in graph.tensors.items()}
    wrong_op = Graph(name=graph.name, ops=ops, tensors=tensors, num_layers=graph.num_layers, meta=graph.meta)
    with pytest.raises(MeasurementError, match=rf"op {renamed}"):
        measure_op_times(wrong_op, w.model, (w.batch,), w.loss_fn, warmup=0, repeats=1)


def test_cpu_links_are_one_memory_and_say_pinned_is_not_measured():
    m = measure_links("cpu", max_bytes=64 * 1024, repeats=2)
    assert m.same_memory and m.pin_rows == ()
    assert {(r.direction, r.size_bytes) for r in m.rows} == {
        (d, s) for d in ("h2d", "d2h", "both") for s in (4096, 16384, 65536)}
    assert any("pinned" in line for line in m.skipped)
    description = measurement_description(m, "cpu")
    assert description["synchronous"] is True and description["host_memory"] == "pageable"
    assert math.isfinite(description["link"]["d2h_effective_bytes_per_s"])


@pytest.mark.slow
def test_a_training_run_on_measured_times_predicts_beside_measuring(tmp_path, monkeypatch):
    import slackswap.experiment.measured_timing as measured_timing
    from slackswap.experiment.measured_prediction import HostCosts
    from slackswap.experiment.training_run import TrainingRunSpec, run_training
    from slackswap.profile.measured import ExportHostCost, RuntimeHostCost

    # The executors' host costs as the microbenchmarks would give them (their own tests measure them; here
    # a second and a half of the suite is spared): measured once with the table, for the CPU.
    asked = []
    host = RuntimeHostCost(hook_per_event_s=2e-6, replay_per_step_s=3e-5, replay_per_call_s=1e-5, per_copy_s=2e-6,
                           source="stub")
    monkeypatch.setattr(measured_timing, "measure_host_costs", lambda device, shape: asked.append((device, shape))
                        or HostCosts(host, ExportHostCost(source="stub")))

    def preset(group, name):
        data = yaml.safe_load((CONF / group / f"{name}.yaml").read_text())
        data.pop("defaults", None)
        return data

    config = {"model": {**preset("model", "tiny"), **preset("model", "tiny_torch")},
              "hardware": preset("hardware", "h200_sxm_pcie5"), "budget": {"fraction": 0.8},
              "planner": preset("planner", "slackswap"),
              "train": {**yaml.safe_load((CONF / "train.yaml").read_text())["train"], "steps": 3},
              "profile": {"timing": "measured", "cache_dir": str(tmp_path), "warmup": 1, "repeats": 2}}
    outcome = run_training(TrainingRunSpec.from_dict(config))
    f = outcome.figures
    assert outcome.verdict == "ok", outcome.reason
    assert f["ops_timed_measured"] == len(outcome.graph.ops) and f["ops_timed_roofline"] == 0
    # The runtime's host work is in it, at the costs measured with the table and stored with it, the export's
    # at the model's shape (tiny_torch: hidden 64, 2 x 32 tokens).
    assert asked == [("cpu", (64, 64))] and "2.00 us per saved-tensor event" in f["host_costs_line"]
    # Each op's replay by the runtime was timed with the table (tiny_torch's full recompute replays some).
    assert f["replay_times_ops"] > 0 and f"replay times of {f['replay_times_ops']} ops" in f["host_costs_line"]
    assert f["predicted_runtime_host_s"] > 0
    assert f["predicted_step_s"] == pytest.approx(f["predicted_sim_step_s"] + f["predicted_sync_copy_s"]
                                                  + f["predicted_runtime_host_s"])
    assert f["measured_steps_compared"] == 2 and math.isfinite(f["step_relative_error"])
    assert f["op_times_load_average"] >= 0.0 and not f["op_times_cached"]
    assert f["step_relative_error"] == pytest.approx((f["predicted_step_s"] - f["measured_step_median_s"])
                                                     / f["measured_step_median_s"])
    # The plain steps timed right before and after the plan's: their drift beside the error, not in it, and
    # the prediction at their speed (their mean over the plain step simulated on the measured op times).
    before, after = f["plain_step_before_s"], f["plain_step_after_s"]
    assert before > 0 and after > 0 and f["plain_step_drift"] == pytest.approx((after - before) / before)
    plain = predict_step(outcome.graph, keep_all_plan(outcome.graph), load_preset("h200_sxm_pcie5"), None)
    speed = (before + after) / 2 / plain.step_s
    assert f["plain_step_speed_now"] == pytest.approx(speed) and f["predicted_step_paired_s"] == pytest.approx(
        f["predicted_step_s"] * speed)
    # The simulated plan runs on the measured op times, not the roofline's.
    assert outcome.graph.meta["timing"] == "measured"


def test_an_op_that_fails_is_one_line_naming_it_and_the_device(captured):
    import torch

    w, graph = captured

    def failing_loss(out):
        logits = out if isinstance(out, torch.Tensor) else out.logits
        flat = logits.float().reshape(-1, logits.shape[-1])
        return torch.ops.aten.mm.default(flat, torch.ones(3, 3)).sum()  # shapes do not match: mm fails

    with pytest.raises(MeasurementError, match=r"^op\d+:aten\.mm\.default failed on cpu: ") as err:
        measure_op_times(graph, w.model, (w.batch,), failing_loss, warmup=0, repeats=1)
    assert "\n" not in str(err.value)


def test_no_gpu_is_one_line_naming_the_device():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the CUDA path runs instead")
    with pytest.raises(MeasurementError, match=r"^device cuda: no CUDA device is visible"):
        measure_links("cuda")


def test_a_view_moves_no_bytes_and_costs_only_its_launch(captured):
    """A view reads and writes no memory: its roofline time is the launch cost alone, while the ops
    that move data keep their bytes (what the fit needs: docs/profile.md "Calibrating a preset")."""
    import torch

    from slackswap.runtime.capture import moves_no_data
    from slackswap.runtime.op_numbering import overload_of

    _, graph = captured
    hardware = load_preset("h200_sxm_pcie5")
    views = [op for op in graph.ops if overload_of(op.name).is_view or "_unsafe_view" in op.name]
    assert views and all(op.moved_bytes == 0 and op.duration_s == hardware.launch_overhead_s for op in views)
    assert all(op.moved_bytes > 0 for op in graph.ops if op not in views and op.flops > 0)
    aten, x = torch.ops.aten, torch.ones(4, 4)
    assert moves_no_data(aten._unsafe_view.default, (x, [16]), {}, aten._unsafe_view.default(x, [16]))
    assert moves_no_data(aten.detach.default, (x,), {}, x.detach())
    assert not moves_no_data(aten.add_.Tensor, (x, x), {}, x)  # aliases its input but writes it
    assert not moves_no_data(aten.clone.default, (x,), {}, x.clone())


@pytest.mark.slow
def test_a_preset_fitted_on_one_shape_predicts_another_shape_within_15_percent(captured):
    """Op times from a machine with a per-op launch cost, small-GEMM inefficiency (Hockney's n_1/2) and
    per-op scatter (lognormal, 20 %) on one captured shape; the fit predicts the sum at twice the
    micro-batch and 1.5x the sequence within the documented 15 % (the benchmark does it on measured
    times: benchmarks/measured_profile.py), and reproduces its own shape's sum."""
    import numpy as np

    from slackswap.profile.fit import fit_preset, op_dtype
    from slackswap.profile.timing import op_duration_s

    base = load_preset("h200_sxm_pcie5")
    truth = replace(base, efficiency={"matmul": 2e-4, "attention": 1e-4, "elementwise": 1.0}, hbm_efficiency=2e-3,
                    launch_overhead_s=7e-6, half_performance_flops={"matmul": 3e5, "attention": 3e5})
    scatter = np.random.default_rng(0)

    def measured(g: Graph) -> dict[str, float]:
        return {op.name: op_duration_s(op.flops, op.moved_bytes, op.op_class, op_dtype(g, op, "fp32"), truth)
                * float(scatter.lognormal(0.0, 0.2)) for op in g.ops}

    ga = captured[1]  # small_config("tiny"): micro-batch 2, sequence 16
    w = build_training_workload(*small_config("tiny", seq=24, batch=4))
    gb = capture_graph(w.model, (w.batch,), w.loss_fn, base, "tiny")
    ta, tb = measured(ga), measured(gb)
    report = fit_preset(ga, ta, base, "fp32")
    assert abs(report.fit_sum_rel_error) < 0.02  # the objective in seconds reproduces the fitted ops' sum
    predicted = sum(op_duration_s(op.flops, op.moved_bytes, op.op_class, op_dtype(gb, op, "fp32"), report.hardware)
                    for op in gb.ops)
    assert predicted / sum(tb.values()) - 1 == pytest.approx(0.0, abs=0.15)


# On one intra-op thread, as `measure_host_costs` runs it: its op times then come from the thread's own CPU
# clock, where with torch's pool they come from the wall clock, which a busy machine can push past a step's
# whole time (replay costs clamped to 0).
@pytest.mark.usefixtures("one_thread")
def test_the_runtimes_host_cost_is_measured_on_a_fixed_microbenchmark():
    import torch

    from slackswap.planners.registry import get_planner
    from slackswap.runtime.eager.host_cost import measure_runtime_host_cost

    full_recompute = get_planner("full_recompute")
    state = torch.get_rng_state()
    cost = measure_runtime_host_cost(lambda graph, hardware: full_recompute.plan(graph, hardware, None), 0, 1)
    assert torch.equal(torch.get_rng_state(), state)
    assert cost.replay_per_step_s + cost.replay_per_call_s > 0
    # Per event, apart for tensors recomputed and the rest, from whole steps of two plans (non-negative
    # least squares); the pass-through hook's cost per event and the runtime's context per step (kept >= 0).
    assert cost.hook_per_event_s >= 0 and cost.recompute_hook_per_event_s >= 0
    assert cost.hook_per_event_s + cost.recompute_hook_per_event_s > 0
    assert cost.profile_hook_per_event_s >= 0 and cost.context_per_step_s >= 0
    assert "the profile's pass-through hook, the keep plan, the full-recompute plan" in cost.source
    from dataclasses import asdict

    from slackswap.profile.measured import RuntimeHostCost

    assert RuntimeHostCost(**asdict(cost)) == cost
    # A swap's copies are timed against the same blocks with every tensor kept: per copy, never negative.
    assert cost.per_copy_s >= 0 and "56 copies" in cost.source and "thread CPU time" in cost.source


def test_a_cached_table_without_runtime_host_costs_gets_them_measured_and_stored(tmp_path, monkeypatch):
    import slackswap.experiment.measured_timing as measured_timing
    import slackswap.runtime.op_times as op_times
    from slackswap.experiment.measured_prediction import HostCosts
    from slackswap.profile.measured import (
        ExportHostCost,
        OpTime,
        OpTimeKey,
        OpTimeTable,
        RuntimeHostCost,
        load_table,
    )
    from slackswap.testing import bwd, fwd, make_graph

    graph = make_graph([fwd("f1", [], ["a"], 1.0), bwd("b1", ["a"], ["ga"], 2.0)], {"a": 100, "ga": 100})
    key = OpTimeKey(graph.fingerprint, "m0", (((2, 16), "torch.int64"),), "cpu", {"torch": "2.13.0"}, "perf_counter", 2)
    fresh = RuntimeHostCost(hook_per_event_s=1e-6, replay_per_step_s=2e-5, replay_per_call_s=1e-5, per_copy_s=2e-6,
                            context_per_step_s=4e-5, profile_hook_per_event_s=1e-6, recompute_hook_per_event_s=3e-6,
                            source="measured now")
    # A table cached without the executors' host costs (measured by a caller that attached none).
    cached = OpTimeTable(key, {"f1": OpTime(1e-3, 1e-3, 1e-3, 1), "b1": OpTime(2e-3, 2e-3, 2e-3, 1)}, 0, 1, 3e-3,
                         3e-3, 3e-3)
    monkeypatch.setattr(op_times, "cached_op_times", lambda *args, **kwargs: (cached, True))
    asked = []
    monkeypatch.setattr(measured_timing, "measure_host_costs", lambda device, shape: asked.append((device, shape))
                        or HostCosts(fresh, ExportHostCost(source="stub")))
    timing = measured_timing.MeasuredTiming(timing="measured", cache_dir=str(tmp_path))
    w = type("W", (), {"model": None, "batch": None, "loss_fn": None})()
    _, figures, costs = timing.retime(graph, w, None, (32, 16))  # hardware: the replays' plan, never made (stub)
    assert asked == [("cpu", (32, 16))] and costs.runtime == fresh
    # Its ops add up to its plain step (1 + 2 ms against 3 ms): nothing to say beside the prediction.
    assert figures["op_times_sum_gap"] == pytest.approx(0.0) and figures["op_times_sum_refusal"] == ""
    # Stored with the table: the next run reads them and measures nothing.
    saved = load_table(key, tmp_path)
    assert saved.runtime_host == fresh and saved.export_host == ExportHostCost(source="stub")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_the_table_calibrate_caches_is_one_a_training_run_reuses(tmp_path):
    # pipelines.calibrate caches its op-time table with the ops' replay times, as a measured training run
    # does: a later `pipelines.train ... profile.timing=measured` on the same cache reads it, not measures it.
    import json
    import platform

    from pipelines.calibrate import main
    from slackswap.profile.host_allocator import host_allocator_label
    from slackswap.profile.measured import OpTimeTable, replay_refusal

    assert main(["model=tiny_torch", f"profile.cache_dir={tmp_path}", "--out", str(tmp_path / "fitted.yaml")]) == 0
    (cached,) = tmp_path.glob("*.json")
    table = OpTimeTable.from_dict(json.loads(cached.read_text()))
    assert table.replay_times and replay_refusal(table) is None
    # Measured as a training run measures: with freed host memory kept (train.yaml), keyed so, said in the YAML.
    assert table.key.host_allocator == host_allocator_label()
    assert "freed memory kept" in table.key.host_allocator or platform.libc_ver()[0] != "glibc"
    assert f"host allocator: {table.key.host_allocator}" in (tmp_path / "fitted.yaml").read_text()

