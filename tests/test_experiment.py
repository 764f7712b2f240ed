"""The experiment layer: RunSpec, run_one's typed outcome, honest floors, monotone feasibility (with the
documented exceptions), the device verdict, tokens/s and MFU."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.experiment import RunSpec, Verdict, run_one
from slackswap.experiment.floor import REL_TOL, least_feasible_budget
from slackswap.experiment.throughput import model_flops
from slackswap.metrics_table import names as metric_names
from slackswap.planners.registry import available_planners

CONF = Path(__file__).resolve().parents[1] / "conf"
#: The metrics.json keys of docs/contract.md's "at least" list: kept, whatever is added (the doc's list
#: is checked against the table by tests/test_metrics_table.py).
CONTRACT_KEYS = set(metric_names(contract=True))
#: Planners whose feasibility is not monotone in the budget (docs/planners.md, "Floors").
NOT_MONOTONE = {"dtr", "recompute_knapsack"}


def _preset(group: str, name: str) -> dict:
    data = yaml.safe_load((CONF / group / f"{name}.yaml").read_text())
    data.pop("defaults", None)
    return data


def _config(model: str, planner: str, budget: dict, **extra) -> dict:
    return {"model": _preset("model", model), "hardware": _preset("hardware", "a100_80gb_pcie4"),
            "budget": budget, "planner": _preset("planner", planner), **extra}  # fmt: skip


def _plans(spec: RunSpec, graph, budget_bytes: float) -> bool:
    try:
        spec.planner.plan(graph, spec.hardware, int(budget_bytes))
    except InfeasibleBudgetError:
        return False
    return True


def test_run_one_returns_typed_figures_that_match_its_metrics() -> None:
    spec = RunSpec.from_dict(_config("tiny", "slackswap", {"fraction": 0.5}))
    out = run_one(spec)
    assert out.verdict == Verdict.OK and out.reason == "" and out.plan is not None and out.result.feasible
    m = out.metrics
    assert set(m) >= CONTRACT_KEYS
    assert (out.step_s, out.tokens_per_s, out.mfu, out.fits_device) == (m["step_s"], m["tokens_per_s"], m["mfu"], True)
    assert out.peak_bytes == m["peak_activation_bytes"] <= m["budget_bytes"] == out.budget_bytes
    assert out.headroom_bytes == m["activation_capacity_bytes"] - out.peak_bytes
    assert set(out.swapped) | set(out.recomputed) and out.graph is out.baseline.graph


def test_the_planner_is_built_once_by_the_spec_and_a_bad_value_names_its_field() -> None:
    spec = RunSpec.from_dict(_config("tiny", "slackswap", {"fraction": 0.5}))
    first = spec.planner
    run_one(spec)
    assert spec.planner is first
    with pytest.raises(ConfigError) as info:
        RunSpec.from_dict(_config("tiny", "slackswap", {"fraction": 0.5}, simulate={"plan_against": "reserved"}))
    assert (info.value.field, info.value.value) == ("simulate.plan_against", "reserved")
    with pytest.raises(ConfigError) as info:
        RunSpec.from_dict(_config("tiny", "slackswap", {"fraction": 0.5}, simulate={"allocater": "caching"}))
    assert info.value.field == "simulate.allocater"


def test_model_flops_are_korthikantis_model_flops_on_a_gpt_graph() -> None:
    """72 B s l h^2 (1 + s/(6h) + V/(12 h l)): Korthikanti et al. 2022, model FLOPs per iteration (no
    recompute); the analytic GPT-2 XL graph's forward + backward FLOPs equal it."""
    spec = RunSpec.from_dict(_config("gpt2_xl", "keep_all", {"fraction": 1.0}))
    out = run_one(spec)
    m = spec.model
    b, s, layers, h, v = m.micro_batch_size, m.seq_len, m.num_layers, m.hidden_size, m.vocab_size
    expected = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))
    assert model_flops(out.graph) == pytest.approx(expected, rel=1e-9)
    metrics = out.metrics
    assert metrics["model_flops"] == model_flops(out.graph)
    assert metrics["tokens_per_s"] == pytest.approx(b * s / metrics["step_s"])
    assert metrics["mfu"] == pytest.approx(expected / (metrics["step_s"] * spec.hardware.peak_for(m.dtype)))
    assert 0 < metrics["mfu"] <= 1


def test_recompute_lowers_tokens_per_s_and_mfu_but_not_model_flops() -> None:
    ideal = run_one(RunSpec.from_dict(_config("tiny", "keep_all", {"fraction": 1.0}))).metrics
    recomputed = run_one(RunSpec.from_dict(_config("tiny", "full_recompute", {"fraction": 0.6}))).metrics
    assert recomputed["recompute_s"] > 0 and recomputed["model_flops"] == ideal["model_flops"]
    assert recomputed["tokens_per_s"] < ideal["tokens_per_s"] and recomputed["mfu"] < ideal["mfu"]
    assert ideal["ideal_mfu"] == pytest.approx(ideal["mfu"])


def test_a_step_over_the_device_is_ok_for_its_budget_but_never_fits_device() -> None:
    """The README's example: AdamW mixed llama7b on one A100 80 GB (100.41 GiB static), absolute budget."""
    out = run_one(RunSpec.from_dict(_config("llama7b", "slackswap", {"bytes": 20_000_000_000})))
    assert out.verdict == Verdict.OK and out.fits_device is False and out.headroom_bytes < 0
    assert out.metrics["device_peak_activation_bytes"] + out.static_bytes + out.metrics["reserve_bytes"] > (
        out.metrics["device_memory_bytes"])
    sharded = _config("llama7b", "slackswap", {"bytes": 20_000_000_000}, training={"zero_stage": 3, "zero_shards": 8})
    assert run_one(RunSpec.from_dict(sharded)).fits_device is True
    device = run_one(RunSpec.from_dict(_config("llama7b", "slackswap", {"device": True})))
    assert device.verdict == Verdict.INFEASIBLE and device.fits_device is False
    no_plan = run_one(RunSpec.from_dict(_config("tiny", "keep_all", {"fraction": 0.5})))
    assert no_plan.verdict == Verdict.INFEASIBLE and no_plan.fits_device is None and no_plan.tokens_per_s is None


def test_a_run_over_the_nodes_pinned_memory_is_infeasible_but_its_step_still_fits_the_device() -> None:
    node = _preset("node", "pcie_workstation") | {"pinned_host_bytes": 1}
    out = run_one(RunSpec.from_dict(_config("tiny", "slackswap", {"fraction": 0.5}, node=node)))
    assert out.metrics["host_peak_bytes"] > 1 and out.verdict == Verdict.INFEASIBLE
    assert out.reason.startswith("pinned host memory") and out.fits_device is True


@pytest.mark.slow
def test_the_bert_large_floor_is_the_least_budget_slackswap_meets() -> None:
    """`budget.bytes=500000000` on bert_large: the planner's last candidate peaked at 6.8 GiB, yet it
    plans within 0.9 GB; the run now reports the floor it reaches."""
    spec = RunSpec.from_dict(_config("bert_large", "slackswap", {"bytes": 500_000_000}))
    out = run_one(spec)
    floor = out.min_feasible_bytes
    assert out.verdict == Verdict.INFEASIBLE and 500_000_000 < floor < 900_000_000
    assert _plans(spec, out.graph, floor * 1.01) and not _plans(spec, out.graph, floor * 0.99)
    assert "the least budget slackswap plans within is" in out.reason and "below the" not in out.reason


def _floor_cases():
    for planner in sorted(available_planners()):
        if planner == "milp":
            continue  # no floor by design (floor_by_bisection = False): test_milp_reports_no_floor_figure
        slow = (pytest.mark.slow,) if planner == "recompute_knapsack" else ()  # a HiGHS knapsack per probe
        yield pytest.param("tiny", planner, id=f"tiny-{planner}", marks=slow)
        yield pytest.param("bert_large", planner, id=f"bert_large-{planner}", marks=pytest.mark.slow)


@pytest.mark.parametrize(("model", "planner"), list(_floor_cases()))
def test_a_plan_exists_just_above_the_floor_and_not_just_below(model: str, planner: str) -> None:
    spec = RunSpec.from_dict(_config(model, planner, {"bytes": 1}))
    out = run_one(spec)
    floor = out.min_feasible_bytes
    assert out.verdict == Verdict.INFEASIBLE and floor is not None
    assert floor <= out.baseline.keep_all_peak_bytes
    assert _plans(spec, out.graph, floor)
    if planner in NOT_MONOTONE:
        # The floor is where the bisection's feasible end met an infeasible budget (within REL_TOL).
        found = least_feasible_budget(spec.planner, out.graph, spec.hardware, 1, out.baseline.keep_all_peak_bytes)
        assert found.floor_bytes == floor and not _plans(spec, out.graph, found.infeasible_bytes)
        assert floor - found.infeasible_bytes <= max(1, int(out.baseline.keep_all_peak_bytes * REL_TOL))
    else:
        assert _plans(spec, out.graph, floor * 1.01) and not _plans(spec, out.graph, floor * 0.99)


def test_milp_reports_no_floor_figure() -> None:
    out = run_one(RunSpec.from_dict(_config("tiny", "milp", {"bytes": 1})))
    assert out.verdict == Verdict.INFEASIBLE and out.min_feasible_bytes is None
    assert "no floor figure for milp" in out.reason


def _grid(spec, out, fractions):
    peak = out.baseline.keep_all_peak_bytes
    return [_plans(spec, out.graph, f * peak) for f in fractions]


@pytest.mark.parametrize(
    "planner",
    [pytest.param(p, marks=pytest.mark.slow) if p == "recompute_knapsack" else p
     for p in sorted(available_planners()) if p != "milp"],
)  # fmt: skip
def test_feasibility_is_monotone_in_the_budget_or_a_documented_exception(planner: str) -> None:
    spec = RunSpec.from_dict(_config("tiny", planner, {"fraction": 1.0}))
    out = run_one(spec)
    fractions = [i / 50 for i in range(5, 51)]
    feasible = _grid(spec, out, fractions)
    holes = [f for f, a, b in zip(fractions, feasible, feasible[1:], strict=False) if a and not b]
    if planner not in NOT_MONOTONE:
        assert not holes, f"{planner}: feasible at {holes} but not at the next budget up"
        return
    # docs/planners.md, "Floors": the budgets on tiny where the planner plans but not just above.
    lower, upper = {"dtr": (0.436, 0.438), "recompute_knapsack": (0.395, 0.400)}[planner]
    assert _grid(spec, out, [lower, upper]) == [True, False]
