"""The workload table of `+experiment=modern` (pipelines/modern_table.py): every planner beside ours,
per workload, with its margin and its gap to the bound."""

from __future__ import annotations

import pandas as pd
import pytest

from pipelines.modern_table import layout_label, workload_table
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


def test_the_modern_grid_sweeps_the_moe_preset_on_every_platform_with_its_expert_layout():
    import yaml

    from tests.test_config import CONF

    params = yaml.safe_load((CONF / "experiment" / "modern.yaml").read_text())["hydra"]["sweeper"]["params"]
    assert "mixtral_8x7b" in params["model"].split(",")
    # The platform reads the model's kind (conf/model_kind): experts split over the node, tp for dense.
    layouts = {}
    for platform in params["+platform"].split(","):
        for model in ("mixtral_8x7b", "llama3_8b"):
            cfg = _compose(["+experiment=modern", f"+platform={platform}", f"model={model}"])
            layouts[platform, model] = RunSpec.from_dict(_resolved(cfg)).parallel
    assert layouts["a100_pcie4", "mixtral_8x7b"] == ParallelConfig()
    assert layouts["h100_hgx", "mixtral_8x7b"] == ParallelConfig(dp=8, ep=8)
    assert layouts["gh200_x4", "mixtral_8x7b"] == ParallelConfig(dp=4, ep=4)
    assert layouts["h100_hgx", "llama3_8b"] == ParallelConfig(tp=8, sp=True)
    assert layouts["gh200_x4", "llama3_8b"] == ParallelConfig(tp=4, sp=True)


def test_one_moe_job_of_the_grid_runs_at_half_its_keep_all_peak_per_rank(tmp_path, monkeypatch):
    import json

    from tests.test_faults import _in_process

    # The grid's MoE job on the HGX node (ep8 over 8 data-parallel ranks), two layers and 1k tokens.
    code = _in_process(monkeypatch, tmp_path, "+experiment=modern", "hydra.mode=RUN", "model=mixtral_8x7b",
                       "+platform=h100_hgx", "planner=slackswap", "model.num_layers=2", "model.seq_len=1024",
                       "tracking=off", f"hydra.run.dir={tmp_path}/run")
    assert code == 0
    record = json.loads((tmp_path / "run" / "run_record.json").read_text())
    m = record["metrics"]
    assert record["status"] == "ok" and record["choices"]["model_kind"] == "moe"
    assert (m["parallel_ep"], m["parallel_dp"], m["parallel_tp"]) == (8, 8, 1)
    assert m["layout_comm_s"] > 0  # the all-to-alls on NVLink are in the step
    assert m["budget_bytes"] == int(0.5 * m["keep_all_peak_bytes"])
    assert m["peak_activation_bytes"] <= m["budget_bytes"]


def test_the_layout_label_names_one_rank():
    nan = float("nan")
    assert layout_label({"parallel_dp": 8, "parallel_tp": 1, "parallel_pp": 1, "parallel_cp": 1,
                         "parallel_ep": 8, "parallel_sp": False}) == "dp8 ep8"
    assert layout_label({"parallel_dp": 1, "parallel_tp": 8, "parallel_ep": 1, "parallel_sp": True}) == "tp8 sp"
    assert layout_label({"parallel_tp": nan, "parallel_sp": nan}) == "1 GPU"
