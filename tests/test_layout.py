"""The package layout is part of the architecture: dependencies point one way."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1] / "slackswap"


def _imports(package: str) -> dict[str, set[str]]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        out[str(path.relative_to(ROOT))] = names
    return out


def test_no_module_of_simulate_or_schedule_imports_planners():
    for package in ("simulate", "schedule"):
        for module, names in _imports(package).items():
            bad = sorted(n for n in names if n.startswith("slackswap.planners"))
            assert not bad, f"{module} imports {bad}"


def test_schedule_does_not_import_simulate():
    for module, names in _imports("schedule").items():
        bad = sorted(n for n in names if n.startswith("slackswap.simulate"))
        assert not bad, f"{module} imports {bad}"


def test_every_strategy_module_registers_a_planner_with_a_preset():
    from slackswap.planners.registry import available_planners

    names = set(available_planners())
    strategies = {p.stem for p in (ROOT / "planners" / "strategies").glob("*.py") if p.stem != "__init__"}
    presets = {p.stem: yaml.safe_load(p.read_text())["name"] for p in (ROOT.parent / "conf" / "planner").glob("*.yaml")}
    assert strategies <= names
    # every planner has a preset of its own name; a variant preset (full_recompute_sqrt: the same
    # planner with other options) names a registered planner
    assert names <= set(presets)
    assert set(presets.values()) <= names
    assert all(presets[name] == name for name in names)
