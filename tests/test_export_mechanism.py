"""The eager export runs each layer under the cheapest mechanism that executes its decisions
(`slackswap.runtime.export.mechanism`): a plain checkpoint where every decided tensor is recomputed, the
SAC policy elsewhere; and the SAC modes' per-call cost is measured apart from any plan's step
(`slackswap.runtime.export.dispatch_cost`) and priced per call of the SAC layers only."""

from __future__ import annotations

import copy

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.experiment.export_plan import plan_for_export  # noqa: E402
from slackswap.experiment.measured_executor import predict_export, sac_dispatch_calls  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.profile.measured import ExportHostCost  # noqa: E402
from slackswap.runtime import capture_graph  # noqa: E402
from slackswap.runtime.export import PlanExport  # noqa: E402
from slackswap.runtime.export.mechanism import CHECKPOINT, SELECTIVE  # noqa: E402
from slackswap.runtime.zoo import build  # noqa: E402
from tests.runtime_support import h200  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    w = build("llama")
    pristine = copy.deepcopy(w.model)
    graph = capture_graph(copy.deepcopy(pristine), (w.batch,), w.loss_fn, h200(), name="llama")
    return w, pristine, graph


@pytest.mark.slow
def test_a_layer_recomputing_every_decided_tensor_runs_under_a_plain_checkpoint_bit_exact(llama) -> None:
    from slackswap.runtime.train import eager_export_gradient_check

    w, pristine, graph = llama
    recompute = plan_for_export(get_planner("full_recompute"), graph, pristine, h200(), None)
    mixed = plan_for_export(get_planner("torch_sac"), graph, pristine, h200(), None)
    assert PlanExport(recompute, graph, pristine).mechanisms() == [CHECKPOINT, CHECKPOINT]
    assert PlanExport(mixed, graph, pristine).mechanisms() == [SELECTIVE, SELECTIVE]
    model = copy.deepcopy(pristine)
    export = PlanExport(recompute, graph, model)
    with export.installed(model):
        model(w.batch)
    # The record is written from the decisions: every decided tensor recomputed but the held layer output.
    assert export.step_differences() == []
    exact, max_abs_diff, differences = eager_export_gradient_check(w, graph, recompute, 1)[:3]
    assert exact and max_abs_diff == 0.0 and differences == 0
    # No call passes the SAC modes, so no dispatch is priced; the mixed plan's calls are.
    assert sac_dispatch_calls(graph, recompute, pristine) == 0
    calls = sac_dispatch_calls(graph, mixed, pristine)
    assert calls > len([op for op in graph.forward_ops if op.layer >= 0])
    cpu = _synchronous_machine()
    plain = predict_export(graph, mixed, h200(), cpu).prediction.step_s
    priced = predict_export(graph, mixed, h200(), cpu, pristine, ExportHostCost(sac_per_call_s=2e-5))
    assert priced.dispatch_calls == calls
    # ... beside the views the replays run again, at their op times (no model, none counted).
    assert priced.prediction.step_s == pytest.approx(plain + calls * 2e-5 + priced.prediction.replayed_views_s)
    # Both layers are checkpoint regions; their saved tensors are the pack events the capture counted there.
    assert priced.checkpoint_regions == 2 and priced.checkpoint_saved > 0


def _synchronous_machine():
    from slackswap.profile.machine import Machine, machine_description

    rows = [{"direction": d, "host_memory": "pageable", "size_bytes": s, "median_s": 1e-6 + s / 1e10}
            for d in ("h2d", "d2h", "both") for s in (4096, 8192)]
    return Machine.from_dict(machine_description("cpu", "cpu", True, rows, [], [], "test"))


def test_the_checkpoints_host_cost_is_measured_per_region_and_saved_tensor() -> None:
    from slackswap.runtime.export.checkpoint_cost import measure_checkpoint_cost

    state = torch.get_rng_state()
    cost = measure_checkpoint_cost(warmup=0, repeats=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert cost.saved > 0 and cost.per_region_s >= 0 and cost.per_saved_s >= 0
    assert cost.per_region_s + cost.per_saved_s > 0
    assert "thread CPU time" in cost.source and torch.__version__ in cost.source


def test_the_sac_dispatch_cost_is_measured_per_call_on_a_fixed_microbenchmark() -> None:
    from slackswap.runtime.export.dispatch_cost import measure_dispatch_cost

    state = torch.get_rng_state()
    cost = measure_dispatch_cost(warmup=1, repeats=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert cost.calls > 0 and cost.per_call_s > 0
    assert "thread CPU time" in cost.source and torch.__version__ in cost.source
    assert "(width 64, 64 tokens)" in cost.source


def test_the_sac_dispatch_cost_is_measured_at_the_models_shape_and_a_bad_one_is_one_line() -> None:
    from slackswap.experiment.measured_prediction import export_block_shape
    from slackswap.model_config import ModelConfig
    from slackswap.runtime.export.dispatch_cost import measure_dispatch_cost

    model = ModelConfig("m", "gpt2", 2, hidden_size=48, num_heads=4, num_kv_heads=4, ffn_hidden_size=192, seq_len=8,
                        micro_batch_size=3, vocab_size=64)
    assert export_block_shape(model) == (48, 24)  # hidden size, tokens per micro-batch
    cost = measure_dispatch_cost(1, 2, *export_block_shape(model))
    assert "(width 48, 24 tokens)" in cost.source and cost.calls > 0
    with pytest.raises(ValueError, match="at least 1, got 0 x 24"):
        measure_dispatch_cost(1, 2, 0, 24)
