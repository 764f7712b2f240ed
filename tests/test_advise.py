"""The advise search (slackswap.experiment.advise): pruning, step pricing, ranking, bad input, and one
small end-to-end `python -m pipelines.advise` on the tiny model with a temporary MLflow store."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pipelines import advise_report, tracking
from slackswap.communication import Fabric, Topology
from slackswap.errors import ConfigError
from slackswap.experiment.advise import (
    ACTIVATIONS_DO_NOT_FIT,
    RECIPE_DOES_NOT_APPLY,
    STATIC_DOES_NOT_FIT,
    SearchSpace,
    activation_floor_bytes,
    distinct_ranked,
    layouts,
    pareto_front,
    plan_search,
    run_search,
)
from slackswap.experiment.throughput import model_flops
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.memory.static import static_memory
from slackswap.model_config import ModelConfig
from slackswap.profile import build_graph, parameter_counts

REPO = Path(__file__).resolve().parents[1]
TOPO = Topology(8, Fabric("nvlink", 230e9, 2e-6), Fabric("network", 25e9, 6e-7))
MIXED = TrainingConfig(precision="mixed")
PURE16 = TrainingConfig(precision="pure16")
FP32 = TrainingConfig(precision="fp32")


def _load(group: str, name: str) -> dict:
    return yaml.safe_load((REPO / "conf" / group / f"{name}.yaml").read_text())


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return ModelConfig.from_dict(_load("model", "tiny"))


@pytest.fixture(scope="module")
def a100() -> Hardware:
    return Hardware.from_dict(_load("hardware", "a100_80gb_pcie4"))


def _graphs(model: ModelConfig, hardware: Hardware, calls: list[int] | None = None):
    def graph_for(mb: int):
        if calls is not None:
            calls.append(mb)
        return build_graph(replace(model, micro_batch_size=mb, include_optimizer=False), hardware)

    return graph_for


def _space(**kw) -> SearchSpace:
    base = dict(gpus=(1,), recipes={"mixed": MIXED}, micro_batches=(1, 2, 4), planners={"keep_all": {}},
                plan_against=("allocated",), reserve_bytes=0)
    return SearchSpace(**{**base, **kw})


def test_layouts_of_one_node_and_two():
    assert [(x.zero_stage, x.zero_shards) for x in layouts(1, (0, 1, 2, 3), 8)] == [(0, 1)]
    assert [(x.zero_stage, x.zero_shards) for x in layouts(8, (0, 1, 2, 3), 8)] == [(0, 1), (1, 8), (2, 8), (3, 8)]
    # Two nodes: stage 3 over all 16, and HSDP sharded within a node.
    assert [(x.zero_stage, x.zero_shards) for x in layouts(16, (3,), 8)] == [(3, 16), (3, 8)]


def test_static_pruning_plans_nothing_that_cannot_fit(tiny, a100):
    tiny = replace(tiny, hidden_size=512, ffn_hidden_size=2048, seq_len=8)  # parameters decide
    n, unit = parameter_counts(tiny)
    mixed = static_memory(n, unit, MIXED, tiny.dtype).total_bytes
    pure = static_memory(n, unit, PURE16, tiny.dtype).total_bytes
    # A device between the two recipes' static bytes, with room for pure16's activations.
    hw = replace(a100, device_memory_bytes=(pure + mixed) // 2)
    assert pure < hw.device_memory_bytes < mixed
    assert activation_floor_bytes(_graphs(tiny, hw)(4)) < hw.device_memory_bytes - pure
    space = _space(recipes={"mixed": MIXED, "pure16": PURE16, "fp32": FP32})
    plan, _ = plan_search(tiny, hw, TOPO, space, _graphs(tiny, hw))
    reasons = {r.choices["recipe"]: r.reason for r in plan.regions}
    assert reasons == {"mixed": STATIC_DOES_NOT_FIT, "fp32": RECIPE_DOES_NOT_APPLY}
    assert {c.recipe for c in plan.candidates} == {"pure16"}
    assert plan.pruned_configurations == 2 * 3  # two recipes x three micro-batches x one planner


def test_micro_batch_search_stops_at_the_floor(tiny, a100):
    n, unit = parameter_counts(tiny)
    static = static_memory(n, unit, MIXED, tiny.dtype).total_bytes
    floors = {mb: activation_floor_bytes(_graphs(tiny, a100)(mb)) for mb in (1, 2, 4, 8)}
    assert floors[1] < floors[2] < floors[4] < floors[8]
    # Room for micro-batch 2's floor, not for 4's.
    hw = replace(a100, device_memory_bytes=static + (floors[2] + floors[4]) // 2)
    calls: list[int] = []
    plan, _ = plan_search(tiny, hw, TOPO, _space(micro_batches=(1, 2, 4, 8)), _graphs(tiny, hw, calls))
    assert [c.micro_batch for c in plan.candidates] == [1, 2]
    (region,) = plan.regions
    assert region.reason == ACTIVATIONS_DO_NOT_FIT and region.choices["micro_batch"] == 4
    assert region.configurations == 2  # micro-batches 4 and 8
    assert 8 not in calls  # the search stopped: no graph was built beyond the first that cannot fit


def test_floor_is_a_lower_bound_of_every_plan(tiny, a100):
    from slackswap.experiment.fitting import plan_and_simulate
    from slackswap.planners.registry import get_planner

    graph = _graphs(tiny, a100)(4)
    floor = activation_floor_bytes(graph)
    fitted = plan_and_simulate(get_planner("full_recompute"), graph, a100, 10**12)
    assert fitted.result.peak_activation_bytes >= floor


def test_step_pricing_and_ranking(tiny, a100):
    space = _space(gpus=(1, 8), recipes={"mixed": MIXED, "pure16": PURE16},
                   planners={"keep_all": {}, "full_recompute": {}}, plan_against=("allocated", "reserved"))
    advice = run_search(tiny, a100, TOPO, space, _graphs(tiny, a100))
    ok = [r for r in advice.rows if r.tokens_per_s is not None]
    assert ok
    for r in ok:
        c = r.candidate
        assert r.tokens_per_s == pytest.approx(c.micro_batch * tiny.seq_len / r.step_s)
        assert r.step_s == pytest.approx(r.micro_step_s + r.comm.forward_exposed_s + r.comm.backward_exposed_s
                                         + r.optimizer_s + r.comm.after_step_comm_s)
        graph = _graphs(tiny, a100)(c.micro_batch)
        assert r.mfu == pytest.approx(model_flops(graph) / (r.step_s * a100.peak_for("bf16")))
        assert r.headroom_bytes == a100.device_memory_bytes - r.peak_bytes
        if c.layout.gpus == 1:
            assert r.comm.total_comm_s == 0
    # Full recompute repeats forward work: never faster than keeping everything where both fit.
    keep = {(r.candidate.layout, r.candidate.recipe, r.candidate.micro_batch): r.step_s
            for r in ok if r.candidate.planner == "keep_all" and r.fits_device}
    for r in ok:
        k = (r.candidate.layout, r.candidate.recipe, r.candidate.micro_batch)
        if r.candidate.planner == "full_recompute" and k in keep:
            assert r.step_s > keep[k]
    # Ranked by tokens/s per GPU, fitting rows only; the best per GPU count is the first of its count.
    tps = [advice.rows[i].tokens_per_s for i in advice.ranked]
    assert tps == sorted(tps, reverse=True)
    assert all(advice.rows[i].fits_device for i in advice.ranked)
    for gpus, i in advice.best.items():
        assert advice.rows[i].tokens_per_s == max(r.tokens_per_s for r in ok if r.fits_device
                                                  and r.candidate.layout.gpus == gpus)
        assert advice.rows[i].why
    distinct = distinct_ranked(advice)
    assert len(distinct) < len(advice.ranked)  # keep_all allocated/reserved tie where it fits


def test_the_answer_is_the_same_whatever_the_workers(tiny, a100):
    """Every configuration, milp included, priced over two loky processes and over two threads gives the
    very rows of one process, in the same order: tasks carry what they need and caches only memoise."""
    space = _space(gpus=(1, 8), recipes={"mixed": MIXED, "pure16": PURE16}, micro_batches=(1, 2),
                   planners={"keep_all": {}, "full_recompute": {}, "milp": {}}, plan_against=("allocated", "reserved"),
                   milp_top_k=1)
    one = run_search(tiny, a100, TOPO, space, _graphs(tiny, a100))
    seen: list[int] = []
    two = run_search(tiny, a100, TOPO, replace(space, n_jobs=2), _graphs(tiny, a100),
                     on_row=lambda i, n, row: seen.append(i))
    threads = run_search(tiny, a100, TOPO, replace(space, n_jobs=2, backend="threading"), _graphs(tiny, a100))
    assert any(r.candidate.planner == "milp" for r in one.rows)
    assert two.rows == one.rows and threads.rows == one.rows
    assert (two.best, two.ranked, two.regions) == (one.best, one.ranked, one.regions)
    assert seen == list(range(1, len(one.rows) + 1))  # reported in order, each as it arrives


def test_grad_accumulation_amortises_the_optimizer(tiny, a100):
    one = run_search(tiny, a100, TOPO, _space(micro_batches=(2,)), _graphs(tiny, a100)).rows[0]
    two = run_search(tiny, a100, TOPO, _space(micro_batches=(2,), grad_accum=2), _graphs(tiny, a100)).rows[0]
    assert two.step_s == pytest.approx(2 * one.micro_step_s + one.optimizer_s)
    assert two.tokens_per_s > one.tokens_per_s


def test_a_slow_network_makes_a_communication_bound_region(tiny, a100):
    from slackswap.experiment.advise import COMMUNICATION_BOUND

    slow = Topology(8, Fabric("nvlink", 230e9, 2e-6), Fabric("network", 1e6, 1e-5))
    advice = run_search(tiny, a100, slow, _space(gpus=(16,), zero_stages=(0, 3)), _graphs(tiny, a100))
    bound = {(g.choices["zero_stage"], g.choices["zero_shards"]) for g in advice.regions
             if g.reason == COMMUNICATION_BOUND}
    # DDP and full ZeRO-3 over 16 GPUs run their rings over the network: communication bound. HSDP
    # gathers on NVLink but still all-reduces its gradient shard across the two nodes.
    assert (0, 1) in bound and (3, 16) in bound
    rows = [r for r in advice.rows if r.candidate.layout.zero_shards == 16]
    assert rows and all(r.bound == COMMUNICATION_BOUND and r.comm.fabric == "network" for r in rows)


def test_fsdp1_pays_its_rate_limiters_stall_per_gather_and_micro_batch(tiny, a100):
    """Under FullyShardedDataParallel each micro-batch of a sharded ZeRO-3 rank pays the preset's stall
    per rate-limited all-gather (two per unit); fully_shard and an unsharded layout pay none; a preset
    without the figure (0, every uncalibrated one) prices both APIs alike."""
    from slackswap.communication import rate_limited_all_gathers
    from slackswap.experiment.advise_step import layer_param_counts

    stall = replace(a100, rate_limited_all_gather_s=1e-3)
    fsdp1 = replace(MIXED, fsdp_api="FullyShardedDataParallel")
    space = _space(gpus=(1, 8), micro_batches=(2,), zero_stages=(3,), grad_accum=3)

    def rows(hw, recipe):
        advice = run_search(tiny, hw, TOPO, replace(space, recipes={"r": recipe}), _graphs(tiny, hw))
        return {(r.candidate.layout.gpus, r.candidate.layout.zero_shards): r for r in advice.rows}

    two, one, plain = rows(stall, fsdp1), rows(stall, MIXED), rows(a100, fsdp1)
    units = len(layer_param_counts(tiny))
    gathers = rate_limited_all_gathers(True, 3, 8, units)
    assert gathers == 2 * units
    assert two[(8, 8)].step_s == pytest.approx(one[(8, 8)].step_s + 3 * gathers * 1e-3)
    assert two[(1, 1)].step_s == pytest.approx(one[(1, 1)].step_s)
    assert plain[(8, 8)].step_s == pytest.approx(rows(a100, MIXED)[(8, 8)].step_s)


def test_pareto_front():
    pts = [(1.0, 10.0), (2.0, 5.0), (2.0, 12.0), (3.0, 11.0), (4.0, 20.0)]
    assert pareto_front(pts) == [0, 2, 4]


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"gpus": (0,)}, "advise.gpus"), ({"micro_batches": (4, 2)}, "advise.micro_batches"),
     ({"plan_against": ("peak",)}, "advise.plan_against"), ({"grad_accum": 0}, "advise.grad_accum"),
     ({"recipes": {}}, "advise.recipes"), ({"zero_stages": (4,)}, "advise.zero_stages"),
     ({"planners": {"milp": {}}}, "advise.planners"), ({"n_jobs": 0}, "advise.n_jobs")],
)
def test_bad_search_space_names_the_field(kw, field):
    with pytest.raises(ConfigError) as info:
        _space(**kw)
    assert info.value.field == field


def test_a_job_wider_than_the_node_needs_a_network(tiny, a100):
    lonely = Topology(8, Fabric("nvlink", 230e9, 2e-6), None)
    with pytest.raises(ConfigError, match="advise.gpus"):
        plan_search(tiny, a100, lonely, _space(gpus=(16,)), _graphs(tiny, a100))


# --- the command ------------------------------------------------------------------------------------


def _run_advise(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> int:
    """`python -m pipelines.advise ARGS` in this process (Hydra finds ../conf only from __main__)."""
    import runpy
    import sys
    import warnings

    from hydra.core.global_hydra import GlobalHydra

    monkeypatch.setattr(sys, "argv", ["pipelines/advise.py", *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    GlobalHydra.instance().clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            runpy.run_module("pipelines.advise", run_name="__main__")
    except SystemExit as exc:
        return exc.code
    finally:
        GlobalHydra.instance().clear()
    raise AssertionError("pipelines.advise did not exit")


def _advise_args(tmp_path: Path, store) -> list[str]:
    return [
        "model=tiny", f"tracking.uri={store.uri}", f"tracking.artifact_location={store.artifact_root}",
        "tracking.experiment=advise_test", f"hydra.run.dir={tmp_path}/run", "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled", "advise.micro_batches=[1,2]", "advise.recipes=[adamw_mixed,adamw_pure16]",
        "advise.planners=[keep_all,full_recompute,milp]", "advise.milp_top_k=1", "advise.n_jobs=1",
    ]


@pytest.mark.parametrize(
    ("override", "needle"),
    [("advise.gpus=[0]", "advise.gpus"), ("advise.recipes=[nope]", "advise.recipes='nope'"),
     ("planner=slackswap", "planner='slackswap'"), ("budget=half", "budget"),
     ("advise.graph=measured", "advise.graph"), ("advise.virtual_stages=[1,2]", "advise.virtual_stages=[1, 2]"),
     ("advise.pipeline_schedule=zero_bubble", "advise.pipeline_schedule='zero_bubble'"),
     ("advise.ep=[0]", "advise.ep=[0]")],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, mlflow_store, monkeypatch, capsys, override, needle):
    code = _run_advise(monkeypatch, [*_advise_args(tmp_path, mlflow_store), override])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]
    # Nothing was recorded: no run in the store.
    client = mlflow_store.client()
    assert client.get_experiment_by_name("advise_test") is None


@pytest.mark.slow
def test_end_to_end_advise_on_the_tiny_model(tmp_path, mlflow_store, monkeypatch, capsys):
    assert _run_advise(monkeypatch, _advise_args(tmp_path, mlflow_store)) == 0
    out = capsys.readouterr().out
    assert "best on 1 GPU(s):" in out and "best on 8 GPU(s):" in out and "tokens/s per GPU" in out
    run = tmp_path / "run"
    data = json.loads((run / "advice.json").read_text())
    assert data["schema"] == "slackswap-advice/1"
    n = data["evaluated"]
    assert n == len(data["rows"]) and f"[{n}/{n}" in out
    for row in data["rows"]:
        for key in ("tokens_per_s", "mfu", "step_s", "peak_bytes", "headroom_bytes", "fits_device", "gpus",
                    "zero_stage", "zero_shards", "recipe", "micro_batch", "planner", "plan_against",
                    "comm_not_modelled"):
            assert key in row
    assert {r["planner"] for r in data["rows"]} == {"keep_all", "full_recompute", "milp"}
    assert (run / "advise_pareto.png").stat().st_size > 0 and (run / "advice.md").is_file()
    client = mlflow_store.client()
    exp = client.get_experiment_by_name("advise_test")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    answers = advise_report.answer_rows(data)
    assert len(parents) == 1 and len(children) == len(answers) >= 2  # the best per GPU count and recipe
    folder = tracking.local_artifact_dir(parents[0].info.artifact_uri, mlflow_store.artifact_root)
    assert json.loads((folder / "advice.json").read_text())["rows"] == data["rows"]  # every configuration
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    best = data["rows"][data["best"]["8"]]
    match = [r for r in children if r.data.params["planner"] == best["planner"]
             and r.data.params["micro_batch"] == str(best["micro_batch"])
             and r.data.params["recipe"] == best["recipe"] and r.data.params["gpus"] == "8"
             and r.data.params["plan_against"] == best["plan_against"]
             and r.data.params["zero_stage"] == str(best["zero_stage"])]
    assert len(match) == 1 and match[0].data.metrics["tokens_per_s"] == pytest.approx(best["tokens_per_s"])
    assert parents[0].data.metrics["configurations_evaluated"] == n
