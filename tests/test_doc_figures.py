"""Figures the docs state about the named experiments are the experiments' own: every "N jobs" next to
an experiment's name in README.md and docs/*.md is the size of its sweep, counted from
conf/experiment/<name>.yaml as Hydra's basic sweeper expands it (a list: its items; `glob(...)`: the
group's presets it selects). A grid that grows leaves no stale count behind (the paper_real section
said 33 jobs where the sweep runs 42)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
NAMES = "|".join(EXPERIMENTS)
#: `+experiment=paper ... # 33 jobs`, `+experiment=paper_real` (45 jobs; ...), `paper` (33 jobs),
#: `hardware` (48 jobs), `a 33-job paper sweep`.
CLAIMS = (
    re.compile(rf"\+experiment=({NAMES})\b[^\n]{{0,80}}?\b(\d+) jobs"),
    re.compile(rf"`({NAMES})` \((\d+) jobs"),
    re.compile(rf"\b(\d+)-job ({NAMES}) sweep"),
)


def sweep_size(name: str) -> int:
    """Jobs of `+experiment=<name>`: the product over its sweeper params of the values each expands to."""
    params = ((yaml.safe_load((ROOT / "conf" / "experiment" / f"{name}.yaml").read_text()).get("hydra") or {})
              .get("sweeper", {}).get("params") or {})
    parser = OverridesParser.create()
    sizes = []
    for key, value in params.items():
        (override,) = parser.parse_overrides([f"{key}={value}"])
        if isinstance(override.value(), Glob):
            options = sorted(p.stem for p in (ROOT / "conf" / key).glob("*.yaml"))
            sizes.append(len(override.value().filter(options)))
        else:
            sizes.append(len(list(override.sweep_string_iterator())) if override.is_sweep_override() else 1)
    return math.prod(sizes)


def claims() -> list[tuple[str, str, int]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for pattern in CLAIMS:
            for match in pattern.finditer(text):
                a, b = match.groups()
                name, count = (b, a) if a.isdigit() else (a, b)
                found.append((f"{path.relative_to(ROOT)}: {match.group(0)!r}", name, int(count)))
    return found


def test_sweep_sizes_are_counted_as_hydra_expands_them() -> None:
    assert sweep_size("paper") == 3 * 11  # 15 planner presets less keep_all and the three torch_*
    assert sweep_size("paper_real") == 3 * 15
    assert sweep_size("hardware") == 3 * 4 * 4
    assert sweep_size("budget_curves") == 3 * 11 * 9
    assert sweep_size("modern") == 3 * 2 * 3 * 7  # models x sequence lengths x platforms x planners


def test_the_scanner_finds_the_docs_claims() -> None:
    names = {name for _, name, _ in claims()}
    assert {"paper", "paper_real", "hardware", "budget_curves", "modern"} <= names


@pytest.mark.parametrize(("where", "name", "count"), claims())
def test_every_job_count_in_the_docs_is_the_sweeps(where, name, count) -> None:
    assert count == sweep_size(name), f"{where}: {name} runs {sweep_size(name)} jobs"
