"""trace.json (Chrome trace-event format), timeline.png and metrics.json of a simulated step."""

from __future__ import annotations

import json

import pytest

from slackswap.errors import ConfigError
from slackswap.plan import ComputeStep, Decision, Direction, Plan, StepKind, Transfer
from slackswap.schedule.build import keep_all_plan
from slackswap.simulate import simulate
from slackswap.simulate.metrics import compute_metrics, simulate_ideal
from slackswap.simulate.timeline import merged_intervals, write_timeline_png
from slackswap.simulate.trace import write_trace_json
from slackswap.testing import bwd, fwd, make_graph, toy_hardware

HW = toy_hardware()
# F1 -> a (100 B) -> F2 -> b -> F3 (4 s) -> c; B3, B2, B1 (1 s each). a swapped; prefetch issued after
# B2 (step 4), so B1 stalls 1 s: step 10 s against the ideal 9 s (see test_simulate_hand).
GRAPH = make_graph(
    [
        fwd("F1", (), ("a",), 1.0),
        fwd("F2", ("a",), ("b",), 1.0),
        fwd("F3", ("b",), ("c",), 4.0),
        bwd("B3", ("c",), ("g2",), 1.0),
        bwd("B2", ("g2", "b"), ("g1",), 1.0),
        bwd("B1", ("g1", "a"), (), 1.0),
    ],
    {"a": 100, "b": 200, "c": 50, "g2": 10, "g1": 10},
)
PLAN = Plan(
    planner="hand",
    budget_bytes=None,
    decisions={**keep_all_plan(GRAPH).decisions, "a": Decision.SWAP},
    steps=keep_all_plan(GRAPH).steps,
    offloads=(Transfer("a", Direction.D2H, 0),),
    prefetches=(Transfer("a", Direction.H2D, 4),),
    bound_step_s=9.5,
)


@pytest.fixture(scope="module")
def result():
    return simulate(GRAPH, PLAN, HW, 1000)


def test_trace_has_three_named_tracks_complete_events_and_a_memory_counter(result, tmp_path):
    doc = json.loads(write_trace_json(result, tmp_path / "trace.json").read_text())
    events = doc["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names) == {"compute", "d2h", "h2d"} and len(set(names.values())) == 3
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(result.events) == 8
    by_track = {n: [e for e in complete if e["tid"] == t] for n, t in names.items()}
    assert [(e["args"]["op"], e["args"]["kind"], e["ts"], e["dur"]) for e in by_track["compute"]] == [
        ("F1", "run", 0.0, 1e6),
        ("F2", "run", 1e6, 1e6),
        ("F3", "run", 2e6, 4e6),
        ("B3", "run", 6e6, 1e6),
        ("B2", "run", 7e6, 1e6),
        ("B1", "run", 9e6, 1e6),
    ]
    assert [(e["args"]["tensor"], e["args"]["bytes"], e["ts"], e["dur"]) for e in by_track["d2h"]] == [
        ("a", 100, 1e6, 1e6)
    ]
    assert [(e["args"]["tensor"], e["args"]["bytes"], e["ts"], e["dur"]) for e in by_track["h2d"]] == [
        ("a", 100, 8e6, 1e6)
    ]
    counter = [(e["ts"], e["args"]["bytes"]) for e in events if e["ph"] == "C"]
    assert all(e["name"] == "memory" for e in events if e["ph"] == "C")
    assert counter == [(t * 1e6, b) for t, b in zip(result.memory_times_s, result.memory_bytes, strict=True)]
    assert counter[-1] == (10e6, 0)
    assert all({"pid", "ts", "ph"} <= e.keys() for e in events if e["ph"] != "M")


def test_trace_of_a_recompute_and_of_extra_engines(tmp_path):
    decisions = {**PLAN.decisions, "a": Decision.KEEP, "b": Decision.RECOMPUTE}
    steps = list(keep_all_plan(GRAPH).steps)
    steps.insert(4, ComputeStep("F2", StepKind.RECOMPUTE, ("b",)))
    r = simulate(GRAPH, Plan("hand", None, decisions, tuple(steps)), toy_hardware(d2h_engines=2), None)
    events = json.loads(write_trace_json(r, tmp_path / "t.json").read_text())["traceEvents"]
    recompute = [e for e in events if e["ph"] == "X" and e["args"].get("kind") == "recompute"]
    assert [(e["args"]["op"], e["ts"], e["dur"]) for e in recompute] == [("F2", 7e6, 1e6)]


def test_timeline_png_is_written_for_feasible_infeasible_and_unlimited_runs(result, tmp_path):
    infeasible = simulate(GRAPH, keep_all_plan(GRAPH), HW, 250)
    for name, r, budget in (("ok", result, 1000), ("inf", infeasible, 250), ("free", result, None)):
        path = write_timeline_png(r, tmp_path / f"{name}.png", budget)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_merged_intervals_bridges_only_small_gaps():
    assert merged_intervals([(3.0, 4.0), (0.0, 1.0), (1.05, 2.0), (2.5, 2.6)], 0.1) == [
        (0.0, 2.0),
        (2.5, 2.6),
        (3.0, 4.0),
    ]


def test_metrics_names_values_and_plain_json(result):
    ideal = simulate_ideal(GRAPH, HW)
    m = compute_metrics(result, ideal, plan_wall_s=0.01, sim_wall_s=0.002)
    required = [
        "throughput_ratio",
        "step_s",
        "ideal_step_s",
        "peak_activation_bytes",
        "keep_all_peak_bytes",
        "budget_bytes",
        "recompute_s",
        "stall_s",
        "d2h_bytes",
        "h2d_bytes",
        "swapped_tensors",
        "recomputed_tensors",
        "plan_wall_s",
        "sim_wall_s",
        "feasible",
        "stall_prefetch_s",
        "stall_memory_s",
        "d2h_busy_s",
        "h2d_busy_s",
        "compute_busy_s",
        "bound_step_s",
        "optimality_gap",
    ]
    assert set(required) <= m.keys()
    assert json.loads(json.dumps(m, allow_nan=False)) == m
    assert m["feasible"] is True and m["step_s"] == 10.0 and m["ideal_step_s"] == 9.0
    assert m["throughput_ratio"] == pytest.approx(0.9)
    assert (m["stall_s"], m["stall_prefetch_s"], m["stall_memory_s"]) == (1.0, 1.0, 0.0)
    assert (m["keep_all_peak_bytes"], m["budget_bytes"], m["swapped_tensors"], m["recomputed_tensors"]) == (
        360,
        1000,
        1,
        0,
    )
    assert (m["d2h_bytes"], m["h2d_bytes"], m["d2h_busy_s"], m["h2d_busy_s"]) == (100, 100, 1.0, 1.0)
    assert m["bound_step_s"] == 9.5 and m["optimality_gap"] == pytest.approx(0.5 / 9.5)


def test_metrics_of_an_infeasible_run_are_unknown_not_invented():
    ideal = simulate_ideal(GRAPH, HW)
    r = simulate(GRAPH, keep_all_plan(GRAPH), HW, 250)
    m = compute_metrics(r, ideal, plan_wall_s=None, sim_wall_s=0.001)
    assert m["feasible"] is False and m["step_s"] is None and m["throughput_ratio"] is None
    assert "'F2'" in m["infeasible_reason"] and m["bound_step_s"] is None
    json.dumps(m, allow_nan=False)


def test_metrics_reject_a_non_ideal_reference(result):
    with pytest.raises(ConfigError, match="ideal"):
        compute_metrics(result, result, plan_wall_s=None, sim_wall_s=None)


def test_timeline_figure_draws_every_lane_the_memory_steps_and_keeps_every_text_inside(result):
    """What timeline.png shows, read back from the figure: each lane's merged busy intervals, the
    memory curve holding each sample until the next, budget and peak lines, and no label, legend or
    title cut off by the fixed margins (with names as long as the pipeline's titles)."""
    from slackswap.simulate.timeline import _LANES, timeline_figure

    title = "llama2_70b_long_name on h100_sxm_pcie5, planner selective_recompute, budget 17.3 GiB (50% of peak)"
    fig = timeline_figure(result, 1000, title=title)
    ax_s, ax_m = fig.axes
    span = result.end_s
    drawn = [sorted((round(x, 9), round(x + w, 9)) for x, _, w, _ in (p.get_extents().bounds for p in c.get_paths()))
             for c in ax_s.collections]  # fmt: skip
    wanted = [
        sorted((round(a, 9), round(max(b, a + span / 6000), 9)) for a, b in merged_intervals(
            [(e.start_s, e.end_s) for e in result.events if (e.stream, e.kind) == lane], span / 3000))
        for lane in _LANES
    ]  # fmt: skip
    assert drawn == wanted and any(drawn)
    (curve, *_), times = ax_m.get_lines(), [*result.memory_times_s, span]
    points = set(zip(curve.get_xdata(), curve.get_ydata(), strict=True))
    for i, value in enumerate(result.memory_bytes):  # bytes: the toy graph's unit
        assert (times[i], value) in points and (times[i + 1], value) in points
    labels = [t.get_text() for t in ax_m.get_legend().get_texts()]
    assert labels[0] == "activation memory" and labels[1].startswith("budget 1e+03 bytes")
    assert labels[2] == f"peak {result.peak_activation_bytes:.3g} bytes"
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    canvas = fig.bbox
    texts = [fig._suptitle, ax_s.title, ax_m.xaxis.label, ax_m.yaxis.label, ax_s.get_legend(), ax_m.get_legend(),
             *ax_s.get_yticklabels(), *ax_m.get_yticklabels(), *ax_m.get_xticklabels()]  # fmt: skip
    for artist in texts:
        box = artist.get_window_extent(renderer)
        assert canvas.x0 <= box.x0 and box.x1 <= canvas.x1 and canvas.y0 <= box.y0 and box.y1 <= canvas.y1, artist
