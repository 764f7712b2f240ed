"""What advise reuses instead of recomputing, and that the reuse changes nothing: a layout's activation
floors from its first, one interior and its last chunk's graph (interior chunks are the same graph), and
the allocated peak's fit as the first round of planning against the reserved peak."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from slackswap.experiment.advise_layout_configs import layout_stage_graphs, stage_floors
from slackswap.experiment.advise_space import Layout
from slackswap.experiment.advise_step import activation_floor_bytes
from slackswap.experiment.fitting import FitOptions, plan_and_simulate
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.moe_config import MoEConfig
from slackswap.planners.registry import get_planner
from slackswap.profile import build_graph
from tests.advise_support import MIXED, load_conf


@pytest.fixture(scope="module")
def a100() -> Hardware:
    return Hardware.from_dict(load_conf("hardware", "a100_80gb_pcie4"))


def _model(**kw) -> ModelConfig:
    # tiny's shape with 8 layers and a vocabulary large enough that the head's logits set the last
    # chunk's floor apart from the others'
    return replace(ModelConfig.from_dict(load_conf("model", "tiny")), num_layers=8, attention="flash",
                   vocab_size=8192, **kw)


def _ctx(model: ModelConfig, hw: Hardware):
    """What the floors and stage graphs read of a search's context: the model, hardware and caches."""
    return SimpleNamespace(model=model, hardware=hw, rank_hardware={}, plan_cache={})


@pytest.mark.parametrize(("shape", "moe"), [((1, 1, 1), False), ((2, 2, 1), False), ((1, 4, 1), False),
                                             ((1, 4, 2), False), ((1, 4, 1), True), ((1, 2, 2), True)],
                         ids=["pp1", "pp2-tp2", "pp4", "pp4-v2", "moe-pp4", "moe-pp2-v2"])
def test_floors_from_three_chunk_graphs_are_every_chunks_floor(a100, shape, moe):
    tp, pp, v = shape
    model = _model(family="llama", dropout=False, moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=256,
                                                                first_dense_layers=1)) if moe else _model()
    lay = Layout(8, 1, 8 // (tp * pp), tp, pp, 1, tp > 1, 2 * pp, "interleaved" if v > 1 else "1f1b", v,
                 2 if moe else 1)
    floors = stage_floors(_ctx(model, a100), lay, MIXED, 2)
    every = [activation_floor_bytes(g) for g in layout_stage_graphs(_ctx(model, a100), lay, MIXED, 2)]
    assert floors == every and len(floors) == pp * v
    if pp * v > 1:  # the last chunk holds the head and the loss: its floor is another
        assert floors[-1] != floors[0]


def test_the_reserved_fit_from_the_allocated_first_round_is_the_one_from_scratch(a100):
    graph = build_graph(replace(_model(), micro_batch_size=4, include_optimizer=False), a100)
    planner = get_planner("slackswap")
    keep = plan_and_simulate(get_planner("keep_all"), graph, a100, a100.device_memory_bytes,
                             FitOptions(allocator="caching"))
    # under the keep-all reserved peak (2 MiB blocks at these sizes): the allocated fit is feasible and
    # does not fit the reserved peak, so planning against it goes on past round 1
    budget = int(keep.report.peak_reserved_bytes * 0.95)
    allocated = plan_and_simulate(planner, graph, a100, budget, FitOptions(allocator="caching"))
    options = FitOptions(allocator="caching", plan_against="reserved")
    scratch = plan_and_simulate(planner, graph, a100, budget, options)
    reused = plan_and_simulate(planner, graph, a100, budget, options, allocated)
    assert (reused.plan, reused.result, reused.report, reused.rounds, reused.planning_budget_bytes) == (
        scratch.plan, scratch.result, scratch.report, scratch.rounds, scratch.planning_budget_bytes)
    assert allocated.result.feasible and not allocated.report.fits and scratch.rounds > 1
    with pytest.raises(ValueError, match="first_round"):
        plan_and_simulate(planner, graph, a100, budget // 2, options, allocated)
