"""docs/extending.md's "Add a planner" example must keep working as written: the module dropped into the
strategies package is discovered by the registry, the YAML builds it, and its plans simulate."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import slackswap.planners.registry as registry
import slackswap.planners.strategies as strategies
from slackswap.errors import InfeasibleBudgetError
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Decision
from slackswap.profile import build_graph
from slackswap.simulate import simulate, validate_plan

ROOT = Path(__file__).resolve().parents[1]


def _block(readme: str, lang: str, path: str) -> str:
    block = re.search(rf"```{lang}\n# {re.escape(path)}\n(.*?)```", readme, re.S)
    assert block, f"docs/extending.md lost its 'Add a planner' {path} example"
    return block.group(1)


def test_readme_planner_example_is_discovered_builds_from_its_yaml_and_simulates(tmp_path, monkeypatch) -> None:
    readme = (ROOT / "docs" / "extending.md").read_text()
    module = _block(readme, "python", "slackswap/planners/strategies/my_planner.py")
    conf = yaml.safe_load(_block(readme, "yaml", "conf/planner/my_planner.yaml"))
    (tmp_path / "my_planner.py").write_text(module)
    # The module lives in a temporary directory added to the strategies package: nothing else is edited.
    # The built-in planners are registered before the registry is swapped for a copy: registered into
    # the copy, they would vanish with it (their modules stay imported and never register again), and
    # every later test would see no planner.
    registry.available_planners()
    monkeypatch.setattr(strategies, "__path__", [*strategies.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    assert "my_planner" in registry.available_planners()

    model = ModelConfig.from_dict(yaml.safe_load((ROOT / "conf/model/tiny.yaml").read_text()))
    hardware = Hardware.from_dict(yaml.safe_load((ROOT / "conf/hardware/a100_80gb_pcie4.yaml").read_text()))
    graph = build_graph(model, hardware)
    planner = registry.get_planner(conf["name"], **conf["options"])
    plan = planner.plan(graph, hardware, None)
    validate_plan(graph, plan)
    assert plan.planner == "my_planner"
    swapped = plan.tensors_with(Decision.SWAP)
    assert len(swapped) == len(range(0, len(graph.saved_tensors), conf["options"]["swap_every"]))
    assert len(plan.offloads) == len(plan.prefetches) == len(swapped)
    assert simulate(graph, plan, hardware, None).feasible
    with pytest.raises(InfeasibleBudgetError, match="my_planner: budget"):
        planner.plan(graph, hardware, 1)
