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


def test_zero2_and_zero3_with_ep_to_the_byte(model, a100):
    """ZeRO-2 and ZeRO-3 are searched with ep (dp 4; ep 2: an expert data-parallel group of 2, ep 4: of
    1). Hand counts (h 64, 4 layers, 4 experts of width 256, vocabulary 128): a layer's dense group is
    norm 64 + QKV 64 x 192 + projection 64 x 64 + norm 64 + router 64 x 4 = 16,768, the embedding / head
    group 128 x 64 + 64 + 64 x 128 = 16,448, so D = 4 x 16,768 + 16,448 = 83,520 dense parameters; one
    expert is 3 x 64 x 256 = 49,152. Mixed AdamW: 2 + 2 + 12 bytes per parameter."""
    from slackswap.parallel import ParallelConfig
    from slackswap.profile.stages import stage_group_parameters

    layer, head, expert = 16_768, 16_448, 3 * 64 * 256
    assert stage_group_parameters(model, ParallelConfig(dp=2, ep=2), 0) == {-1: head, **{i: layer + 2 * expert
                                                                                         for i in range(4)}}
    dense = 4 * layer + head
    rows = {}
    for ep in (2, 4):
        for zero in (2, 3):  # one search each: best-first planning would skip a slower one
            _, ctx = plan_search(model, a100, TOPO, _space(ep=(ep,), zero_stages=(zero,), micro_batches=(1,)),
                                 graphs_of(model, a100))
            rows |= {(r.candidate.layout.ep, r.candidate.layout.zero_stage): r for r in search_layouts(ctx, []).rows}
    assert set(rows) == {(2, 2), (2, 3), (4, 2), (4, 3)} and all(r.status == "ok" for r in rows.values())
    q = math.ceil(dense / 4)
    for ep, edp in ((2, 2), (4, 1)):
        x = 4 * (4 // ep) * expert  # the rank's routed-expert parameters
        assert rows[(ep, 2)].static_bytes == 2 * (dense + x) + 14 * q + 14 * math.ceil(x / edp)
        # ZeRO-3: two gathered dense layers; two gathered layers' experts where the expert group shards them
        gathered = 2 * 2 * layer + (2 * 2 * (4 // ep) * expert if edp > 1 else 0)
        assert rows[(ep, 3)].static_bytes == 16 * q + 16 * math.ceil(x / edp) + gathered
    # Collective bytes per step (grad_accum 1, bf16 gradients): dense over dp 4, experts over their group of 2
    x = 4 * 2 * expert
    assert rows[(2, 3)].comm.bus_bytes == pytest.approx(6 * dense * 3 / 4 + 6 * x / 2)
    assert rows[(2, 2)].comm.bus_bytes == pytest.approx(4 * dense * 3 / 4 + 4 * x / 2)
    assert rows[(4, 3)].comm.bus_bytes == pytest.approx(6 * dense * 3 / 4)  # experts whole: not gathered
    # ZeRO-3's forward gathers on NVLink (230 GB/s, 2 us a ring step): the dense ones one call per unit
    # (4 layers + the embedding / head group) over 4 ranks, the experts' one per MoE layer over 2
    forward = 5 * 3 * 2e-6 + 2 * dense * 3 / 4 / 230e9 + 4 * 1 * 2e-6 + 2 * x / 2 / 230e9
    assert rows[(2, 3)].comm.forward_comm_s == pytest.approx(forward)
    assert "expert data-parallel group" in rows[(2, 3)].comm.assumption


def test_zero_stages_searched_with_ep_and_pp():
    """ep no longer restricts the stages; a pipeline still does (DeepSpeed refuses ZeRO-2/3 with pp)."""
    from slackswap.experiment.advise_layout_configs import zero_stages

    assert zero_stages((0, 1, 2, 3), dp_cp=4, pp=1, ep=2) == [0, 1, 2, 3]
    assert zero_stages((0, 1, 2, 3), dp_cp=4, pp=2, ep=2) == [0, 1]
    assert zero_stages((2, 3), dp_cp=1, pp=1, ep=1) == [0]


def test_pipelines_run_holds_the_same_static_bytes_as_advise(model):
    """`pipelines.run`'s static memory on an ep layout (`device_static_memory`) is the advise rule's: dense
    over training.zero_shards (4), routed experts over zero_shards / ep = 2 ranks; the default
    zero_shards=1 shards nothing, experts included. Under cp the dense state is sharded over dp x cp
    ranks (dp 2 x cp 2: zero_shards 4), the experts over dp x cp / ep of them (ep 2: 2)."""
    from slackswap.memory.recipe import TrainingConfig
    from slackswap.parallel import ParallelConfig
    from slackswap.profile.stages import device_static_memory, expert_shards

    layer, head, expert = 16_768, 16_448, 3 * 64 * 256
    dense, x = 4 * layer + head, 4 * 2 * expert
    par = ParallelConfig(dp=4, ep=2)
    assert expert_shards(par, 3, 4) == 2 and expert_shards(par, 3, 1) == 1 and expert_shards(par, 0, 4) == 1
    assert expert_shards(ParallelConfig(dp=2, cp=2, ep=2), 3, ParallelConfig(dp=2, cp=2).dp_cp) == 2
    z3 = device_static_memory(model, par, TrainingConfig(precision="mixed", zero_stage=3, zero_shards=4), 0)
    assert z3.total_bytes == 16 * math.ceil(dense / 4) + 16 * (x // 2) + 2 * 2 * layer + 2 * 2 * 2 * expert
    z2 = device_static_memory(model, par, TrainingConfig(precision="mixed", zero_stage=2, zero_shards=4), 0)
    assert z2.total_bytes == 2 * (dense + x) + 14 * math.ceil(dense / 4) + 14 * (x // 2)
    whole = device_static_memory(model, par, TrainingConfig(precision="mixed"), 0)
    assert whole.total_bytes == 16 * (dense + x) and whole.num_params == dense + x
