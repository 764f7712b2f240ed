"""benchmarks/gpu_validate.py on its CPU path (no GPU here): every row is a plan run for real, with
measured and simulated figures, and an exact gradient check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.extras import require_torch_extra

require_torch_extra("torch")
require_torch_extra("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_validate  # noqa: E402


@pytest.mark.slow
def test_cpu_path_writes_one_row_per_plan(tmp_path) -> None:
    import torch

    out = tmp_path / "gv.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the CPU path runs on one thread, then gives the caller's setting back
    try:
        rows = gpu_validate.main(["--device", "cpu", "--models", "gpt2", "--steps", "1", "--out", str(out)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text())["rows"] == rows
    assert [r["planner"] for r in rows] == list(gpu_validate.PLANNERS)
    ran = [r for r in rows if r["status"] == "ok"]
    assert {r["planner"] for r in ran} >= {"keep_all", "slackswap", "capuchin"}
    for r in ran:
        assert r["grad_bit_exact"] is True
        assert r["measured_step_s"] > 0 and r["sim_step_s"] > 0
        # Every device storage against the simulation on the CPU's instant link: equal to the byte.
        assert r["measured_peak_bytes"] == r["sim_peak_device_link_bytes"] and r["peak_ratio"] == 1.0
        assert r["budget_bytes"] is None or r["measured_peak_bytes"] <= r["budget_bytes"]
    for r in rows:
        if r["status"] != "ok":
            assert r["status"] == "infeasible" and r["reason"]
    keep_all = ran[0]
    # Keep-all: the saved ledger's peak is the simulator's saved-bytes peak to the byte.
    assert keep_all["ledger_peak_bytes"] == keep_all["sim_saved_peak_bytes"]


@pytest.mark.slow
def test_cpu_path_also_runs_the_export_compiled(tmp_path, monkeypatch) -> None:
    """--export: the plan also runs exported to PyTorch and compiled, priced by the simulator as
    PyTorch executes it. Each layer group is compiled once: the timed steps reuse the gradient check's
    compiled export."""
    from torch._dynamo.utils import counters

    measured_exports = []
    measure = gpu_validate.measure_export

    def recorded(w, graph, plan, device, steps, export=None, backend="inductor"):
        measured_exports.append((export, dict(export._compiled_fns) if export is not None else {}))
        return measure(w, graph, plan, device, steps, export, backend)

    monkeypatch.setattr(gpu_validate, "measure_export", recorded)
    graphs_before = counters["stats"]["unique_graphs"]
    rows = gpu_validate.main(["--device", "cpu", "--models", "tiny", "--steps", "1", "--export", "slackswap",
                              "--out", str(tmp_path / "gv.json")])
    [(export, compiled_before)] = measured_exports
    assert compiled_before and compiled_before == export._compiled_fns  # compiled already, nothing added
    assert counters["stats"]["unique_graphs"] - graphs_before == len(compiled_before)
    exported = [r for r in rows if r["executor"] == "export_compiled"]
    assert [r["planner"] for r in exported] == ["slackswap"]
    r = exported[0]
    assert r["measured_step_s"] > 0 and r["sim_step_s"] > 0 and r["measured_peak_bytes"] is None
    assert r["grad_max_abs_diff"] < 1.0 and r["export_differences"] >= 0
    # The plan made for the compiled export: no dropout mask saved in another form than it prices.
    assert r["plan_export_executor"] == "compile"
    assert set(r["export_differences_by_reason"]) <= {"the compiled layer's output"}
    assert "(export, compiled)" in gpu_validate.table(rows)
