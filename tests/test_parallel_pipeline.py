"""The `parallel` config group end to end: a run prints one rank's figures, a sweep over parallel.tp
runs, and a layout that does not divide the model is one line, exit 2, nothing recorded."""

from __future__ import annotations

import json

import pytest

from tests.test_faults import _errors, _in_process, _runs, _store_args

#: llama7b's layer keeps 269,746,176 bytes on one GPU (docs/profile.md); with tp=8 and sp every tensor splits.
LLAMA7B_LAYER_BYTES = 269_746_176


@pytest.mark.slow
def test_run_prints_one_ranks_figures(tmp_path, monkeypatch, capsys) -> None:
    run_dir = tmp_path / "run"
    code = _in_process(
        monkeypatch, tmp_path, "model=llama7b", "model.num_layers=2", "parallel.tp=8", "parallel.sp=true",
        "node=hgx_h100", "hardware=h100_sxm_pcie5", "tracking=off", f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    layout = [line for line in out.splitlines() if line.startswith("layout")]
    assert len(layout) == 1, out
    assert "per rank of 8 GPU(s) (dp=1 tp=8 pp=1 cp=1 ep=1 sp=true): 32.156 MiB saved per layer" in layout[0]
    assert "on tp:nvlink, " in layout[0] and "ms exposed (in the step time;" in layout[0]
    assert "forward + backward + the layout's exposed collectives (" in out
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["rank_layer_saved_bytes"] * 8 == LLAMA7B_LAYER_BYTES
    assert metrics["parallel_tp"] == 8 and metrics["parallel_sp"] is True
    assert metrics["tokens_per_step"] == 2048 // 8  # the 8 tp ranks share one micro-batch
    # 2 layers x (2 fwd + 2 bwd all-gather/reduce-scatter + 2 bwd re-gathers) + embedding 2 + head 3 + loss 3
    assert metrics["layout_collectives"] == 2 * 10 + 8
    assert metrics["layout_comm_forward_s"] > 0 and metrics["layout_comm_backward_s"] > metrics["layout_comm_forward_s"]
    assert metrics["layout_comm_s"] == pytest.approx(
        metrics["layout_comm_forward_s"] + metrics["layout_comm_backward_s"])


@pytest.mark.slow
def test_a_pipeline_run_reports_each_stage(tmp_path, monkeypatch, capsys) -> None:
    run_dir = tmp_path / "run"
    code = _in_process(
        monkeypatch, tmp_path, "model=llama7b", "parallel=pp4", "parallel.microbatches=6",
        "hardware=a100_80gb_sxm_pcie4", "node=dgx_a100", "tracking=off", f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert [line for line in out.splitlines() if line.startswith("pipeline ")][0].startswith(
        "pipeline     1f1b, 6 micro-batches, bubble "), out
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["pipeline_in_flight_by_stage"] == "4,3,2,1"
    peaks = [int(v) for v in metrics["pipeline_peak_bytes_by_stage"].split(",")]
    budgets = [int(v) for v in metrics["pipeline_budget_bytes_by_stage"].split(",")]
    assert all(p <= b for p, b in zip(peaks, budgets, strict=True)) and max(peaks) == metrics["peak_activation_bytes"]
    assert metrics["pipeline_p2p_unpriced"] is None and metrics["pipeline_p2p_s"] > 0  # NVLink inside the node
    assert metrics["tokens_per_step"] == 2048 * 6 // 4
    assert metrics["pipeline_bubble_fraction"] >= 3 / 9 - 0.05  # near (p-1)/(m+p-1), stages unequal


@pytest.mark.slow
def test_an_interleaved_run_reports_each_device(tmp_path, monkeypatch, capsys) -> None:
    run_dir = tmp_path / "run"
    code = _in_process(
        monkeypatch, tmp_path, "model=llama7b", "parallel=pp4_interleaved",
        "hardware=a100_80gb_sxm_pcie4", "node=dgx_a100", "tracking=off", f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert [line for line in out.splitlines() if line.startswith("pipeline ")][0].startswith(
        "pipeline     interleaved (2 chunks per stage), 8 micro-batches, bubble "), out
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["pipeline_in_flight_by_stage"] == "11,9,7,5"  # Megatron's warm-up + 1 chunks per device
    assert metrics["pipeline_virtual_stages"] == 2
    peaks = [int(v) for v in metrics["pipeline_peak_bytes_by_stage"].split(",")]
    budgets = [int(v) for v in metrics["pipeline_budget_bytes_by_stage"].split(",")]
    assert all(p <= b for p, b in zip(peaks, budgets, strict=True)) and max(peaks) == metrics["peak_activation_bytes"]
    # equal chunks would idle (p-1)/(vm+p-1) = 3/19 of the step; the embedding and head make them unequal
    assert 3 / 19 - 0.05 <= metrics["pipeline_ideal_bubble_fraction"] < 3 / 11


@pytest.mark.slow
def test_default_run_has_no_layout_figures(tmp_path, monkeypatch, capsys) -> None:
    run_dir = tmp_path / "run"
    code = _in_process(monkeypatch, tmp_path, "model=tiny", "tracking=off", f"hydra.run.dir={run_dir}")
    out = capsys.readouterr().out
    assert code == 0 and not [line for line in out.splitlines() if line.startswith("layout")]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert not any(key.startswith(("parallel_", "layout_")) for key in metrics)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["parallel.tp=3"], "error: parallel.tp=3: does not divide model.num_heads=32"),
        (["parallel.tp=16", "model.num_kv_heads=8"], "error: parallel.tp=16: does not divide model.num_kv_heads=8"),
        (["parallel.cp=3"], "error: parallel.cp=3: does not divide model.seq_len=2048"),
        (["parallel.pp=3"], "error: parallel.pp=3: does not divide model.num_layers=32"),
        (["parallel.pp=3", "parallel.microbatches=6"], "error: parallel.pp=3: does not divide model.num_layers=32"),
        (["parallel.microbatches=4"],
         "error: parallel.microbatches=4: micro-batches run through a pipeline; with parallel.pp=1 set 1"),
        (["parallel=pp4", "parallel.pipeline_schedule=zero_bubble"],
         "error: parallel.pipeline_schedule='zero_bubble': must be one of ['1f1b', 'interleaved', 'zb_h1']"),
        (["parallel=pp4_interleaved", "parallel.microbatches=6"],
         "error: parallel.microbatches=6: must be a multiple of parallel.pp=4 with the interleaved schedule"),
        (["parallel=pp4_interleaved", "parallel.virtual_stages=3"],
         "error: parallel.virtual_stages=3: times parallel.pp=4 does not divide model.num_layers=32"),
        (["parallel.ep=2"], "error: parallel.ep=2: does not divide the experts of 'llama7b' (a dense model)"),
        (["parallel.dp=0"], "error: parallel.dp=0: must be an integer >= 1"),
        (["parallel.tpp=2"], "error: parallel.tpp: no such key in parallel"),
    ],
)  # fmt: skip
def test_a_layout_that_does_not_divide_the_model_is_one_line_exit_2(
    tmp_path, mlflow_store, monkeypatch, capsys, args, line
) -> None:
    code = _in_process(
        monkeypatch, tmp_path, "model=llama7b", *args, *_store_args(mlflow_store), f"hydra.run.dir={tmp_path}/run",
    )  # fmt: skip
    err = _errors(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err
    assert _runs(mlflow_store.db_path) == []
    assert not (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.parametrize(
    ("module", "args", "line"),
    [
        ("pipelines.advise", ["parallel.tp=8", "advise.gpus=[8,16]"],
         "error: advise.gpus=16: is not parallel dp*tp*pp*cp = 1*8*1*1 = 8"),
        ("pipelines.advise", ["parallel.tp=8", "advise.gpus=[8]"],
         "error: parallel={'dp': 1, 'tp': 8, 'pp': 1, 'cp': 1, 'ep': 1, 'sp': False}: advise searches "
         "the layout: list degrees in advise.tp / advise.pp / advise.cp / advise.ep and leave parallel at none"),
        ("pipelines.train", ["model=tiny_torch", "parallel.tp=2"],
         "error: parallel={'dp': 1, 'tp': 2, 'pp': 1, 'cp': 1, 'ep': 1, 'sp': False}: a training run executes "
         "one full replica on one device; leave parallel at none"),
    ],
)  # fmt: skip
def test_entry_points_that_do_not_build_rank_graphs_refuse_a_layout(
    tmp_path, mlflow_store, monkeypatch, capsys, module, args, line
) -> None:
    """advise and train are never silently handed a layout they would ignore; advise checks the GPU count."""
    code = _in_process(
        monkeypatch, tmp_path, *args, *_store_args(mlflow_store), f"hydra.run.dir={tmp_path}/run", module=module,
    )  # fmt: skip
    err = _errors(capsys.readouterr().err)
    assert code == 2 and err == [line], err
    assert _runs(mlflow_store.db_path) == []


@pytest.mark.slow
def test_a_sweep_over_tp_runs_every_layout(tmp_path, monkeypatch, capsys) -> None:
    sweep = tmp_path / "sweep"
    code = _in_process(
        monkeypatch, tmp_path, "-m", "model=llama7b", "model.num_layers=2", "parallel.tp=1,2,4,8", "parallel.sp=true",
        "tracking=off", f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    assert code == 0, capsys.readouterr()
    saved = {}
    for job in range(4):
        metrics = json.loads((sweep / str(job) / "metrics.json").read_text())
        saved[metrics["parallel_tp"]] = metrics["rank_layer_saved_bytes"]
    assert {tp: saved[tp] * tp for tp in saved} == dict.fromkeys((1, 2, 4, 8), LLAMA7B_LAYER_BYTES)
