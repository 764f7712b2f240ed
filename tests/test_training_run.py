"""The library side of `python -m pipelines.train`: `TrainingRunSpec` checks every value before any work
(no torch needed), and `run_training` reports through its progress hooks and returns the figures."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slackswap.errors import ConfigError
from slackswap.experiment import Verdict
from slackswap.experiment.training_run import TrainingProgress, TrainingRunSpec, run_training

CONF = Path(__file__).resolve().parents[1] / "conf"


def _preset(group: str, name: str) -> dict:
    data = yaml.safe_load((CONF / group / f"{name}.yaml").read_text())
    data.pop("defaults", None)
    return data


def _config(budget: dict | None = None, **train) -> dict:
    model = {**_preset("model", "tiny"), **_preset("model", "tiny_torch")}  # tiny_torch's defaults: tiny
    return {"model": model, "hardware": _preset("hardware", "a100_80gb_pcie4"),
            "budget": budget or {"fraction": 0.5}, "planner": _preset("planner", "slackswap"),
            "train": {**yaml.safe_load((CONF / "train.yaml").read_text())["train"], **train}}  # fmt: skip


def test_the_spec_reads_every_node() -> None:
    spec = TrainingRunSpec.from_dict(_config(steps=2, seed=3))
    assert (spec.model.name, spec.device, spec.executor, spec.steps, spec.seed) == ("tiny_torch", "cpu", "eager", 2, 3)
    assert spec.planner_name == "slackswap" and spec.planner is not None
    assert spec.torch_spec.builder == "tiny_gpt" and spec.budget.fraction == 0.5


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"device": "gpu"}, "train.device"),
        ({"executor": "jit"}, "train.executor"),
        ({"steps": 0}, "train.steps"),
        ({"steps": True}, "train.steps"),
        ({"seed": 1.5}, "train.seed"),
        ({"lr": 0.0}, "train.lr"),
        ({"lr": "fast"}, "train.lr"),
        ({"keep_freed_host_memory": "yes"}, "train.keep_freed_host_memory"),
        ({"keep_freed_host_memory": 1}, "train.keep_freed_host_memory"),
    ],
)
def test_bad_train_values_name_their_field(change: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        TrainingRunSpec.from_dict(_config(**change))
    assert err.value.field == field


def test_an_analytic_preset_and_unknown_planner_options_fail_before_any_work() -> None:
    config = _config()
    config["model"] = _preset("model", "tiny")
    with pytest.raises(ConfigError, match="model.torch"):
        TrainingRunSpec.from_dict(config)
    config = _config()
    config["planner"] = {"name": "slackswap", "options": {"no_such_option": 1}}
    with pytest.raises(ConfigError, match="planner.options"):
        TrainingRunSpec.from_dict(config)


@pytest.mark.slow
def test_run_training_reports_its_moments_in_order_and_returns_the_figures() -> None:
    from tests.extras import require_torch_extra

    require_torch_extra("torch")
    heard: list[str] = []

    class Recorder(TrainingProgress):
        def building(self, spec) -> None:
            heard.append("building")

        def host_allocator(self, detail) -> None:
            heard.append("host allocator")

        def captured(self, graph, capture_s, keep_all_peak_bytes, budget_bytes) -> None:
            heard.append("captured")

        def checked(self, counts, check) -> None:
            heard.append("checked")

        def step(self, record) -> None:
            heard.append(f"step {record.step}")

    # The model's own holds put half its keep-all peak out of reach (tests/test_train_pipeline.py).
    out = run_training(TrainingRunSpec.from_dict(_config({"fraction": 0.8}, steps=2)), Recorder())
    assert heard == ["building", "host allocator", "captured", "checked", "step 0", "step 1"]
    assert out.verdict == Verdict.OK and out.reason == "" and len(out.records) == 2
    assert out.figures["status"] == Verdict.OK and out.figures["grad_check_bit_exact"] is True
    assert out.figures["losses"] == [r.loss for r in out.records]
    assert out.figures["measured_peak_bytes"] == out.simulation_device_link.peak_activation_bytes
    assert out.figures["sim_peak_activation_bytes"] == out.simulation.peak_activation_bytes
    # train.yaml keeps freed host memory: the run says how (glibc here; `keep_freed_memory` is idempotent).
    from slackswap.profile.host_allocator import host_allocator_label, keep_freed_memory

    assert out.figures["host_allocator"] == keep_freed_memory().detail == host_allocator_label()


def test_an_infeasible_budget_is_an_outcome_not_an_error() -> None:
    from tests.extras import require_torch_extra

    require_torch_extra("torch")
    out = run_training(TrainingRunSpec.from_dict(_config(budget={"bytes": 1})))
    assert out.verdict == Verdict.INFEASIBLE and out.plan is None and out.records == ()
    assert out.reason and out.figures["infeasible_reason"] == out.reason


@pytest.mark.slow
def test_executor_auto_checks_the_gradients_once_when_the_runtime_runs_the_plan(monkeypatch) -> None:
    """executor=auto asks the eager gradient check whether the hook-only program refuses the plan; when it
    does not, the eager executor reuses that check (the same weights, batch, seed and plan) rather than
    making it again. Verified steps: the check's, then the first step's (it records the hook-only program)."""
    from tests.extras import require_torch_extra

    require_torch_extra("torch")
    import slackswap.runtime.eager.verified as verified
    import slackswap.runtime.train as train

    made = {"checks": 0, "verified": 0}
    check, enter = train.gradient_check, verified._VerifiedStep._enter_verified

    def counted_check(*args, **kwargs):
        made["checks"] += 1
        return check(*args, **kwargs)

    def counted_enter(self):
        made["verified"] += 1
        return enter(self)

    monkeypatch.setattr(train, "gradient_check", counted_check)
    monkeypatch.setattr(verified._VerifiedStep, "_enter_verified", counted_enter)
    out = run_training(TrainingRunSpec.from_dict(_config({"fraction": 0.8}, steps=1, executor="auto")))
    f = out.figures
    assert out.verdict == Verdict.OK and f["executor"] == "eager" and f["hook_only_refusal"] is None
    assert made == {"checks": 1, "verified": 2}
    assert f["grad_check_bit_exact"] is True and out.records[0].report.verified
