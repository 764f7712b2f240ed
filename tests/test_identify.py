"""The shared-assumption grid (slackswap.experiment.identify) and +experiment=seed_identify on toy workloads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from slackswap.errors import ConfigError
from slackswap.experiment import identify
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig

CONF = Path(__file__).resolve().parents[1] / "conf"


def _hardware() -> Hardware:
    return Hardware.from_dict(yaml.safe_load((CONF / "hardware" / "a100_80gb_pcie4.yaml").read_text()))


def _tiny(**kw) -> ModelConfig:
    # four layers of a small GPT-2: big enough that half the keep-all peak is feasible
    shape = {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 1024, "seq_len": 512}
    data = yaml.safe_load((CONF / "model" / "tiny.yaml").read_text()) | shape
    return ModelConfig.from_dict(data | kw)


def _problem() -> identify.Problem:
    workloads = {"a": _tiny(), "b": _tiny(name="tiny_llama", family="llama", dropout=False, attention="flash")}
    return identify.Problem(workloads, {"a": 0.9, "b": 0.95}, _hardware())


SETTING = identify.Setting("eager", False, 0.4, 0.8, 25.0)


def test_a_setting_applies_to_every_workload_alike_and_leaves_llama_without_dropout() -> None:
    bert = _tiny(dropout=True, attention="flash")
    llama = _tiny(family="llama", dropout=False)
    on = replace(SETTING, dropout=True)
    assert on.model(bert).dropout and on.model(bert).attention == "eager"
    assert not on.model(llama).dropout  # llama has no dropout whatever the knob says
    hw = SETTING.hardware(_hardware())
    assert hw.efficiency["matmul"] == 0.4 and hw.hbm_efficiency == 0.8
    assert hw.link.h2d_effective_bytes_per_s == hw.link.d2h_effective_bytes_per_s == 25e9
    assert hw.efficiency["attention"] == _hardware().efficiency["attention"]  # untouched


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"attention": "fused"}, "identify.attention"), ({"matmul_efficiency": 0.0}, "identify.matmul_efficiency"),
     ({"hbm_efficiency": 1.2}, "identify.hbm_efficiency"), ({"link_gbps": -1.0}, "identify.link_gbps")],
)
def test_bad_knob_values_name_the_knob(kwargs, field) -> None:
    with pytest.raises(ConfigError) as info:
        replace(SETTING, **kwargs)
    assert info.value.field == field


def test_a_link_above_the_theoretical_bandwidth_is_refused() -> None:
    with pytest.raises(ConfigError, match="theoretical"):
        replace(SETTING, link_gbps=40.0).hardware(_hardware())


def test_grid_is_full_factorial_and_checks_its_knobs() -> None:
    values = {"attention": ["eager", "flash"], "dropout": [True, False], "matmul_efficiency": [0.3, 0.5, 0.7],
              "hbm_efficiency": [0.8], "link_gbps": [12.5, 25.0]}
    settings = identify.grid(values)
    assert len(settings) == 2 * 2 * 3 * 1 * 2 and len(set(settings)) == len(settings)
    with pytest.raises(ConfigError, match="link_gbps"):
        identify.grid({k: v for k, v in values.items() if k != "link_gbps"})
    with pytest.raises(ConfigError, match="unknown"):
        identify.grid(values | {"batch": [1]})


def test_error_is_the_largest_miss_in_points_and_infeasible_is_never_a_match() -> None:
    ref = {"a": 0.90, "b": 0.95}
    p = identify.Point(SETTING, {"a": 0.902, "b": 0.946}, {"a": 1.0, "b": 1.0})
    assert p.error_pp(ref) == pytest.approx(0.4)
    q = identify.Point(SETTING, {"a": None, "b": 0.95}, {"a": None, "b": 1.0})
    assert q.error_pp(ref) == float("inf")
    assert identify.matches([p, q], ref, 0.5) == [p]
    assert identify.matches([p, q], ref, 0.3) == []


def test_faster_matmuls_leave_less_slack_so_less_throughput_is_kept() -> None:
    problem = _problem()
    slow = identify.evaluate(problem, replace(SETTING, matmul_efficiency=0.2, link_gbps=12.5))
    fast = identify.evaluate(problem, replace(SETTING, matmul_efficiency=0.9, link_gbps=12.5))
    assert all(0 < v <= 1 for v in slow.retained.values())
    assert fast.retained["a"] < slow.retained["a"]


def test_scaling_every_speed_knob_by_one_factor_moves_the_figures_little() -> None:
    """Op and copy times scale together; only launch gaps and copy latencies do not."""
    problem = _problem()
    point = identify.evaluate(problem, SETTING)
    changes = identify.scale_check(problem, point, (0.8,))
    assert set(changes) == {0.8} and changes[0.8] < 1.0


def test_workers_give_the_same_points_as_one_process() -> None:
    problem = _problem()
    settings = identify.grid({"attention": ["eager"], "dropout": [False, True], "matmul_efficiency": [0.3, 0.6],
                              "hbm_efficiency": [0.8], "link_gbps": [25.0]})
    assert identify.evaluate_grid(problem, settings, 2) == identify.evaluate_grid(problem, settings, 1)
    # The backend is joblib's, chosen by name: threads give the same points too.
    assert identify.evaluate_grid(problem, settings, 2, backend="threading") == identify.evaluate_grid(
        problem, settings, 1)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_search_reports_each_point_as_it_is_evaluated(workers) -> None:
    """The seed grid runs for minutes: `on_point` says how far it is (stage, i of n), in order, with
    the point that the result then holds, in this process and over joblib workers alike."""
    problem = _problem()
    coarse = {"attention": ["eager", "flash"], "dropout": [False], "matmul_efficiency": [0.3, 0.6],
              "hbm_efficiency": [0.8], "link_gbps": [25.0]}
    fine = {"matmul_scale": [0.9, 1.1], "hbm_efficiency": [0.8], "link_gbps": [25.0]}
    seen = []
    result = identify.search(problem, coarse, fine, refine_within_pp=1e6, workers=workers,
                             on_point=lambda stage, i, n, point: seen.append((stage, i, n, point)))
    assert [(s, i, n) for s, i, n, _ in seen] == [("coarse", i, 4) for i in range(1, 5)] + [
        ("refined", i, 4) for i in range(1, 5)]
    assert tuple(p for *_, p in seen) == result.points


def test_search_refines_only_combinations_near_the_table_and_pinned_reports_spans() -> None:
    problem = _problem()
    coarse = {"attention": ["eager", "flash"], "dropout": [False], "matmul_efficiency": [0.3, 0.6],
              "hbm_efficiency": [0.8], "link_gbps": [25.0]}
    fine = {"matmul_scale": [0.9, 1.1], "hbm_efficiency": [0.8], "link_gbps": [25.0]}
    everything = identify.search(problem, coarse, fine, refine_within_pp=1e6)
    assert len(everything.refined_combos) == 2 and len(everything.refined) == 2 * 2
    nothing = identify.search(problem, coarse, fine, refine_within_pp=1e-9)
    assert nothing.refined == () and nothing.refined_combos == ()
    ref = problem.reference
    hits = sorted(everything.points, key=lambda p: p.error_pp(ref))[:2]
    spans = identify.pinned(hits, everything.points)
    assert spans["matmul_over_hbm"]["searched"][0] <= spans["matmul_over_hbm"]["matches"][0]
    assert set(spans["attention"]["searched"]) == {"eager", "flash"}


@pytest.mark.slow
def test_seed_identify_experiment_runs_and_logs_one_run(tmp_path, mlflow_store, monkeypatch, capsys) -> None:
    from tests.test_pipeline import _run_cli

    # 10 layers: above milp's exact_max_layers, so the bound is its fast LP relaxation
    tiny = {"num_layers": 10, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 4, "ffn_hidden_size": 512,
            "seq_len": 512, "micro_batch_size": 2, "vocab_size": 128}
    shrink = [f"identify.models.{m}.{k}={v}" for m in ("bert_large", "gpt2_xl", "llama7b") for k, v in tiny.items()]
    args = [
        "+experiment=seed_identify", *shrink,
        "identify.coarse.attention=[eager]", "identify.coarse.dropout=[false]",
        "identify.coarse.matmul_efficiency=[0.3,0.6]", "identify.coarse.hbm_efficiency=[0.8]",
        "identify.coarse.link_gbps=[25.0]", "identify.fine.matmul_scale=[1.0]", "identify.fine.hbm_efficiency=[0.8]",
        "identify.fine.link_gbps=[25.0]", "identify.bound_points=1", "identify.workers=1",
        "identify.tolerance_pp=100", "identify.refine_within_pp=100",  # toy shapes: every point "matches"
        f"tracking.uri={mlflow_store.uri}", f"tracking.artifact_location={mlflow_store.artifact_root}",
        "tracking.experiment=test", f"hydra.run.dir={tmp_path}/run", "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
    ]
    assert _run_cli(monkeypatch, args) in (0, None)
    out = capsys.readouterr().out
    # Progress as it goes (it printed nothing for the whole grid): each point, the bound, the scale check.
    for head in ("[coarse 1/2 ", "[coarse 2/2 ", "[refined 1/1 ", "[bound 1/1 ", "[scale check "):
        assert any(line.startswith(head) for line in out.splitlines()), (head, out)
    data = json.loads((tmp_path / "run" / "identify.json").read_text())
    assert data["settings_evaluated"] == 2 + 1 and len(data["matches"]) == 3
    assert data["best"][0]["bound_gap"]  # milp ran at the best point
    assert "What the figures pin down" in (tmp_path / "run" / "identify_summary.md").read_text()
    client = mlflow_store.client()
    runs = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["settings_evaluated"] == 3


def test_seed_identify_bad_knob_exits_2_before_any_run(tmp_path, mlflow_store, monkeypatch) -> None:
    from tests.test_pipeline import _run_cli

    args = ["+experiment=seed_identify", "identify.fine.link_gbps=[40.0]", f"tracking.uri={mlflow_store.uri}",
            f"tracking.artifact_location={mlflow_store.artifact_root}", "tracking.experiment=test",
            f"hydra.run.dir={tmp_path}/run", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(ConfigError, match="identify.link_gbps"):
        _run_cli(monkeypatch, args)
    assert mlflow_store.client().get_experiment_by_name("test") is None


def test_settings_that_differ_in_link_only_share_a_graph_and_give_what_a_fresh_build_gives() -> None:
    problem = _problem()
    identify._GRAPHS.clear()
    identify.evaluate(problem, replace(SETTING, link_gbps=12.5))
    reused = identify.evaluate(problem, SETTING)
    assert len(identify._GRAPHS) == len(problem.workloads)  # the second setting built nothing
    identify._GRAPHS.clear()
    assert identify.evaluate(problem, SETTING) == reused
