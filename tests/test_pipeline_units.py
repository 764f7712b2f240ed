"""Unit tests of the pipeline helpers that need no Hydra run: flattening, metrics, aggregation."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pandas as pd
import pytest

from pipelines import aggregate, tracking
from pipelines.hydra_versions import MAIN_VERSION
from pipelines.records import RECORD_FILE, RunRecord, RunStatus


def test_flatten_params_nested_none_and_lists() -> None:
    flat = tracking.flatten_params({"model": {"num_layers": 2, "source": ""}, "budget": {"bytes": None}, "x": [1, 2]})
    assert flat == {"model.num_layers": "2", "model.source": "", "budget.bytes": "null", "x": "[1, 2]"}


def test_numeric_metrics_casts_bools_and_rejects_non_numbers() -> None:
    metrics = {"feasible": False, "step_s": 1.5, "n": 3, "stall_s": None, "infeasible_reason": "x"}
    assert tracking.numeric_metrics(metrics) == {
        "feasible": 0.0,
        "step_s": 1.5,
        "n": 3.0,
    }
    with pytest.raises(TypeError, match="note"):
        tracking.numeric_metrics({"note": ["fast"]})
    with pytest.raises(ValueError, match="step_s"):
        tracking.numeric_metrics({"step_s": math.nan})


def _record(
    job: str,
    model: str,
    planner: str,
    fraction: float,
    status: str,
    ratio: float | None,
    bound_step_s: float | None = None,
) -> RunRecord:
    metrics = {
        "keep_all_peak_bytes": 1000,
        "budget_bytes": int(1000 * fraction),
        "feasible": status == "ok",
        "ideal_step_s": 1.0,
    }
    if ratio is not None:
        metrics["throughput_ratio"] = ratio
        metrics["step_s"] = 1.0 / ratio
    if bound_step_s is not None:
        metrics["bound_step_s"] = bound_step_s
    return RunRecord(
        run_name=f"{planner} {model}",
        choices={"model": model, "planner": planner},
        model=model,
        hardware="gpu",
        planner=planner,
        planner_name=planner,
        budget_fraction=fraction,
        budget_bytes_requested=None,
        run_dir=f"sweep/{job}",
        status=RunStatus(status),
        failure_reason="" if status == "ok" else "planner: does not fit",
        metrics=metrics,
        job=job,
    )


def test_paper_table_reports_deltas_best_baseline_and_missing_models() -> None:
    frame = aggregate.records_to_frame(
        [
            _record("0", "bert_large", "slackswap", 0.5, "ok", 0.95),
            _record("1", "bert_large", "capuchin", 0.5, "ok", 0.90),
            _record("2", "bert_large", "swap_only", 0.5, "infeasible", None),
            _record("3", "gpt2_xl", "slackswap", 0.5, "infeasible", None),
        ]
    )
    md = aggregate.paper_table(frame, {"paper_reference": {"bert_large": 0.963, "gpt2_xl": 0.976, "llama7b": 0.996}})
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in md.splitlines()[4:7]}
    assert rows["bert_large"][3:9] == ["96.3%", "95.0%", "-1.3", "-", "-", "90.0% (capuchin)"]
    assert rows["gpt2_xl"][4] == "-" and rows["gpt2_xl"][9].startswith("infeasible")
    assert rows["llama7b"][4] == "not run"
    assert aggregate.paper_table(frame, {}) == ""


def test_paper_table_shows_the_reserved_peak_and_counts_plans_that_still_fit() -> None:
    records = [
        _record("0", "bert_large", "slackswap", 0.5, "ok", 0.95),
        _record("1", "bert_large", "capuchin", 0.5, "ok", 0.90),
        _record("2", "bert_large", "swap_only", 0.5, "infeasible", None),
    ]
    for rec, reserved, fits in ((records[0], 2**30, False), (records[1], 2**29, True)):
        rec.metrics.update({"peak_reserved_bytes": reserved, "fits_reserved": fits, "fragmentation_share": 0.25})
    md = aggregate.paper_table(aggregate.records_to_frame(records), {"paper_reference": {"bert_large": 0.963}})
    row = next(line for line in md.splitlines() if line.startswith("| bert_large"))
    assert "| 1 (over budget, 25.0% fragmentation) |" in row
    assert "1 of the 2 plans that fit their budget byte-exactly (50%) still fit" in md


def test_bound_of_one_planner_gives_every_planner_of_the_same_problem_a_gap() -> None:
    frame = aggregate.records_to_frame(
        [
            _record("0", "bert_large", "slackswap", 0.5, "ok", 0.95),
            _record("1", "bert_large", "milp", 0.5, "ok", 0.95, bound_step_s=1.0 / 0.96),
            _record("2", "bert_large", "capuchin", 0.7, "ok", 0.90),
            _record("3", "bert_large", "swap_only", 0.5, "infeasible", None),
        ]
    )
    gaps = dict(zip(frame["job"], frame["gap_to_bound"], strict=True))
    assert gaps["0"] == pytest.approx(0.96 / 0.95 - 1)
    assert gaps["1"] == pytest.approx(0.96 / 0.95 - 1)
    assert math.isnan(gaps["2"])  # another budget: the bound does not apply
    assert math.isnan(gaps["3"])  # no step time
    md = aggregate.paper_table(frame, {"paper_reference": {"bert_large": 0.963}, "paper_planner": "slackswap"})
    paper_row = next(line for line in md.splitlines() if line.startswith("| bert_large"))
    assert "+1.05%" in paper_row
    margins = md.split("## Every planner at the paper's budget")[1]
    milp_row = next(line for line in margins.splitlines() if line.startswith("| milp"))
    assert "+0.0 pp vs slackswap" in milp_row and "gap +1.05%" in milp_row
    assert "| swap_only | infeasible |" in margins


def test_aggregate_sweep_writes_summary_and_plots(tmp_path) -> None:
    records = [
        _record("0", "tiny", "slackswap", 0.5, "ok", 0.97),
        _record("1", "tiny", "slackswap", 1.0, "ok", 1.0),
        _record("2", "tiny", "keep_all", 0.5, "infeasible", None),
        _record("3", "tiny", "keep_all", 1.0, "ok", 1.0),
    ]
    for rec in records:
        (tmp_path / rec.job).mkdir()
        rec.write(tmp_path / rec.job)
    result = aggregate.aggregate_sweep(tmp_path, {})
    assert result.status_counts == {"ok": 3, "infeasible": 1}
    assert not result.paper_table_md
    for name in ("summary.csv", "summary.md", "throughput_vs_budget.png", "planner_comparison.png"):
        assert (tmp_path / name).stat().st_size > 0
    table = pd.read_csv(tmp_path / "summary.csv")
    assert list(table["budget_share"]) == [0.5, 0.5, 1.0, 1.0]
    assert "planner: does not fit" in (tmp_path / "summary.md").read_text()


def test_aggregate_sweep_without_plots_writes_tables_only(tmp_path) -> None:
    rec = _record("0", "tiny", "slackswap", 0.5, "ok", 0.97)
    (tmp_path / "0").mkdir()
    rec.write(tmp_path / "0")
    result = aggregate.aggregate_sweep(tmp_path, {}, plots=False)
    assert sorted(p.name for p in result.files) == ["summary.csv", "summary.md"]
    assert not (tmp_path / "throughput_vs_budget.png").exists()


def test_plot_level_auto_depends_on_the_mode_and_a_bad_value_is_named() -> None:
    from pipelines.plots import plot_level
    from slackswap.errors import ConfigError

    assert plot_level({"plots": "auto"}, multirun=False) == "all"
    assert plot_level({"plots": "auto"}, multirun=True) == "summary"
    assert plot_level({"plots": "all"}, multirun=True) == "all"
    assert plot_level({"plots": "none"}, multirun=False) == "none"
    with pytest.raises(ConfigError, match="plots"):
        plot_level({"plots": "some"}, multirun=False)


def test_a_single_run_does_not_import_pandas_or_the_aggregation() -> None:
    """Lazy imports: the job path of a single run (stages, job, callbacks) leaves pandas unloaded."""
    import subprocess
    import sys

    from pipelines.schemas import REPO_ROOT

    probe = (
        "import sys, pipelines.run, pipelines.callbacks, pipelines.job, pipelines.plots\n"
        "print(sorted(n for n in ('pandas', 'pipelines.aggregate', 'matplotlib') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("metrics", None, "run_record.metrics=None: must be a JSON object"),
        ("metrics.step_s", "0.5", "run_record.metrics.step_s='0.5': must be a number"),
        ("metrics.throughput_ratio", [1],
         "run_record.metrics.throughput_ratio=[1]: must be a number, a boolean, a string or null"),
        ("choices", ["tiny"], "run_record.choices=['tiny']: must be a JSON object"),
        ("budget_fraction", "half", "run_record.budget_fraction='half': must be a number or null"),
        ("planner", None, "run_record.planner=None: must be a string"),
    ],
)  # fmt: skip
def test_a_record_with_a_wrong_field_is_named_and_the_good_jobs_are_summarised(tmp_path, field, value, named):
    """Valid JSON with a wrong field (a hand edit, another tool's file): one line naming the file and the
    field, the record left out, the other jobs summarised (it was a traceback and no summary)."""
    for rec in (_record("0", "tiny", "slackswap", 0.5, "ok", 0.97), _record("1", "tiny", "keep_all", 1.0, "ok", 1.0)):
        (tmp_path / rec.job).mkdir()
        rec.write(tmp_path / rec.job)
    path = tmp_path / "1" / RECORD_FILE
    data = json.loads(path.read_text())
    node, _, leaf = field.rpartition(".")
    (data[node] if node else data)[leaf] = value
    path.write_text(json.dumps(data))
    result = aggregate.aggregate_sweep(tmp_path, {}, plots=False)
    assert result.problems == (f"{path}: unreadable (ConfigError: {named})",)
    assert [r.job for r in result.records] == ["0"] and result.status_counts == {"ok": 1}
    assert f"{path}: unreadable" in (tmp_path / "summary.md").read_text()


def test_aggregate_without_records_fails_loudly(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="no job"):
        aggregate.aggregate_sweep(tmp_path, {})


def test_backfill_writes_the_certified_gap_onto_child_runs(mlflow_store) -> None:
    client = mlflow_store.client()
    experiment_id = tracking.ensure_experiment(client, "backfill", str(mlflow_store.artifact_root))
    run_ids = [tracking.create_run(client, experiment_id, f"job{i}", {}, None).run_id for i in range(3)]
    records = [
        _record("0", "bert_large", "slackswap", 0.5, "ok", 0.95),
        _record("1", "bert_large", "milp", 0.5, "ok", 0.95, bound_step_s=1.0 / 0.96),
        _record("2", "bert_large", "swap_only", 0.5, "infeasible", None),
    ]
    records = [replace(rec, mlflow_run_id=run_id) for rec, run_id in zip(records, run_ids, strict=True)]
    for rec in records:
        tracking.end_run(client, rec.mlflow_run_id, rec.status)
    frame = aggregate.records_to_frame(records)
    assert tracking.backfill_bound_gaps(client, frame) == 2
    slack = client.get_run(run_ids[0]).data.metrics
    assert slack["gap_to_bound"] == pytest.approx(0.96 / 0.95 - 1)
    assert slack["best_bound_s"] == pytest.approx(1.0 / 0.96)
    assert "gap_to_bound" not in client.get_run(run_ids[2]).data.metrics


def test_one_requested_fraction_is_one_budget_group_across_models() -> None:
    # Budgets are floored to whole bytes, so 50 % of two different peaks is not exactly 0.5 of each.
    records = [
        _record("0", "bert_large", "slackswap", 0.5, "ok", 0.95),
        _record("1", "gpt2_xl", "slackswap", 0.5, "ok", 0.9),
    ]
    records[1].metrics.update({"keep_all_peak_bytes": 1_000_003, "budget_bytes": int(0.5 * 1_000_003)})
    frame = aggregate.records_to_frame(records)
    assert list(frame["budget_share"]) == [0.5, 0.5]


def test_a_long_sweep_description_is_cut_at_mlflows_limit():
    from pipelines import tracking

    class Client:
        def set_experiment_tag(self, experiment_id, key, value):
            self.value = value

    client = Client()
    tracking.set_experiment_description(client, "1", "x" * 30000)
    assert len(client.value) == tracking.EXPERIMENT_TAG_MAX_CHARS and client.value.endswith("artifacts)")
    tracking.set_experiment_description(client, "1", "short")
    assert client.value == "short"


def test_run_record_round_trips_and_reads_a_record_written_before_the_type() -> None:
    from slackswap.errors import ConfigError

    record = _record("7", "tiny", "slackswap", 0.5, "infeasible", None)
    data = record.to_dict()
    assert "job" not in data and data["status"] == "infeasible"  # the job is the folder, never written
    assert RunRecord.from_dict(json.loads(json.dumps(data)), job="7") == record
    # Today's keys, as job.py wrote them as a plain dict: they still read.
    old = {
        "run_name": "slackswap 50%", "choices": {"model": "tiny"}, "model": "tiny", "hardware": "gpu",
        "planner": "slackswap", "planner_name": "slackswap", "budget_fraction": 0.5, "budget_bytes_requested": None,
        "run_dir": "outputs/x", "mlflow_run_id": None, "status": "killed", "failure_reason": "interrupted",
        "metrics": {}, "facts": {}, "timings_s": {"profile_s": 0.1},
    }  # fmt: skip
    # A record written before `versions` existed still reads (no versions known).
    assert set(old) | {"versions"} == set(data)
    assert RunRecord.from_dict(old).status is RunStatus.KILLED and RunRecord.from_dict(old).versions == {}
    with pytest.raises(ConfigError) as bad_status:
        RunRecord.from_dict(old | {"status": "done"})
    assert bad_status.value.field == "run_record.status" and bad_status.value.value == "done"
    with pytest.raises(ConfigError, match="throughput"):
        RunRecord.from_dict(old | {"throughput": 0.9})
    with pytest.raises(ConfigError, match="run_name"):
        RunRecord.from_dict({k: v for k, v in old.items() if k != "run_name"})


def test_run_status_values_are_the_strings_of_json_files_and_mlflow_tags(tmp_path) -> None:
    assert [s.value for s in RunStatus] == ["ok", "infeasible", "failed", "killed"]
    assert json.dumps({"status": RunStatus.INFEASIBLE}) == '{"status": "infeasible"}'
    assert f"{RunStatus.KILLED:>8}" == "  killed" and str(RunStatus.FAILED) == "failed"
    assert set(tracking.MLFLOW_STATUS) == set(RunStatus)
    assert {s: tracking.MLFLOW_STATUS[s] for s in ("ok", "failed")} == {"ok": "FINISHED", "failed": "FAILED"}
    path = _record("0", "tiny", "slackswap", 0.5, "ok", 0.9).write(tmp_path)
    assert json.loads(path.read_text())["status"] == "ok"


def _stage_outcome(tmp_path, name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipelines import schemas
    from slackswap.experiment import RunSpec, run_one, write_run_files

    with initialize_config_dir(config_dir=str(schemas.REPO_ROOT / "conf"), **MAIN_VERSION):
        cfg = compose("config", overrides=[*overrides, "tracking=off", "plots=none"])
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    run_dir = tmp_path / name
    run_dir.mkdir()
    spec = RunSpec.from_dict(resolved)
    outcome = run_one(spec)
    write_run_files(spec, outcome, run_dir, {})
    assert json.loads((run_dir / "metrics.json").read_text()) == outcome.metrics
    return outcome


@pytest.mark.parametrize("allocator", ["none", "caching"])
def test_metrics_have_one_key_set_for_every_outcome(tmp_path, allocator) -> None:
    common = [f"simulate.allocator={allocator}"]
    ok = _stage_outcome(tmp_path, "ok", [*common, "model=tiny", "planner=keep_all", "budget.fraction=1.0"])
    planner = _stage_outcome(tmp_path, "planner", [*common, "model=tiny", "planner=keep_all", "budget.fraction=0.5"])
    device = _stage_outcome(tmp_path, "device", [*common, "model=llama7b", "budget=device"])
    assert ok.verdict == RunStatus.OK
    assert planner.verdict == RunStatus.INFEASIBLE and planner.reason.startswith("planner:")
    assert device.verdict == RunStatus.INFEASIBLE and device.reason.startswith("device memory:")
    assert set(ok.metrics) == set(planner.metrics) == set(device.metrics)
    assert ("peak_reserved_bytes" in ok.metrics) == (allocator == "caching")
    # What an outcome did not compute is None, not left out and not made up.
    assert ok.metrics["step_s"] > 0 and planner.metrics["step_s"] is None and device.metrics["step_s"] is None
    assert device.metrics["budget_bytes"] is None and planner.metrics["budget_bytes"] > 0
    assert planner.metrics["headroom_bytes"] == planner.metrics["activation_capacity_bytes"]


def test_profile_source_is_a_config_choice_and_an_unknown_one_is_named() -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from pipelines import schemas
    from slackswap.errors import ConfigError
    from slackswap.experiment import RunSpec
    from slackswap.profile.sources import select_source

    def resolved(overrides):
        with initialize_config_dir(config_dir=str(schemas.REPO_ROOT / "conf"), **MAIN_VERSION):
            cfg = compose("config", overrides=[*overrides, "tracking=off"])
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)

    analytic = RunSpec.from_dict(resolved(["model=tiny"]))
    assert (analytic.profile_source, analytic.torch_spec) == ("analytic", None)
    # A traced preset's `torch` node selects the torch source and is its options (no torch import here).
    traced = RunSpec.from_dict(resolved(["model=tiny_torch"]))
    assert traced.profile_source == "torch" and traced.profile_options["builder"] == "tiny_gpt"
    assert traced.torch_spec.builder == "tiny_gpt"
    family = RunSpec.from_dict(resolved(["model=gpt2_xl", "profile=torch", "+profile.options.attention=eager"]))
    assert (family.torch_spec.builder, family.torch_spec.attention) == ("hf_gpt2", "eager")
    with pytest.raises(ConfigError) as unknown:
        RunSpec.from_dict(resolved(["model=tiny", "profile.source=measured"]))
    assert unknown.value.field == "profile.source" and unknown.value.value == "measured"
    with pytest.raises(ConfigError, match="profile.options"):
        select_source("analytic", {"attention": "eager"}, {"builder": "tiny_gpt"})


def test_a_rerun_keeps_a_finished_record_and_sets_aside_one_it_cannot_read(tmp_path) -> None:
    from pipelines.job import RESOLVED_CONFIG_FILE, SUPERSEDED_DIR, JobContext, _keep_or_set_aside_earlier

    sweep = tmp_path / "sweep"
    for job in ("0", "1"):
        ctx = JobContext(run_dir=sweep / job, multirun=True, sweep_dir=sweep, choices={})
        ctx.run_dir.mkdir(parents=True)
        (ctx.run_dir / RESOLVED_CONFIG_FILE).write_text("model: tiny\n")
    finished = _record("0", "tiny", "slackswap", 0.5, "ok", 0.9)
    finished.write(sweep / "0")
    (sweep / "1" / RECORD_FILE).write_text(json.dumps(finished.to_dict() | {"extra": 1}))
    kept = _keep_or_set_aside_earlier(JobContext(sweep / "0", True, sweep, {}), "model: tiny\n")
    assert kept == replace(finished, job="")
    assert _keep_or_set_aside_earlier(JobContext(sweep / "1", True, sweep, {}), "model: tiny\n") is None
    assert not (sweep / "1" / RECORD_FILE).exists()
    assert json.loads((sweep / SUPERSEDED_DIR / "1-1" / RECORD_FILE).read_text())["extra"] == 1


def test_summary_md_shows_speed_and_marks_an_ok_run_that_does_not_fit_the_device() -> None:
    from pipelines.aggregate import records_to_frame, summary_markdown
    from pipelines.console import format_one_line

    def record(name: str, fits: bool) -> RunRecord:
        metrics = {"throughput_ratio": 0.9, "step_s": 0.5, "keep_all_peak_bytes": 2**30, "budget_bytes": 2**29,
                   "tokens_per_s": 4096.0, "mfu": 0.5, "fits_device": fits, "headroom_bytes": 2**30 if fits else -2**31,
                   "feasible": True}  # fmt: skip
        return RunRecord(run_name=name, choices={}, model=name, hardware="a100", planner="slackswap",
                         planner_name="slackswap", budget_fraction=0.5, budget_bytes_requested=None, run_dir=name,
                         status=RunStatus.OK, metrics=metrics)  # fmt: skip

    fits, over = record("fits", True), record("over", False)
    text = summary_markdown(records_to_frame([fits, over]))
    assert "2 jobs: 2 ok; 1 of the ok runs DO NOT FIT THE DEVICE" in text
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| fits") or
            line.startswith("| over")}  # fmt: skip
    assert "| 4,096 | 50.0% | yes |" in rows["fits"] and "| 4,096 | 50.0% | **NO** |" in rows["over"]
    assert "DOES NOT FIT THE DEVICE: 2.000 GiB over" in format_one_line(over)
    assert "4,096 tokens/s, MFU 50.0%" in format_one_line(fits) and "DEVICE" not in format_one_line(fits)


def test_paper_table_on_a_shared_node_shows_every_planner_against_the_gpu_alone() -> None:
    records = [
        _record("0", "bert_large", "slackswap", 0.5, "ok", 0.90),
        _record("1", "bert_large", "capuchin", 0.5, "ok", 0.85),
    ]
    for rec, alone in ((records[0], 0.93), (records[1], 0.88)):
        rec.metrics.update({"node": "dgx_a100", "gpus_per_node": 8, "effective_h2d_gbps": 5.5,
                            "effective_d2h_gbps": 12.5, "h2d_limit": "switch_uplink", "alone_throughput_ratio": alone})
    md = aggregate.paper_table(aggregate.records_to_frame(records), {"paper_reference": {"bert_large": 0.963}})
    assert "On the node" in md and "H2D 5.50 GB/s" in md and "D2H 12.50 GB/s" in md
    row = next(line for line in md.split("On the node")[1].splitlines() if line.startswith("| capuchin"))
    assert "85.0% (alone 88.0%, -3.0 pp)" in row
    for rec in records:  # one GPU alone: no node section
        rec.metrics["gpus_per_node"] = 1
    assert "On the node" not in aggregate.paper_table(aggregate.records_to_frame(records),
                                                      {"paper_reference": {"bert_large": 0.963}})


def test_a_runs_speed_line_says_what_its_step_leaves_out() -> None:
    """One Llama-7B ZeRO-3 configuration read 4,178 tokens/s from pipelines.run and 3,935 from
    pipelines.advise: the run's step has no optimizer step (include_optimizer=false) and no ZeRO
    collectives, and its summary now says so."""
    from pipelines.console import step_scope

    def resolved(include_optimizer: bool, shards: int) -> dict:
        return {"model": {"include_optimizer": include_optimizer},
                "training": {"zero_stage": 3, "zero_shards": shards}}

    assert step_scope(resolved(False, 8)) == (
        "step: forward + backward, without the optimizer step (model.include_optimizer=false) and ZeRO-3's "
        "collectives over 8 GPUs; pipelines.advise prices the whole step")
    assert step_scope(resolved(True, 8)) == (
        "step: forward + backward + optimizer step, without ZeRO-3's collectives over 8 GPUs; pipelines.advise "
        "prices the whole step")
    assert step_scope(resolved(False, 1)).startswith("step: forward + backward, without the optimizer step (")
    assert step_scope(resolved(True, 1)) == "step: forward + backward + optimizer step"  # nothing left out
