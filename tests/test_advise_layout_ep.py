"""Expert parallelism in the advise layout search (slackswap.experiment.advise_layout): on an MoE model
ep > 1 layouts are enumerated, a rank's experts and their optimizer state are priced with ep (the
routed experts sharded over the expert data-parallel group), the all-to-all is on the step, an ep that
does not divide the experts is a rejected region, and where only ep > 1 fits it is the answer."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from slackswap.errors import ConfigError
from slackswap.experiment.advise import SearchSpace, plan_search, run_search
from slackswap.experiment.advise_layout import search_layouts
from slackswap.experiment.advise_space import LAYOUT_DOES_NOT_DIVIDE, STATIC_DOES_NOT_FIT
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.moe_config import MoEConfig
from tests.advise_support import MIXED, TOPO, graphs_of, load_conf


@pytest.fixture(scope="module")
def model() -> ModelConfig:
    # tiny's shape as a 4-layer llama-family MoE: 4 SwiGLU experts of width 256, top 2
    return replace(ModelConfig.from_dict(load_conf("model", "tiny")), family="llama", num_layers=4,
                   attention="flash", dropout=False,
                   moe=MoEConfig(num_experts=4, top_k=2, expert_ffn_hidden_size=256))


@pytest.fixture(scope="module")
def a100() -> Hardware:
    return Hardware.from_dict(load_conf("hardware", "a100_80gb_pcie4"))


def _space(**kw) -> SearchSpace:
    base = dict(gpus=(4,), recipes={"mixed": MIXED}, micro_batches=(1, 2), planners={"keep_all": {}},
                plan_against=("allocated",), reserve_bytes=0, zero_stages=(0, 1), layout_top_n=20)
    return SearchSpace(**{**base, **kw})


def test_ep_layouts_hold_their_experts_state_and_pay_the_all_to_all(model, a100):
    """dp 4 x ep 2 under ZeRO-1 (Megatron's distributed optimizer): the dense parameters' fp32 master and
    Adam moments (12 bytes) sharded over the 4 dp ranks, the rank's 2 experts' over the 2 ranks that
    hold the same experts (dp / ep); 16-bit parameters and gradients whole (2 + 2 bytes)."""
    from slackswap.parallel import ParallelConfig
    from slackswap.profile.stages import stage_parameter_counts

    _, ctx = plan_search(model, a100, TOPO, _space(ep=(2,), micro_batches=(1,)), graphs_of(model, a100))
    rows = {r.candidate.layout.zero_stage: r for r in search_layouts(ctx, []).rows}
    assert set(rows) == {0, 1} and all(r.candidate.layout.ep == 2 for r in rows.values())
    params, _ = stage_parameter_counts(model, ParallelConfig(dp=2, ep=2), 0)
    experts = model.num_layers * (4 // 2) * 3 * model.hidden_size * 256
    dense = params - experts
    assert rows[0].static_bytes == params * 16
    assert rows[1].static_bytes == params * 4 + math.ceil(dense / 4) * 12 + math.ceil(experts / 2) * 12
    assert all(r.layout_comm_s > 0 for r in rows.values())  # dispatch / combine all-to-alls on NVLink
    # the optimizer updates the experts' half shard: more than a quarter of every parameter
    from slackswap.experiment.advise_layout_configs import optimizer_share_s

    one = rows[1].candidate.training
    assert one.zero_shards == 4 and rows[1].optimizer_s > optimizer_share_s(ctx, one, params) * (1 + 1e-9)


def test_where_only_expert_parallelism_fits_it_is_the_answer(model, a100):
    """A margin that leaves less than one replica's static memory: every ep 1 layout is a static
    region, and the answer holds a quarter of the experts per GPU."""
    from slackswap.parallel import ParallelConfig
    from slackswap.profile.stages import stage_parameter_counts

    replica, _ = stage_parameter_counts(model, ParallelConfig(), 0)
    quarter, _ = stage_parameter_counts(model, ParallelConfig(dp=4, ep=4), 0)
    assert quarter < replica
    # room for ep 4 under ZeRO-1 and its activations, not for any replica's static memory
    left = replica * 4 + math.ceil(replica / 4) * 12 - 1
    space = _space(ep=(1, 2, 3, 4), margin_bytes=a100.device_memory_bytes - left)
    advice = run_search(model, a100, TOPO, space, graphs_of(model, a100))
    best = advice.best_rows()[4]
    assert best.candidate.layout.ep == 4 and best.fits_device
    assert all(r.candidate.layout.ep > 1 for r in advice.rows if r.fits_device)
    assert any(r.reason == STATIC_DOES_NOT_FIT and r.choices["layout"] == "4 GPUs ZeRO-1" for r in advice.regions)
    bad = [r.detail for r in advice.regions if r.reason == LAYOUT_DOES_NOT_DIVIDE]
    assert bad == ["parallel.ep=3: does not divide model.moe.num_experts=4"]


def test_bad_ep_lists_name_their_field(model, a100):
    for value in ((0,), (4, 2), ()):
        with pytest.raises(ConfigError) as exc:
            _space(ep=value)
        assert exc.value.field == "advise.ep"
    # a dense model is searched with ep 1 only: no ep region, no ep row
    dense = replace(model, moe=None)
    advice = run_search(dense, a100, TOPO, _space(ep=(1, 2), micro_batches=(1,)), graphs_of(dense, a100))
    assert all(r.candidate.layout.ep == 1 for r in advice.rows) and not advice.regions
