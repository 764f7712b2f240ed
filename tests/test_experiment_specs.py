"""The advise's and the seed grid's specs (slackswap.experiment.advise_spec, identify_spec) built from
plain mappings, without Hydra: a good config gives the typed inputs, every bad value one ConfigError
naming its dotted field and the value, and the spec runs its search."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from slackswap.errors import ConfigError
from slackswap.experiment.advise_spec import AdviseSpec
from slackswap.experiment.identify_spec import IdentifyProgress, IdentifySpec, run_study

CONF = Path(__file__).resolve().parents[1] / "conf"


def _load(group: str, name: str) -> dict[str, Any]:
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


def _presets() -> dict[str, dict[str, dict[str, Any]]]:
    return {group: {p.stem: _load(group, p.stem) for p in (CONF / group).glob("*.yaml")}
            for group in ("training", "planner")}


def _advise_config(**advise: Any) -> dict[str, Any]:
    node = {"gpus": [1, 8], "recipes": ["adamw_mixed", "adamw_pure16"], "micro_batches": [1, 2],
            "planners": ["keep_all", "milp"], "plan_against": ["allocated"], "zero_stages": [0, 3],
            "grad_accum": 1, "milp_top_k": 1, "graph": "analytic", "top": 5}
    return {"model": _load("model", "tiny"), "hardware": _load("hardware", "a100_80gb_pcie4"),
            "node": _load("node", "dgx_a100"), "profile": {"source": "analytic"},
            "budget": _load("budget", "device"), "advise": node | advise}


def test_advise_spec_from_plain_mappings() -> None:
    spec = AdviseSpec.from_dict(_advise_config(), _presets())
    assert spec.model.name == "tiny" and spec.space.gpus == (1, 8) and spec.top == 5
    assert list(spec.space.recipes) == ["adamw_mixed", "adamw_pure16"]
    assert spec.space.recipes["adamw_pure16"].precision == "pure16"
    # planner presets become name -> options, the options of the preset file
    assert spec.space.planners["milp"] == _load("planner", "milp")["options"]
    assert spec.space.reserve_bytes == _load("budget", "device")["reserve_bytes"]
    assert spec.topology.gpus_per_node == spec.node.gpus_per_node == 8
    assert spec.notes == ("optimizer step: included in every step (advise prices whole training steps)",)


@pytest.mark.parametrize(
    ("change", "field", "value"),
    [
        ({"advise": {"recipes": ["nope"]}}, "advise.recipes", "nope"),
        ({"advise": {"recipes": ["adamw_mixed", "adamw_mixed"]}}, "advise.recipes", ["adamw_mixed", "adamw_mixed"]),
        ({"advise": {"planners": "keep_all"}}, "advise.planners", "keep_all"),
        ({"advise": {"gpus": [0]}}, "advise.gpus", [0]),
        ({"advise": {"gpus": 8}}, "advise.gpus", 8),
        ({"advise": {"micro_batches": [2, 1]}}, "advise.micro_batches", [2, 1]),
        ({"advise": {"graph": "measured"}}, "advise.graph", "measured"),
        ({"advise": {"top": 0}}, "advise.top", 0),
        ({"advise": {"top": True}}, "advise.top", True),
        ({"advise": {"grad_accum": 1.5}}, "advise.grad_accum", 1.5),
        ({"advise": {"plan_against": ["peak"]}}, "advise.plan_against", ["peak"]),
        ({"planner": {"name": "slackswap"}}, "planner", {"name": "slackswap"}),
        ({"budget": _load("budget", "half")}, "budget", "?"),
        ({"hardware": {"device_memory_bytes": -1}}, "hardware.device_memory_bytes", -1),
    ],
)
def test_bad_advise_input_is_one_error_naming_field_and_value(change: dict, field: str, value: Any) -> None:
    config = copy.deepcopy(_advise_config())
    for node, values in change.items():
        config[node] = (config.get(node) or {}) | values if node in ("advise", "hardware") else values
    with pytest.raises(ConfigError) as err:
        AdviseSpec.from_dict(config, _presets())
    assert err.value.field == field and err.value.value == value
    assert str(err.value).startswith(f"{field}={value!r}: ") and "\n" not in str(err.value)


def test_a_chosen_group_is_named_as_the_user_chose_it() -> None:
    config = _advise_config() | {"budget": _load("budget", "half")}
    with pytest.raises(ConfigError, match=r"^budget='half': advise plans against the device"):
        AdviseSpec.from_dict(config, _presets(), {"budget": "half"})


def test_advise_spec_searches_on_its_node() -> None:
    spec = AdviseSpec.from_dict(_advise_config(gpus=[1], recipes=["adamw_mixed"], planners=["keep_all"],
                                               zero_stages=[0], micro_batches=[1]), _presets())
    seen = []
    advice = spec.search(on_row=lambda i, n, row: seen.append((i, n)))
    assert seen == [(i, len(advice.rows)) for i in range(1, len(advice.rows) + 1)] and len(seen) >= 1
    assert set(advice.best) == {1} and advice.rows[advice.best[1]].fits_device


# --- the seed grid ------------------------------------------------------------------------------------


def _identify_config(**identify: Any) -> dict[str, Any]:
    shape = {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 1024, "seq_len": 512}
    tiny = _load("model", "tiny") | shape
    llama = tiny | {"name": "tiny_llama", "family": "llama", "dropout": False, "attention": "flash"}
    node = {"models": {"a": tiny, "b": llama}, "reference": {"a": 0.9, "b": 0.95}, "tolerance_pp": 100.0,
            "budget_fraction": 0.5, "planner": "slackswap", "bound_planner": "milp", "bound_points": 0,
            "workers": 1, "refine_within_pp": 0.001,
            "coarse": {"attention": ["eager"], "dropout": [False], "matmul_efficiency": [0.4],
                       "hbm_efficiency": [0.8], "link_gbps": [12.5, 25.0]},
            "fine": {"matmul_scale": [1.0], "hbm_efficiency": [0.8], "link_gbps": [25.0]},
            "ranges": {"attention": "eager or flash"}}
    return {"hardware": _load("hardware", "a100_80gb_pcie4"), "identify": node | identify}


def test_identify_spec_from_plain_mappings() -> None:
    spec = IdentifySpec.from_dict(_identify_config())
    assert set(spec.problem.workloads) == {"a", "b"} and spec.problem.reference == {"a": 0.9, "b": 0.95}
    assert spec.workers == 1 and spec.bound_points == 0 and spec.tolerance_pp == 100.0
    assert spec.coarse["link_gbps"] == [12.5, 25.0] and spec.ranges == {"attention": "eager or flash"}


@pytest.mark.parametrize(
    ("change", "field", "value"),
    [
        ({"models": {}}, "identify.models", {}),
        ({"reference": {"a": 0.9}}, "identify.reference", ["a"]),
        ({"reference": {"a": 0.9, "b": 96.3}}, "identify.reference.b", 96.3),
        ({"tolerance_pp": 0}, "identify.tolerance_pp", 0),
        ({"refine_within_pp": "1"}, "identify.refine_within_pp", "1"),
        ({"workers": 0}, "identify.workers", 0),
        ({"bound_points": -1}, "identify.bound_points", -1),
        ({"budget_fraction": 1.5}, "identify.budget_fraction", 1.5),
        ({"fine": {"matmul_scale": [1.0, -0.5], "hbm_efficiency": [0.8], "link_gbps": [25.0]}},
         "identify.fine.matmul_scale", [1.0, -0.5]),
        ({"fine": {"matmul_scale": [1.0], "hbm": [0.8]}}, "identify.fine", ["hbm"]),
        ({"fine": {"matmul_scale": [1.0], "hbm_efficiency": [0.8], "link_gbps": [40.0]}}, "identify.link_gbps", 40.0),
        ({"coarse": {"attention": ["eager"]}}, "identify.grid.dropout", None),
        ({"bound_planner": "nope"}, "planner.name", "nope"),
    ],
)
def test_bad_identify_input_is_one_error_naming_field_and_value(change: dict, field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as err:
        IdentifySpec.from_dict(_identify_config(**change))
    assert err.value.field == field and err.value.value == value
    assert str(err.value).startswith(f"{field}={value!r}: ") and "\n" not in str(err.value)


def test_a_traced_workload_is_refused_naming_it() -> None:
    config = _identify_config()
    config["identify"]["models"]["b"] = config["identify"]["models"]["b"] | {"torch": {"module": "x"}}
    with pytest.raises(ConfigError, match=r"^identify\.models\.b\.torch="):
        IdentifySpec.from_dict(config)


class _Recorder(IdentifyProgress):
    def __init__(self) -> None:
        self.moments: list[tuple] = []

    def point(self, stage, i, n, point) -> None:
        self.moments.append(("point", stage, i, n))

    def scale_check(self, point) -> None:
        self.moments.append(("scale", point.setting.link_gbps))


def test_a_study_runs_from_its_spec_and_reports_each_moment() -> None:
    spec = IdentifySpec.from_dict(_identify_config())
    said = _Recorder()
    outcome = run_study(spec, said)
    assert len(outcome.search.coarse) == 2
    assert said.moments[:2] == [("point", "coarse", 1, 2), ("point", "coarse", 2, 2)]
    errors = [p.error_pp(spec.problem.reference) for p in outcome.search.points]
    assert outcome.best_error_pp == min(errors)
    assert len(outcome.hits) == len(outcome.search.points)  # tolerance 100 pp: every feasible point matches
    best = min(outcome.search.points, key=lambda p: p.error_pp(spec.problem.reference))
    assert said.moments[-1] == ("scale", best.setting.link_gbps) and outcome.best == ()  # bound_points 0
    assert set(outcome.pins) >= {"attention", "link_gbps"} and outcome.wall_s > 0
