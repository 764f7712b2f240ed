"""The README's "Add a planner" example must keep working as written."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Decision
from slackswap.planners.registry import get_planner
from slackswap.profile import build_graph
from slackswap.simulate import simulate, validate_plan

ROOT = Path(__file__).resolve().parents[1]


def test_readme_planner_example_registers_plans_and_simulates() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(# slackswap/planners/my_planner\.py\n.*?)```", readme, re.S)
    assert block, "README lost its 'Add a planner' example"
    exec(compile(block.group(1), "README:my_planner", "exec"), {})

    model = ModelConfig.from_dict(yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))
    hardware = Hardware.from_dict(yaml.safe_load((ROOT / "conf/hardware/a100_80gb_pcie4.yaml").read_text()))
    graph = build_graph(model, hardware)
    plan = get_planner("my_planner", swap_every=3).plan(graph, hardware, None)
    validate_plan(graph, plan)
    assert plan.planner == "my_planner"
    swapped = plan.tensors_with(Decision.SWAP)
    assert len(swapped) == len(range(0, len(graph.saved_tensors), 3))
    assert len(plan.offloads) == len(plan.prefetches) == len(swapped)
    assert simulate(graph, plan, hardware, None).feasible
