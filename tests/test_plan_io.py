"""plan.json: schema-versioned, round-trips to an equal Plan, rejects what it cannot read."""

from __future__ import annotations

import json
import random

import pytest

from slackswap.errors import ConfigError
from slackswap.plan import PLAN_SCHEMA_VERSION
from slackswap.plan_io import plan_from_dict, plan_to_dict, read_plan_json, write_plan_json
from slackswap.schedule.build import build_schedule
from slackswap.testing import random_decisions, random_graph, toy_hardware


def _plan():
    rng = random.Random(3)
    g = random_graph(rng, max_layers=3)
    return build_schedule(g, random_decisions(g, rng), planner="t", budget_bytes=1234, hardware=toy_hardware(),
                          bound_step_s=1.5, notes={"why": "test", "n": 2})


def test_round_trip_through_a_file_gives_an_equal_plan(tmp_path):
    plan = _plan()
    path = write_plan_json(plan, tmp_path / "plan.json")
    assert read_plan_json(path) == plan
    assert json.loads(path.read_text())["schema_version"] == PLAN_SCHEMA_VERSION == 2
    assert read_plan_json(path).graph_fingerprint == plan.graph_fingerprint != ""


def test_the_schedule_key_ignores_who_made_a_plan_and_sees_what_it_runs():
    """`Plan.schedule_key`: planner, budget, bound and notes do not change the step an executor runs;
    a decision, a step or the graph does."""
    from dataclasses import replace

    plan = _plan()
    assert replace(plan, planner="other", budget_bytes=None, bound_step_s=None, notes={}).schedule_key() == \
        plan.schedule_key()
    name, decision = next(iter(plan.decisions.items()))
    other = next(d for d in type(decision) if d != decision)
    assert replace(plan, decisions={**plan.decisions, name: other}).schedule_key() != plan.schedule_key()
    assert replace(plan, steps=plan.steps[:-1]).schedule_key() != plan.schedule_key()
    assert replace(plan, graph_fingerprint="x").schedule_key() != plan.schedule_key()


def test_a_version_1_file_is_read_with_an_unknown_fingerprint():
    data = plan_to_dict(_plan())
    data["schema_version"] = 1
    del data["graph_fingerprint"]
    assert plan_from_dict(data).graph_fingerprint == ""
    data["graph_fingerprint"] = "abc"  # a version-2 field in a version-1 file is not accepted silently
    with pytest.raises(ConfigError, match="graph_fingerprint"):
        plan_from_dict(data)


def test_unknown_schema_version_is_rejected():
    data = plan_to_dict(_plan())
    data["schema_version"] = 99
    with pytest.raises(ConfigError, match="schema_version"):
        plan_from_dict(data)


def test_missing_and_unknown_fields_are_named():
    data = plan_to_dict(_plan())
    del data["steps"]
    with pytest.raises(ConfigError, match="steps"):
        plan_from_dict(data)
    data = plan_to_dict(_plan())
    data["extra"] = 1
    with pytest.raises(ConfigError, match="extra"):
        plan_from_dict(data)
