"""What a plan's eager export runs beyond the executed plan's ops, counted by hand on a two-block model:
the pack events each checkpoint frame makes (`slackswap.experiment.measured_executor.export_counts`)."""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")

from slackswap.graph import SAVED_PACKS_BY_LAYER_KEY  # noqa: E402
from tests.runtime_support import h200  # noqa: E402


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.t()  # a view
        h = torch.relu(self.lin(y))  # F.linear on 2-D: `t` of the weight (a view) and `addmm`; relu saves h
        return h.t()  # a view after the block's last op with a saved output


class _TwoBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def two_blocks():
    from slackswap.runtime import capture_graph

    torch.manual_seed(0)
    model = _TwoBlocks()
    x = torch.randn(4, 4)  # needs no gradient
    return model, capture_graph(model, (x,), lambda out: out.sum(), h200(), name="two blocks")


def test_the_capture_counts_each_layers_pack_events_by_hand(two_blocks) -> None:
    from slackswap.experiment.measured_executor import export_counts
    from slackswap.planners.registry import get_planner

    model, graph = two_blocks
    # Block 0's input needs no gradient, so its addmm saves only mat1 (the input's view, for the weight's
    # gradient) and relu its result: 2. Block 1's input does, so its addmm saves mat2 (the weight's `t`)
    # too: 3; block 0's output, saved by block 0's relu, is packed again there, by block 1's frame.
    assert graph.meta[SAVED_PACKS_BY_LAYER_KEY] == [2, 3]
    assert graph.meta["saved_tensor_packs"] == 5  # the loss's sum saves nothing
    plan = get_planner("full_recompute").plan(graph, h200(), None)
    counts = export_counts(graph, plan, model)
    assert (counts.regions, counts.saved) == (2, 5.0)


def test_the_capture_splits_the_hook_events_by_graph_tensor_by_hand(two_blocks) -> None:
    from slackswap.graph import SAVED_EVENTS_BY_TENSOR_KEY, saved_tensor_events
    from slackswap.plan import Decision
    from slackswap.testing import schedule_from_decisions

    _, graph = two_blocks
    # Block 0's relu output is packed by its relu and again, as a view, by block 1's addmm, and read back
    # by both; block 1's relu output once each. The other 2 packs (block 0's input view, block 1's weight
    # `t`) are no graph tensor: 5 packs and 5 unpacks in all.
    assert graph.meta[SAVED_EVENTS_BY_TENSOR_KEY] == {"layers.0/relu#0:0": [2, 2], "layers.1/relu#0:0": [1, 1]}
    assert (graph.meta["saved_tensor_packs"], graph.meta["saved_tensor_unpacks"]) == (5, 5)
    # A plan prices the events of the tensors it recomputes apart: layers.1's 2, not layers.0's swapped 4.
    plan = schedule_from_decisions(graph, {"layers.0/relu#0:0": Decision.SWAP, "layers.1/relu#0:0": Decision.RECOMPUTE})
    assert saved_tensor_events(graph, plan.tensors_with(Decision.RECOMPUTE)) == 2


def test_the_replay_reruns_each_layers_views_up_to_its_last_saved_op(two_blocks) -> None:
    from slackswap.experiment.measured_executor import export_counts, predict_export
    from slackswap.planners.registry import get_planner
    from slackswap.pytorch_execution import replayed_views
    from tests.test_export_mechanism import _synchronous_machine

    model, graph = two_blocks
    views = replayed_views(graph, [0, 1])
    # Per block, by hand: `x.t()` and the weight's `t` run before relu, the block's last op with a saved
    # output, where the replay stops; `h.t()` after it is not replayed.
    assert {layer: [v.split(":")[1] for v in names] for layer, names in views.items()} == {
        0: ["aten.t.default", "aten.t.default"], 1: ["aten.t.default", "aten.t.default"]}
    assert replayed_views(graph, [1]) == {1: views[1]}
    plan = get_planner("full_recompute").plan(graph, h200(), None)
    assert export_counts(graph, plan, model).replayed_views == (*views[0], *views[1])
    # On the CPU the prediction adds their op times; where host work overlaps the kernels, nothing.
    ops = graph.op_by_name
    cpu = _synchronous_machine()
    priced = predict_export(graph, plan, h200(), cpu, model).prediction
    bare = predict_export(graph, plan, h200(), cpu).prediction
    assert priced.replayed_views_s > 0
    assert priced.replayed_views_s == pytest.approx(sum(ops[v].duration_s for v in (*views[0], *views[1])))
    assert priced.step_s == pytest.approx(bare.step_s + priced.replayed_views_s)
    assert predict_export(graph, plan, h200(), None, model).prediction.replayed_views_s == 0.0


def test_a_sac_replay_serves_the_kept_outputs_calls_from_the_cache_by_hand(two_blocks) -> None:
    from slackswap.experiment.measured_executor import (
        ReplayCalls,
        export_counts,
        predict_export,
        sac_dispatch_calls,
        sac_replay_calls,
        sac_replay_ops,
    )
    from slackswap.planners.registry import get_planner

    model, graph = two_blocks
    # keep_all decides relu's output (saved) alone: both blocks run under the SAC policy. Each replay runs
    # up to relu: the two `t` views again, addmm again (its output is a transient no decision keeps), and
    # relu's call is served from the cache.
    keep_all = get_planner("keep_all").plan(graph, h200(), None)
    ops = sac_replay_ops(graph, keep_all, model)
    assert {layer: [(name.split(":")[1], kind, calls) for name, kind, calls in v] for layer, v in ops.items()} == {
        layer: [("aten.t.default", "views", 1), ("aten.t.default", "views", 1),
                ("aten.addmm.default", "executed", 1), ("aten.relu.default", "cached", 1)] for layer in (0, 1)}
    assert sac_replay_calls(graph, keep_all, model) == {0: ReplayCalls(1, 2, 1), 1: ReplayCalls(1, 2, 1)}
    # torch_sac keeps addmm's output too: both of its block's ops are served, only the views run again.
    torch_sac = get_planner("torch_sac").plan(graph, h200(), None)
    assert sac_replay_calls(graph, torch_sac, model) == {0: ReplayCalls(0, 2, 2), 1: ReplayCalls(0, 2, 2)}
    # Every replay call passes the modes with the forward's 5 a block: 2 x (5 + 4).
    assert sac_dispatch_calls(graph, torch_sac, model) == 18
    assert export_counts(graph, torch_sac, model).cached_calls == 4
    from tests.test_export_mechanism import _synchronous_machine

    assert predict_export(graph, torch_sac, h200(), _synchronous_machine(), model).cached_calls == 4
