"""The simulator on real profile graphs and planner schedules (tiny preset: milliseconds)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Decision
from slackswap.profile import build_graph
from slackswap.schedule.build import build_schedule, keep_all_plan
from slackswap.simulate import simulate, validate_plan
from slackswap.testing import random_decisions

CONF = Path(__file__).resolve().parents[1] / "conf"


def load(group: str, name: str) -> dict:
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


@pytest.fixture(scope="module")
def tiny():
    hw = Hardware.from_dict(load("hardware", "a100_80gb_pcie4"))
    return build_graph(ModelConfig.from_dict(load("model", "tiny")), hw), hw


def test_keep_all_step_is_the_sum_of_op_times_and_peak_fits_its_own_budget(tiny):
    graph, hw = tiny
    ideal = simulate(graph, keep_all_plan(graph), hw, None)
    assert ideal.feasible and ideal.stall_s == 0.0
    assert ideal.step_s == pytest.approx(sum(op.duration_s for op in graph.ops), rel=1e-12)
    at_peak = simulate(graph, keep_all_plan(graph), hw, ideal.peak_activation_bytes)
    assert at_peak.events == ideal.events
    below = simulate(graph, keep_all_plan(graph), hw, ideal.peak_activation_bytes - 1)
    assert not below.feasible and "budget of" in below.infeasible_reason


@pytest.mark.parametrize("seed", range(4))
def test_build_schedule_plans_validate_and_respect_the_budget(tiny, seed):
    graph, hw = tiny
    decisions = random_decisions(graph, random.Random(seed))
    plan = build_schedule(graph, decisions, planner="test", budget_bytes=None, hardware=hw)
    validate_plan(graph, plan)
    ideal = simulate(graph, keep_all_plan(graph), hw, None)
    free = simulate(graph, plan, hw, None)
    assert free.feasible and free.step_s >= ideal.step_s
    assert free.swapped_tensors == sum(d == Decision.SWAP for d in decisions.values())
    budget = free.peak_activation_bytes * 3 // 4
    tight = simulate(graph, plan, hw, budget)
    assert max(tight.memory_bytes) <= budget
