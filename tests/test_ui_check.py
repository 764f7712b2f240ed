"""The parts of scripts/ui_check.py that need no browser: the UI command, URLs, and which runs it opens."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from pipelines import tracking
from pipelines.schemas import REPO_ROOT


@pytest.fixture(scope="module")
def ui_check():
    spec = importlib.util.spec_from_file_location("ui_check", REPO_ROOT / "scripts" / "ui_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ui_check"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("ui_check", None)


def test_ui_command_and_urls(ui_check) -> None:
    command = ui_check.ui_command(5123)
    assert command[command.index("--workers") + 1] == "1"
    assert command[command.index("--artifacts-destination") + 1] == "./mlruns"  # relative: a moved store serves
    assert ui_check.runs_url("http://h:1", "7") == "http://h:1/#/experiments/7/runs?workflowType=machine_learning"
    assert ui_check.run_url("http://h:1", "7", "abc", "timeline.png") == (
        "http://h:1/#/experiments/7/runs/abc/artifacts/timeline.png?workflowType=machine_learning"
    )
    assert "--headless" in ui_check.CHROMIUM_FLAGS and "--no-sandbox" in ui_check.CHROMIUM_FLAGS


def test_find_targets_picks_parent_and_an_infeasible_and_a_feasible_child(ui_check, mlflow_store) -> None:
    client = mlflow_store.client()
    experiment_id = tracking.ensure_experiment(client, ui_check.EXPERIMENT, str(mlflow_store.artifact_root))
    parent = tracking.create_run(client, experiment_id, "paper · now", {}, None).run_id
    ok = tracking.create_run(client, experiment_id, "slackswap · gpt2_xl", {"status": "ok"}, parent).run_id
    bad = tracking.create_run(
        client, experiment_id, "swap_only · gpt2_xl", {"status": "infeasible", "reason": "too small"}, parent
    ).run_id
    targets = ui_check.find_targets(mlflow_store.uri)
    assert (targets.parent_id, targets.feasible_id, targets.infeasible_id) == (parent, ok, bad)
    assert targets.infeasible_reason == "too small" and len(targets.children) == 2


def test_wait_for_http_names_the_url_on_timeout(ui_check) -> None:
    url = f"http://127.0.0.1:{ui_check.free_port()}/health"
    with pytest.raises(TimeoutError, match="127.0.0.1"):
        ui_check.wait_for_http(url, timeout_s=0.5)
