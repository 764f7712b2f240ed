"""Per-rank graphs of a parallel layout (slackswap/parallel.py, slackswap/profile/layers.py,
slackswap/profile/collectives.py) against Korthikanti et al. 2022 to the byte, and the bad layouts."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from slackswap.communication import Fabric, Topology, all_gather_s, all_reduce_s
from slackswap.errors import ConfigError
from slackswap.formulas import (
    korthikanti_fwd_flops_per_layer,
    korthikanti_saved_bytes_per_layer,
    korthikanti_saved_bytes_per_layer_tp,
    korthikanti_saved_bytes_per_layer_tp_sp,
)
from slackswap.graph import NO_LAYER
from slackswap.model_config import ModelConfig
from slackswap.parallel import NO_PARALLELISM, ParallelConfig
from slackswap.profile import build_graph, layout_collectives, parameter_counts
from slackswap.profile.collectives import price
from tests.test_profile import HW, per_layer, preset_model

#: (s, b, h, a, t): several shapes, t dividing a (the formula's integer form needs it) and s (sp).
SHAPES = [
    (512, 8, 1024, 16, 2),  # BERT-Large shape
    (1000, 4, 1600, 25, 5),  # GPT-2 XL width, t = 5 divides its 25 heads (and, for sp, s)
    (2048, 1, 4096, 32, 8),  # a 7B shape at one full node
    (96, 3, 384, 12, 4),
    (66, 2, 192, 6, 3),
]

#: The tensors of one GPT-2 layer the formula counts (docs/profile.md), and how tp splits each.
REPLICATED = {"ln1_in", "ln1.out", "proj_drop.mask", "add1.out", "ln2.out", "mlp_drop.mask"}
SPLIT = {"qkv.q", "qkv.k", "qkv.v", "softmax.out", "attn_drop.mask", "attn_drop.out", "pv.out", "fc1.out", "gelu.out"}


def gpt(family: str, s: int, b: int, h: int, a: int, *, layers: int = 2, dtype: str = "fp16") -> ModelConfig:
    """The formula's model: 16-bit activations, dropout on (1-byte masks), eager attention, a 4h MLP."""
    return ModelConfig("k", family, layers, h, a, a, 4 * h, s, b, 1000, dtype=dtype, dropout=True, attention="eager")


def layer_tensors(graph, layer: int) -> dict[str, int]:
    """Saved tensors of `layer` by their name inside the layer (the layer input as `ln1_in`)."""
    out = {}
    for t in graph.saved_tensors:
        if t.layer == layer:
            key = t.name.split(".", 1)[1] if t.name.startswith(f"L{layer}.") else "ln1_in"
            out[key] = t.size_bytes
    return out


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.parametrize(("s", "b", "h", "a", "t"), SHAPES)
def test_tensor_parallel_saved_bytes_per_layer_equal_korthikanti(family, s, b, h, a, t):
    model = gpt(family, s, b, h, a)
    saved_tp, fwd_tp, bwd_tp = per_layer(build_graph(model, HW, parallel=ParallelConfig(tp=t)))
    saved_sp, _, _ = per_layer(build_graph(model, HW, parallel=ParallelConfig(tp=t, sp=True)))
    for layer in range(model.num_layers):
        assert saved_tp[layer] == korthikanti_saved_bytes_per_layer_tp(s, b, h, a, t), layer
        assert saved_sp[layer] == korthikanti_saved_bytes_per_layer_tp_sp(s, b, h, a, t), layer
        # Every GEMM and both attention bmms are split over the t ranks: FLOPs / t exactly.
        assert fwd_tp[layer] * t == korthikanti_fwd_flops_per_layer(s, b, h), layer
        assert bwd_tp[layer] == 2 * fwd_tp[layer]


def test_formulas_by_hand():
    # s=512, b=8, h=1024, a=16, t=2: sbh = 4,194,304; 10 sbh + 12 sbh + 5as^2b/2 = 41.9M + 50.3M + 83.9M.
    assert korthikanti_saved_bytes_per_layer_tp(512, 8, 1024, 16, 2) == 41_943_040 + 50_331_648 + 83_886_080
    assert korthikanti_saved_bytes_per_layer_tp_sp(512, 8, 1024, 16, 2) == (142_606_336 + 167_772_160) // 2
    plain = korthikanti_saved_bytes_per_layer(512, 8, 1024, 16)
    assert korthikanti_saved_bytes_per_layer_tp(512, 8, 1024, 16, 1) == plain
    with pytest.raises(ConfigError, match=r"^tensor_parallel=3: does not divide num_heads=16$"):
        korthikanti_saved_bytes_per_layer_tp(512, 8, 1024, 16, 3)


@pytest.mark.parametrize(("s", "b", "h", "a", "t"), SHAPES[:3])
def test_each_counted_tensor_is_split_or_replicated_as_the_paper_says(s, b, h, a, t):
    """The graph saves exactly the formula's 15 tensors per GPT-2 layer, no more: tp splits the 24 sbh +
    5as^2b ones by t and keeps the 10 sbh ones whole; sp splits those too."""
    model = gpt("gpt2", s, b, h, a)
    full = layer_tensors(build_graph(model, HW), 1)
    tp = layer_tensors(build_graph(model, HW, parallel=ParallelConfig(tp=t)), 1)
    sp = layer_tensors(build_graph(model, HW, parallel=ParallelConfig(tp=t, sp=True)), 1)
    assert set(full) == set(tp) == set(sp) == REPLICATED | SPLIT
    for name in REPLICATED:
        assert tp[name] == full[name] and sp[name] * t == full[name], name
    for name in SPLIT:
        assert tp[name] * t == full[name] and sp[name] == tp[name], name
    sbh = s * b * h
    assert sum(full[n] for n in REPLICATED) == 10 * sbh
    assert sum(full[n] for n in SPLIT) == 24 * sbh + 5 * a * s * s * b


def test_llama_flash_gqa_and_context_parallel_split_by_tp_and_cp():
    """Outside the formula (flash, GQA, SwiGLU): under tp x cp every saved tensor of a layer is the full
    replica's / cp, and / tp more for the head- and width-split ones (not the norm / residual ones)."""
    model = preset_model("llama2_70b", num_layers=2, seq_len=1024)
    full = layer_tensors(build_graph(model, HW), 1)
    tp, cp = 8, 4
    rank = layer_tensors(build_graph(model, HW, parallel=ParallelConfig(tp=tp, cp=cp)), 1)
    whole = {"ln1_in", "norm1.out", "add1.out", "norm2.out"}
    assert set(rank) == set(full)
    for name, size in full.items():
        assert rank[name] * cp * (1 if name in whole else tp) == size, name
    sp = layer_tensors(build_graph(model, HW, parallel=ParallelConfig(tp=tp, cp=cp, sp=True)), 1)
    assert all(sp[n] * cp * tp == full[n] for n in full)


def test_default_layout_is_the_full_replica_graph_unchanged():
    model = preset_model("gpt2_xl", num_layers=2)
    plain, default = build_graph(model, HW), build_graph(model, HW, parallel=NO_PARALLELISM)
    assert plain.ops == default.ops and plain.tensors == default.tensors and plain.meta == default.meta
    assert "parallel" not in plain.meta and layout_collectives(plain) == []
    # dp and sp without tp split nothing either; the meta says which layout it was.
    dp = build_graph(model, HW, parallel=ParallelConfig(dp=4, sp=True))
    assert dp.ops == plain.ops and dp.tensors == plain.tensors and layout_collectives(dp) == []


def test_parameters_per_rank():
    """A GPT-2 layer has 12h^2 + 13h parameters; under tp a rank holds 12h^2/t plus the split biases
    (QKV 3h/t, fc1 4h/t), the whole row-parallel biases (2h) and LayerNorms (4h)."""
    model = preset_model("gpt2_xl", num_layers=2)
    h, t = model.hidden_size, 5
    full, _ = parameter_counts(model)
    rank, unit = parameter_counts(model, ParallelConfig(tp=t))
    layer = 12 * h * h // t + 7 * h // t + 6 * h
    embed = -(-model.vocab_size // t) * h + model.seq_len * h + 2 * h  # vocab shard, positions, final LN
    assert rank == 2 * layer + embed
    assert full == 2 * (12 * h * h + 13 * h) + model.vocab_size * h + model.seq_len * h + 2 * h
    assert unit == max(layer, embed)


def test_tp_collectives_per_layer_and_their_time_on_nvlink():
    """No sp: 2 all-reduces forward, 2 backward, each of the full 2sbh buffer. sp: the same bytes as a
    reduce-scatter + all-gather each, plus backward's re-gather of the two saved sequence shards."""
    model = preset_model("llama7b", num_layers=2)
    s, b, h, t = model.seq_len, model.micro_batch_size, model.hidden_size, 8
    full = 2 * s * b * h
    plain = [c for c in layout_collectives(build_graph(model, HW, parallel=ParallelConfig(tp=t))) if c.layer == 1]
    assert sorted((c.phase, c.kind, c.size_bytes) for c in plain) == (
        [("backward", "all_reduce", full)] * 2 + [("forward", "all_reduce", full)] * 2
    )
    sp = [c for c in layout_collectives(build_graph(model, HW, parallel=ParallelConfig(tp=t, sp=True)))
          if c.layer == 1]
    kinds = defaultdict(int)
    for c in sp:
        assert c.size_bytes == full
        kinds[c.phase, c.kind] += 1
    assert kinds == {("forward", "all_gather"): 2, ("forward", "reduce_scatter"): 2,
                     ("backward", "reduce_scatter"): 2, ("backward", "all_gather"): 4}
    share = (t - 1) / t
    assert sum(c.bus_bytes for c in plain) == 4 * 2 * full * share
    assert sum(c.bus_bytes for c in sp if c.phase == "forward") == 2 * 2 * full * share  # = no-sp forward
    nvlink = Fabric("nvlink", 450e9, 2e-6)
    topo = Topology(8, nvlink, None)
    graph = build_graph(model, HW, parallel=ParallelConfig(tp=t))
    comm = price(layout_collectives(graph), ParallelConfig(tp=t), topo, "hgx")
    # forward: 2 per layer x 2 layers + the embedding's all-reduce, + 3 fp32 loss all-reduces per token
    tokens = s * b
    expected = 5 * all_reduce_s(full, t, nvlink) + 3 * all_reduce_s(4 * tokens, t, nvlink)
    assert comm.forward_s == pytest.approx(expected, rel=1e-12) and comm.fabrics == {"tp": "nvlink"}
    unpriced = price(layout_collectives(graph), ParallelConfig(tp=t), Topology(1, nvlink, None), "ws")
    assert unpriced.forward_s is None
    assert unpriced.unpriced == "parallel.tp=8 spans 8 GPUs; node ws has 1 and no network"


def test_context_parallel_ring_exchanges_k_and_v():
    model = preset_model("llama7b", num_layers=1)
    cp = 4
    graph = build_graph(model, HW, parallel=ParallelConfig(cp=cp))
    ring = [c for c in layout_collectives(graph) if c.layer == 0]
    kv = graph.tensors["L0.qkv.k"].size_bytes + graph.tensors["L0.qkv.v"].size_bytes
    assert [(c.phase, c.kind, c.group, c.size_bytes) for c in ring] == (
        [("forward", "ring_exchange", "cp", cp * kv)] + [("backward", "ring_exchange", "cp", cp * kv)] * 2
    )
    fabric = Fabric("nvlink", 450e9, 2e-6)
    assert ring[0].time_s(fabric) == all_gather_s(cp * kv, cp, fabric)


@pytest.mark.parametrize(
    ("layout", "model_overrides", "message"),
    [
        ({"tp": 3}, {}, "parallel.tp=3: does not divide model.num_heads=32"),
        ({"tp": 16}, {"num_kv_heads": 8}, "parallel.tp=16: does not divide model.num_kv_heads=8"),
        ({"cp": 3}, {}, "parallel.cp=3: does not divide model.seq_len=2048"),
        ({"cp": 2}, {"attention": "eager"},
         "parallel.cp=2: context parallelism runs ring attention in a fused kernel; set model.attention=flash"),
        ({"pp": 3}, {}, "parallel.pp=3: does not divide model.num_layers=32"),
        ({"ep": 2}, {}, "parallel.ep=2: does not divide the experts of 'llama7b' (a dense model)"),
        ({"tp": 8, "sp": True, "cp": 512}, {},
         "parallel.tp=8: with parallel.sp=true must divide the sequence each rank holds, "
         "model.seq_len / parallel.cp = 4"),
    ],
)
def test_a_layout_that_does_not_divide_the_model_names_the_field(layout, model_overrides, message):
    model = dataclasses.replace(preset_model("llama7b"), **model_overrides)
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**layout).check_model(model)
    assert str(err.value) == message


@pytest.mark.parametrize(("data", "message"), [
    ({"tp": 0}, "parallel.tp=0: must be an integer >= 1"),
    ({"dp": 1.5}, "parallel.dp=1.5: must be an integer >= 1"),
    ({"sp": "yes"}, "parallel.sp='yes': must be true or false"),
    ({"zp": 2}, "parallel=['zp']: unknown field(s)"),
])
def test_bad_values(data, message):
    with pytest.raises(ConfigError) as err:
        ParallelConfig.from_dict(data)
    assert str(err.value) == message


def test_world_size_must_match_the_gpus_given():
    layout = ParallelConfig(dp=2, tp=8, cp=2)
    layout.check_gpus(32, "advise.gpus")
    with pytest.raises(ConfigError) as err:
        layout.check_gpus(16, "advise.gpus")
    assert str(err.value) == "advise.gpus=16: is not parallel dp*tp*pp*cp = 2*8*1*2 = 32"


def test_a_pipeline_is_not_one_graph_the_profile_says_so():
    with pytest.raises(ConfigError, match=r"^parallel.pp=2: a pipeline's graphs are one per stage"):
        build_graph(preset_model("llama7b", num_layers=2), HW, parallel=ParallelConfig(pp=2))


def test_a_rank_graph_round_trips_through_graph_json(tmp_path):
    from slackswap.graph_io import read_graph_json, write_graph_json

    layout = ParallelConfig(tp=4, cp=2, sp=True)
    graph = build_graph(preset_model("llama7b", num_layers=2), HW, parallel=layout)
    back = read_graph_json(write_graph_json(graph, tmp_path / "graph.json"))
    assert back.tensors == graph.tensors and layout_collectives(back) == layout_collectives(graph)
    assert back.meta["parallel"]["layout"] == layout.as_dict()


def test_head_is_vocab_parallel():
    model = preset_model("llama7b", num_layers=1)
    graph = build_graph(model, HW, parallel=ParallelConfig(tp=8))
    probs = graph.tensors["loss.probs"]
    assert probs.layer == NO_LAYER and probs.size_bytes * 8 == model.seq_len * model.vocab_size * 4


# ------------------------------------------------------------------ pipeline stages under 1F1B


def test_1f1b_order_of_a_four_stage_pipeline_by_hand():
    from slackswap.pipeline_stages import one_f_one_b_order

    # Narayanan et al. 2021, Figure 4 (top), 4 stages, 8 micro-batches: the first stage warms up with 3.
    first = one_f_one_b_order(0, 4, 8)
    assert first[:5] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    assert first[-4:] == [("B", 4), ("B", 5), ("B", 6), ("B", 7)]
    assert one_f_one_b_order(3, 4, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 7, 16])
def test_stage_i_of_p_holds_p_minus_i_microbatches(stages, microbatches):
    from slackswap.pipeline_stages import in_flight_microbatches, one_f_one_b_order

    for stage in range(stages):
        order = one_f_one_b_order(stage, stages, microbatches)
        # every micro-batch once forward, once backward, its backward after its forward
        every = [("F", j) for j in range(microbatches)] + [("B", j) for j in range(microbatches)]
        assert sorted(order) == sorted(every)
        assert all(order.index(("F", j)) < order.index(("B", j)) for j in range(microbatches))
        assert in_flight_microbatches(stage, stages, microbatches) == min(stages - stage, microbatches)


def test_stage_budget_scales_the_capacity_by_the_in_flight_count():
    from slackswap.pipeline_stages import stage_budget_bytes

    capacity = 60 * 2**30 + 7
    budgets = [stage_budget_bytes(capacity, i, 4, 8) for i in range(4)]
    assert budgets == [capacity // 4, capacity // 3, capacity // 2, capacity]
    for held, budget in zip((4, 3, 2, 1), budgets, strict=True):
        assert held * budget <= capacity < held * (budget + 1)
    with pytest.raises(ConfigError, match=r"^stage=4: must be below parallel.pp=4$"):
        stage_budget_bytes(capacity, 4, 4, 8)
    with pytest.raises(ConfigError, match=r"^microbatches=0: must be an integer >= 1$"):
        stage_budget_bytes(capacity, 0, 4, 0)
