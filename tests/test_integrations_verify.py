"""Predict, then verify, into the user's MLflow (slackswap.integrations.verify, docs/integrations.md).

A three-block residual MLP under `PlannedStep` (the step every integration runs): the verified steps'
predicted and measured peak and step time reach the active MLflow run (a SQLite store under the
test's tmp_path); with mlflow not imported nothing imports it; a forced miss (a prediction made
wrong on purpose, or a zero step tolerance on measured op times) warns exactly once over several
verified steps; bad tolerances are one line naming the field. The same through the HF Trainer."""

from __future__ import annotations

import dataclasses
import math
import runpy
import sys
import warnings

import pytest

from pipelines.schemas import REPO_ROOT
from tests.extras import require_torch_extra

torch = require_torch_extra()

from slackswap.integrations.planning import IntegrationError  # noqa: E402
from slackswap.integrations.step import PlannedStep  # noqa: E402
from slackswap.integrations.verify import Tolerances  # noqa: E402
from tests.fsdp2_worker import Net, _loss  # noqa: E402  (the same three-block residual MLP)

KEYS = ("slackswap/predicted_peak_bytes", "slackswap/measured_peak_bytes", "slackswap/step_s",
        "slackswap/predicted_step_s")


def _steps(n: int = 3, **kwargs: object) -> PlannedStep:
    model, x = Net(), torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    kwargs.setdefault("budget", 0.8)
    state = PlannedStep(printer=lambda _: None, **kwargs)
    for _ in range(n):
        state.run(model, (x,), _loss)
    return state


def _misses(n: int = 3, **kwargs: object) -> tuple[PlannedStep, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = _steps(n, **kwargs)
    return state, [str(w.message) for w in caught if str(w.message).startswith("slackswap:")]


@pytest.mark.slow
def test_the_verified_steps_go_to_the_active_mlflow_run(mlflow_store) -> None:
    import mlflow

    mlflow.set_tracking_uri(mlflow_store.uri)
    with mlflow.start_run() as run:
        state = _steps(3, verify_steps=2)
    assert state.mlflow_steps == [0, 1]
    client = mlflow_store.client()
    for key in KEYS:
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [0, 1]
        assert [m.value for m in history] == [float(f[key]) for f in state.logged]
    measured = client.get_metric_history(run.info.run_id, "slackswap/measured_peak_bytes")
    assert measured[0].value == state.planned.predicted_peak_bytes > 0


def test_without_an_active_run_nothing_goes_to_mlflow() -> None:
    mlflow = pytest.importorskip("mlflow")  # imported by the user, no run started
    assert mlflow.active_run() is None
    assert _steps(2).mlflow_steps == []


class _NoMlflow:
    """A meta-path finder that fails any import of mlflow."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] == "mlflow":
            raise AssertionError(f"slackswap imported {name}")


def test_without_mlflow_imported_nothing_imports_it(monkeypatch) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "mlflow"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoMlflow(), *sys.meta_path])
    state = _steps(2)
    assert len(state.logged) == 1 and state.mlflow_steps == []
    assert not any(n.split(".")[0] == "mlflow" for n in sys.modules)


def test_a_peak_miss_warns_once_over_three_verified_steps() -> None:
    made = _steps(1).planned
    wrong = dataclasses.replace(made, predicted_peak_bytes=made.predicted_peak_bytes // 2)
    state, misses = _misses(3, planned=wrong, verify_steps=3)
    assert len(state.logged) == 3 and all(f["slackswap/peak_as_predicted"] == 0.0 for f in state.logged)
    assert len(misses) == 1 and f"exceeds the predicted {wrong.predicted_peak_bytes} B" in misses[0]
    # within a tolerance that covers the doubled peak: no warning, the figures say as predicted
    state, misses = _misses(2, planned=wrong, verify_steps=2, tolerances=Tolerances(peak_tolerance=1.5))
    assert misses == [] and all(f["slackswap/peak_as_predicted"] == 1.0 for f in state.logged)


def test_the_step_time_is_judged_only_on_measured_op_times() -> None:
    from slackswap.integrations.planning import plan_step
    from slackswap.profile.measured import retime
    from slackswap.runtime.op_times import cached_op_times

    roofline = _steps(1).planned
    # a roofline step time on the A100 preset is not this CPU's: logged, never judged
    state, misses = _misses(2, planned=roofline, verify_steps=2, tolerances=Tolerances(step_tolerance=0.0))
    assert misses == [] and all("slackswap/step_relative_error" not in f for f in state.logged)
    model, x = Net(), torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    table, _ = cached_op_times(roofline.graph, model, (x,), _loss, None, warmup=1, repeats=3)
    measured = plan_step(retime(roofline.graph, table)[0], model, 0.8)
    assert measured.graph.meta["timing"] == "measured"
    # no wall clock equals a prediction to the last bit: a zero tolerance misses, and warns once
    state, misses = _misses(3, planned=measured, verify_steps=3, tolerances=Tolerances(step_tolerance=0.0))
    assert all(f["slackswap/step_relative_error"] > 0 for f in state.logged)
    assert len(misses) == 1 and "off the predicted" in misses[0] and "step_tolerance=0.0" in misses[0]
    state, misses = _misses(2, planned=measured, verify_steps=2, tolerances=Tolerances(step_tolerance=1e9))
    assert misses == [] and len(state.logged) == 2


@pytest.mark.parametrize(("field", "value"), [("peak_tolerance", -0.1), ("peak_tolerance", math.nan),
                                              ("step_tolerance", math.inf), ("step_tolerance", "5%")])
def test_a_bad_tolerance_is_one_line_naming_the_field(field, value) -> None:
    with pytest.raises(IntegrationError, match=rf"^{field}=.*: must be a finite number >= 0") as caught:
        Tolerances(**{field: value})
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_the_hf_trainer_logs_the_verified_step_to_mlflow(mlflow_store, tmp_path) -> None:
    import mlflow

    require_torch_extra("transformers")
    require_torch_extra("accelerate")
    from slackswap.integrations.hf import plan_for

    ex = runpy.run_path(str(REPO_ROOT / "examples" / "hf_trainer.py"))
    with pytest.raises(IntegrationError, match=r"^peak_tolerance=-1.0: must be a finite number >= 0"):
        plan_for(ex["make_trainer"]("llama", str(tmp_path / "bad")), peak_tolerance=-1.0)
    mlflow.set_tracking_uri(mlflow_store.uri)
    for report_to in ([], ["mlflow"]):  # the trainer's own MLflowCallback, or slackswap directly
        trainer = ex["make_trainer"]("llama", str(tmp_path / f"run{len(report_to)}"), steps=2, report_to=report_to)
        with mlflow.start_run() as run:
            state = plan_for(trainer, budget=0.5, printer=lambda _: None)
            trainer.train()
        assert state.mlflow_steps == ([] if report_to else [0])
        history = mlflow_store.client().get_metric_history(run.info.run_id, "slackswap/measured_peak_bytes")
        assert [m.value for m in history] == [state.planned.predicted_peak_bytes]  # once, not twice
