"""A pipeline run's certified bound (`slackswap.experiment.pipeline_run.with_bound`): below the pipeline
step of every planner's stage plans, reported as `bound_step_s` / `optimality_gap` when the planner
gives bounds (planner=milp) and absent otherwise. The milp here solves the LP of its bound problem
(`exact_max_layers: 0`): a weaker bound than the exact MILP, valid all the same, and fast."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slackswap.experiment import RunSpec, run_one
from slackswap.experiment import pipeline_run as pr
from slackswap.planners.registry import available_planners
from tests.test_experiment import _config

# peak_split off: these tests are about how stage bounds combine, and on these op-level stage LPs the
# split moves no bound but costs 1.5 s of this file (its validity: tests/test_milp.py).
FAST_MILP = {"exact_max_layers": 0, "plan_problem_max_layers": 0, "heuristic_candidates": ["slackswap"],
             "peak_split": False}
LAYOUTS = {
    "1f1b_pp2": {"pp": 2, "microbatches": 4},
    "1f1b_pp4": {"pp": 4, "microbatches": 8},
    "interleaved_pp2_v2": {"pp": 2, "microbatches": 4, "pipeline_schedule": "interleaved", "virtual_stages": 2},
    "zb_h1_pp4": {"pp": 4, "microbatches": 8, "pipeline_schedule": "zb_h1"},
}


def _spec(planner: str, parallel: dict, fraction: float = 0.7, **model) -> RunSpec:
    config = _config("tiny", planner, {"fraction": fraction}, parallel=parallel)
    config["model"] |= {"num_layers": 4, **model}
    if planner == "milp":
        config["planner"]["options"] = {**config["planner"]["options"], **FAST_MILP}
    return RunSpec.from_dict(config)


def _bounded(planner: str, parallel: dict) -> tuple[pr.PipelineOutcome, pr.PipelineOutcome]:
    spec, milp = _spec(planner, parallel), _spec("milp", parallel)
    out = pr.plan_pipeline(spec, pr.build_stages(spec))
    return out, pr.with_bound(replace(spec, planner=milp.planner), out)


def test_a_milp_pipeline_run_reports_its_bound_and_gap():
    m = run_one(_spec("milp", LAYOUTS["1f1b_pp2"])).metrics
    assert m["feasible"] and m["bound_step_s"] is not None
    assert m["bound_step_s"] <= m["step_s"]
    assert m["optimality_gap"] == pytest.approx(m["step_s"] / m["bound_step_s"] - 1, rel=1e-12)
    per_stage = [float(v) for v in m["pipeline_bound_s_by_stage"].split(",")]
    planned = [float(f) + float(b) for f, b in zip(m["pipeline_forward_s_by_stage"].split(","),
                                                   m["pipeline_backward_s_by_stage"].split(","), strict=True)]
    assert len(per_stage) == 2 and all(0 < lo <= hi * (1 + 1e-9) for lo, hi in zip(per_stage, planned, strict=True))


def test_a_planner_without_bounds_reports_none():
    m = run_one(_spec("slackswap", LAYOUTS["1f1b_pp2"])).metrics
    assert m["step_s"] is not None and m["bound_step_s"] is None and m["optimality_gap"] is None
    assert m["pipeline_bound_s_by_stage"] is None


def test_the_stage_floor_is_the_keep_all_stage_time():
    """The floor forward / backward (op durations summed) are the keep-all run's stage times: the floor
    pipeline is the keep-all pipeline, so the bound is never below `ideal_step_s`."""
    out, bounded = _bounded("slackswap", LAYOUTS["1f1b_pp2"])
    spec = _spec("milp", LAYOUTS["1f1b_pp2"])
    for stage in out.stages:
        floor = pr._stage_floor(spec, stage, spec.planner.bound)
        ideal = pr._times(spec, stage.graph, stage.ideal)
        assert floor.forward_s == pytest.approx(ideal.forward_s, rel=1e-12)
        assert floor.backward_s == pytest.approx(ideal.backward_s, rel=1e-12)
        assert floor.step_s >= floor.forward_s + floor.backward_s - 1e-15
    assert bounded.bound.floor_step_s == pytest.approx(out.ideal_pipeline.step_s, rel=1e-12)
    assert bounded.bound.step_s >= bounded.bound.floor_step_s


def _solved_once(planner) -> dict:
    """`planner.bound` answering a repeated problem from memory: every planner's stages are the same
    graphs at the same budgets (the layout's, not the plans'), so their milp bound is one solve per
    stage, not one per planner and stage (~0.34 s CPU each, 13 planners). Keyed by the graph's ops
    and the budget; returns the memory, whose size the test checks."""
    solve, memory = planner.bound, {}

    def bound(graph, hardware, budget_bytes):
        key = (graph.name, tuple(op.name for op in graph.ops), budget_bytes)
        if key not in memory:
            memory[key] = solve(graph, hardware, budget_bytes)
        return memory[key]

    planner.bound = bound
    return memory


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_planners_pipeline_step_is_above_the_bound(layout):
    stepped, milp = 0, _spec("milp", LAYOUTS[layout]).planner
    solved = _solved_once(milp)
    for name in available_planners():
        spec = _spec(name, LAYOUTS[layout])
        out = pr.plan_pipeline(spec, pr.build_stages(spec))
        bounded = pr.with_bound(replace(spec, planner=milp), out)
        if out.pipeline is None:
            continue
        stepped += 1
        assert bounded.bound is not None
        assert bounded.bound.step_s <= out.pipeline.step_s * (1 + 1e-9), name
    assert stepped >= 5  # the check ran on real plans, not only on infeasible stages
    chunks = LAYOUTS[layout]["pp"] * LAYOUTS[layout].get("virtual_stages", 1)
    assert 0 < len(solved) <= chunks  # one problem per stage chunk, whatever the planner


def test_the_plans_own_bound_is_reused_only_at_the_stage_budget():
    """The last stage (one micro-batch in flight) plans at its budget: its plan's milp bound is the
    stage's, and a fresh solve at that budget gives the same figure."""
    spec = _spec("milp", LAYOUTS["1f1b_pp2"])
    out = pr.plan_pipeline(spec, pr.build_stages(spec))
    last = out.stages[-1]
    assert last.fitted.planning_budget_bytes == last.budget_bytes
    reused = pr._stage_floor(spec, last, spec.planner.bound)
    fresh = spec.planner.bound(last.graph, spec.hardware, last.budget_bytes)[0].bound_step_s
    assert reused.step_s == pytest.approx(fresh, rel=1e-9) == last.fitted.plan.bound_step_s


def test_optimizer_ops_are_the_tail_not_the_stage_bound():
    spec = _spec("milp", LAYOUTS["1f1b_pp2"], include_optimizer=True)
    out = pr.with_bound(spec, pr.plan_pipeline(spec, pr.build_stages(spec)))
    assert out.pipeline is not None and out.bound is not None
    assert out.bound.step_s <= out.pipeline.step_s
    for stage in out.stages:
        floor = pr._stage_floor(spec, stage, spec.planner.bound)
        times = pr._times(spec, stage.graph, stage.fitted.result)
        optimizer = sum(op.duration_s for op in stage.graph.ops if op.phase == "optimizer")
        assert optimizer > 0 and floor.tail_s == pytest.approx(optimizer) and floor.tail_s <= times.tail_s * (1 + 1e-9)
        assert floor.step_s <= times.forward_s + times.backward_s


def test_the_pipeline_line_prints_the_bound_only_with_one():
    from pipelines.console import pipeline_line

    m = run_one(_spec("milp", LAYOUTS["1f1b_pp2"])).metrics
    assert f"; step bound {m['bound_step_s']:.6f} s (gap {100 * m['optimality_gap']:+.2f}%;" in pipeline_line(m)
    assert "step bound" not in pipeline_line(m | {"bound_step_s": None, "optimality_gap": None})
