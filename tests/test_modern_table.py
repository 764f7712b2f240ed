"""The workload table of `+experiment=modern` (pipelines/modern_table.py): every planner beside ours,
per workload, with its margin and its gap to the bound."""

from __future__ import annotations

import pandas as pd
import pytest

from pipelines.modern_table import workload_table
from slackswap.experiment.spec import RunSpec
from slackswap.parallel import ParallelConfig
from tests.test_config import _compose, _resolved


def test_workload_table_puts_every_planner_beside_ours_with_its_gap():
    rows = []
    for planner, ratio, status, gap in (("slackswap", 0.99, "ok", 0.01), ("swap_only", 0.75, "ok", 0.32),
                                        ("selective_recompute", None, "infeasible", None)):
        rows.append(dict(model="m", **{"model.seq_len": "8192", "platform": "p"}, hardware="h", planner=planner,
                         status=status, throughput_ratio=ratio, gap_to_bound=gap, keep_all_peak_bytes=2**31,
                         budget_bytes=2**30, static_bytes=3 * 2**30))
    md = workload_table(pd.DataFrame(rows), {"workload_table": True, "paper_planner": "slackswap"})
    header, _, row = md.splitlines()[2:5]
    assert header.split(" | ")[-3:] == ["slackswap", "selective_recompute", "swap_only |"]
    assert row.endswith("| 2 | 1 | 3 | 99.0%, gap +1.00% | infeasible | 75.0% (-24.0 pp), gap +32.00% |")
    assert workload_table(pd.DataFrame(rows), {}) == ""


@pytest.mark.parametrize(("platform", "hardware", "node", "tp"), [
    ("a100_pcie4", "a100_80gb_pcie4", "pcie_workstation", 1),
    ("h100_hgx", "h100_sxm_pcie5", "hgx_h100", 8),
    ("gh200_x4", "gh200_c2c", "gh200_x4", 4),
])
def test_a_platform_picks_hardware_node_and_layout_and_the_70b_at_32k_builds(platform, hardware, node, tp):
    cfg = _compose(["+experiment=modern", f"+platform={platform}", "model=llama3_70b", "model.seq_len=32768"])
    spec = RunSpec.from_dict(_resolved(cfg))
    assert (spec.hardware.name, spec.node.name) == (hardware, node)
    assert spec.parallel == ParallelConfig(tp=tp, sp=tp > 1)
    assert spec.budget.fraction == 0.5 and spec.model.seq_len == 32768
