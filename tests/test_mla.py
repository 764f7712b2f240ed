"""Multi-head latent attention, shared experts, leading dense layers and head_dim (issue 43, item 3).

MLA's saved bytes and FLOPs by hand (slackswap/profile/mla.py's formulas); a small HF DeepseekV3
traced in bf16 on meta against the analytic graph of the same shape, layer by layer, with every
difference named; the DeepSeek-V3-like preset's figures (671 B parameters, the report's count); the
shared expert and first dense layers; an explicit head_dim; bad values name their field.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from slackswap.errors import ConfigError
from slackswap.graph import Phase
from slackswap.model_config import ModelConfig
from slackswap.parallel import ParallelConfig
from slackswap.profile import build_graph, parameter_counts
from slackswap.profile.mla import mla_projection_flops, mla_saved_bytes
from slackswap.profile.moe import moe_mlp_saved_bytes
from tests.extras import require_torch_extra
from tests.test_profile import HW, per_layer, preset_model

#: T = s b = 32 tokens, h 32, 4 heads; ranks d_q 24, d_c 16; d_n 8, d_r 4 (d_qk 12), d_v 6.
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
SMALL = dict(name="small_mla", family="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=4,
             ffn_hidden_size=40, seq_len=16, micro_batch_size=2, vocab_size=64, dropout=False, attention="flash")


def small(**fields) -> ModelConfig:
    return ModelConfig.from_dict({**SMALL, "mla": MLA, **fields})


def forward_flops(graph, layer: int) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for op in graph.ops:
        if op.phase == Phase.FORWARD and op.layer == layer:
            out[op.role] += op.flops
    return out


# ------------------------------------------------------------------------------- MLA by hand


def test_an_mla_layers_saved_bytes_by_hand_to_the_byte():
    """Flash, bf16, T = 32: MLA block T (h + 2 d_q + 2 d_c + 2 a d_qk + 2 a d_v) 2 + 4 b a s
    = 32 (32 + 48 + 32 + 96 + 48) 2 + 4 x 2 x 4 x 16 = 16384 + 512 = 16896; plus the layer input
    (norm1's backward) 2048, the first residual 2048 and the dense SwiGLU MLP's norm2 output, gate,
    up and SwiGLU outputs 2048 + 3 x 2560: 30720 per layer."""
    mla = mla_saved_bytes(32, 2, 16, 32, 4, 24, 16, 12, 6, 2)
    assert mla == 16_896
    saved, _, _ = per_layer(build_graph(small(), HW))
    for layer in range(2):
        assert saved[layer] == 2048 + mla + 2048 + 2048 + 3 * 2560 == 30_720, layer


def test_an_mla_layers_flops_by_hand():
    """Projections 2 T (h d_q + d_q a d_qk + h (d_c + d_r) + d_c a (d_n + d_v) + a d_v h)
    = 64 (768 + 1152 + 640 + 896 + 768) = 270336; the core 2 b a s s (d_qk + d_v) = 73728;
    backward twice the GEMMs and 2.5x the flash core."""
    graph = build_graph(small(), HW)
    fwd = forward_flops(graph, 0)
    proj = sum(fwd[r] for r in ("mla_q_down", "mla_q_up", "mla_kv_down", "mla_kv_up", "proj"))
    assert proj == mla_projection_flops(32, 32, 4, 24, 16, 8, 4, 6) == 270_336.0
    assert fwd["flash_attn"] == 2.0 * 2 * 4 * 16 * 16 * (12 + 6) == 73_728.0
    flash_bwd = next(op.flops for op in graph.ops if op.name == "L0.flash.bwd")
    assert flash_bwd == 2.5 * 73_728.0


def test_without_a_query_latent_q_is_one_gemm():
    """q_lora_rank 0 (DeepSeek-V2-Lite): one q GEMM h x a d_qk; no query latent or its norm."""
    graph = build_graph(small(mla={**MLA, "q_lora_rank": 0}), HW)
    fwd = forward_flops(graph, 0)
    assert "mla_q_down" not in fwd and fwd["q"] == 2.0 * 32 * 32 * 4 * 12
    saved, _, _ = per_layer(graph)
    assert saved[0] == 30_720 - 2 * 32 * 24 * 2  # less the query latent and its norm's output


# ----------------------------------------------------------------------- against the real thing


@pytest.mark.slow
def test_a_traced_hf_deepseek_v3_matches_the_analytic_layer():
    """HF `DeepseekV3ForCausalLM` with the same shape (all layers dense: first_k_dense_replace = L),
    bf16, eager attention, traced on meta: forward FLOPs per layer are equal; saved bytes per layer
    differ by exactly these named terms, the rest (the MLA latents' norms' outputs, query, key,
    value, probabilities, context, the MLP's tensors) equal to the byte:

    - each HF RMSNorm of width w saves its fp32 upcast (4 T w) and rsqrt (4 T) instead of its bf16
      input: +4 T w + 4 T - 2 T w, and its bf16 normalised input for the weight gradient (+2 T w); the
      analytic norm saves its input only (Korthikanti's count). Four norms: h, d_q, d_c, h.
    - eager softmax runs in fp32 (`softmax(..., dtype=float32)`) and saves that output: +4 b a s s.
    - SiLU and the product are separate ops in HF: the SiLU output is saved too (+2 T f).
    - the last layer also holds the rotary cos and sin tables (2 x s d_r x 2 bytes): the analytic
      graph has no tensor for them (rope's backward reads only the tables).

    MoE layers are not compared here: on meta tensors no token is routed (the traced experts run
    transformers' batched_mm on every token), while the analytic graph plans a percentile of the
    routed rows (slackswap/moe_config.py); the MoE formula is tested by hand in tests/test_moe.py.
    """
    require_torch_extra("transformers")
    from slackswap.profile.torch import build_torch_graph
    from slackswap.profile.torch.spec import TorchSpec

    model = small(attention="eager")
    extra = {"first_k_dense_replace": model.num_layers, "rope_interleave": False, "attention_bias": False}
    traced = build_torch_graph(model, TorchSpec("hf", attention="eager", config_class="DeepseekV3Config",
                                                extra=extra), HW)
    analytic = build_graph(model, HW)
    t, b, a, s, h, f = 32, 2, 4, 16, 32, 40
    norms = sum(4 * t * w + 4 * t for w in (h, MLA["q_lora_rank"], MLA["kv_lora_rank"], h))
    softmax_fp32 = 4 * b * a * s * s
    silu = 2 * t * f
    rotary_tables = 2 * s * MLA["qk_rope_head_dim"] * 2
    got, want = per_layer(traced)[0], per_layer(analytic)[0]
    for layer in range(model.num_layers):
        last = rotary_tables if layer == model.num_layers - 1 else 0
        assert got[layer] - want[layer] == norms + softmax_fp32 + silu + last, layer
        assert forward_flops_total(traced, layer) == forward_flops_total(analytic, layer)


def forward_flops_total(graph, layer: int) -> float:
    return sum(forward_flops(graph, layer).values())


def test_the_mla_block_round_trips_through_graph_json(tmp_path):
    from slackswap.graph_io import read_graph_json, write_graph_json

    graph = build_graph(small(), HW)
    back = read_graph_json(write_graph_json(graph, tmp_path / "graph.json"))
    assert back.tensors == graph.tensors
    assert ModelConfig.from_dict(back.meta["model"]) == small()


# ------------------------------------------------------------------ shared experts, dense layers


def test_shared_experts_and_leading_dense_layers_by_hand():
    """First layer dense (f = 40), second MoE (E 4, top 2, f_e 8) with one shared expert of width 8:
    the MoE layer's MLP is the formula plus 3 T f_s elt; the dense layer is the dense model's."""
    moe = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 8, "num_shared_experts": 1,
           "first_dense_layers": 1, "score_function": "sigmoid"}
    model = small(moe=moe)
    saved, _, _ = per_layer(build_graph(model, HW))
    dense_layer = per_layer(build_graph(small(), HW))[0][0]
    assert saved[0] == dense_layer
    rows = model.moe.planned_tokens_per_expert(32)
    attention = dense_layer - 32 * (32 + 3 * 40) * 2
    assert saved[1] == attention + moe_mlp_saved_bytes(32, 32, 4, 2, 8, rows, 4, 2, shared_ffn=8)
    roles = {op.role for op in build_graph(model, HW).ops if op.layer == 1}
    assert {"router_sigmoid", "shared_gate", "shared_swiglu", "shared_down"} <= roles
    params, _ = parameter_counts(model)
    dense_params, _ = parameter_counts(small())
    assert params - dense_params == (4 * 3 * 32 * 8 + 32 * 4 + 3 * 32 * 8) - 3 * 32 * 40


def test_deepseek_v3_preset_has_the_reports_671b_parameters():
    """DeepSeek-V3 Technical Report, abstract: 671B total parameters (the MTP module's 14B apart)."""
    model = preset_model("deepseek_v3")
    params, _ = parameter_counts(model)
    assert round(params / 1e9) == 671
    assert (model.num_layers, model.hidden_size, model.num_heads, model.vocab_size) == (61, 7168, 128, 129280)
    assert dataclasses.astuple(model.mla) == (1536, 512, 128, 64, 128)
    assert (model.moe.num_experts, model.moe.top_k, model.moe.expert_ffn_hidden_size,
            model.moe.num_shared_experts, model.moe.first_dense_layers) == (256, 8, 2048, 1, 3)


def test_deepseek_v3_preset_layer_is_the_mla_formula_plus_the_moe_formula():
    model = preset_model("deepseek_v3", num_layers=4)
    t, h, elt, moe = 4096, 7168, 2, model.moe
    graph = build_graph(model, HW, parallel=ParallelConfig(dp=8, ep=8))
    saved, _, _ = per_layer(graph)
    attention = 2 * t * h * elt + mla_saved_bytes(t, 1, 4096, h, 128, 1536, 512, 192, 128, elt)  # + x, residual
    assert saved[0] == attention + t * (h + 3 * 18432) * elt == 1_394_606_080  # docs/profile.md's figure
    rows = moe.planned_tokens_per_expert(t, 8)
    assert saved[3] == attention + moe_mlp_saved_bytes(t, h, 256, 8, 2048, rows, 256 // 8, elt, shared_ffn=2048)


# ----------------------------------------------------------------------------------- head_dim


def test_head_dim_equal_to_the_tie_changes_nothing_and_another_widens_attention():
    base = dict(SMALL, num_kv_heads=2)
    tied = build_graph(ModelConfig.from_dict(base), HW)
    same = build_graph(ModelConfig.from_dict({**base, "head_dim": 8}), HW)
    assert same.ops == tied.ops and same.tensors == tied.tensors
    wide = build_graph(ModelConfig.from_dict({**base, "head_dim": 16}), HW)
    sizes = {t.name: t.size_bytes for t in wide.tensors.values()}
    assert sizes["L0.rope.q"] == 32 * 4 * 16 * 2 and sizes["L0.rope.k"] == 32 * 2 * 16 * 2
    assert sizes["L0.flash.out"] == 32 * 64 * 2 and sizes["L0.proj.out"] == 32 * 32 * 2
    params_tied, _ = parameter_counts(ModelConfig.from_dict(base))
    params_wide, _ = parameter_counts(ModelConfig.from_dict({**base, "head_dim": 16}))
    # qkv h (q + 2 kv) and proj (q h), 2 layers
    assert params_wide - params_tied == 2 * (32 * (64 + 2 * 32) - 32 * (32 + 2 * 16) + (64 - 32) * 32)


@pytest.mark.slow
def test_a_traced_llama_with_head_dim_has_the_analytic_parameters_and_flops():
    """HF LlamaConfig(head_dim=16) with hidden 32 and 4 heads (Q 64 wide), traced on meta: the same
    parameter count and forward FLOPs per layer as the analytic graph."""
    require_torch_extra("transformers")
    from slackswap.profile.torch import build_torch_graph, spec_for_family, trace_model

    model = ModelConfig.from_dict({**SMALL, "num_kv_heads": 2, "head_dim": 16, "num_layers": 1})
    spec = spec_for_family(model)
    assert trace_model(model, spec)[0].num_params == parameter_counts(model)[0]
    traced, analytic = build_torch_graph(model, spec, HW), build_graph(model, HW)
    assert forward_flops_total(traced, 0) == forward_flops_total(analytic, 0)


def test_qwen3_preset_has_its_config_head_dim():
    model = preset_model("qwen3_moe", num_layers=1)
    sizes = {t.name: t.size_bytes for t in build_graph(model, HW).tensors.values()}
    assert model.head_dim == 128 and sizes["L0.rope.q"] == 4096 * 32 * 128 * 2
    params, _ = parameter_counts(preset_model("qwen3_moe"))
    assert round(params / 1e9, 1) == 30.5  # the Qwen3-30B-A3B model card: 30.5B in total


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mla": {**MLA, "kv_lora_rank": 0}}, "model.mla.kv_lora_rank=0: must be an integer >= 1"),
        ({"mla": {**MLA, "q_lora_rank": -1}}, "model.mla.q_lora_rank=-1: must be an integer >= 0"),
        ({"mla": {**MLA, "qk_rope_head_dim": 5}}, "model.mla.qk_rope_head_dim=5: must be even"),
        ({"mla": {**MLA, "v_dim": 6}}, "model.mla=['v_dim']: unknown field(s)"),
        ({"num_kv_heads": 2}, "model.num_kv_heads=2: must equal model.num_heads=4 under model.mla"),
        ({"head_dim": 8}, "model.head_dim=8: is not used under model.mla"),
        ({"mla": None, "head_dim": -1}, "model.head_dim=-1: must be an integer >= 0"),
        ({"mla": None, "family": "gpt2", "head_dim": 8}, "model.head_dim=8: is modelled for the llama family only"),
        ({"moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 8, "first_dense_layers": -1}},
         "model.moe.first_dense_layers=-1: must be an integer >= 0"),
        ({"moe": {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 8, "score_function": "relu"}},
         "model.moe.score_function='relu': unknown"),
    ],
)
def test_bad_values_name_the_field(fields, message):
    with pytest.raises(ConfigError) as err:
        small(**fields)
    assert str(err.value).startswith(message)


def test_tensor_parallel_mla_by_hand_to_the_byte():
    """tp 2 (Megatron-Core's MLA: duplicated down-projections on the rank's R tokens, column-parallel
    up-projections of a' = 2 heads, row-parallel W^O). With sp, R = T / 2 = 16: the block saves
    R (h + 2 d_q + 2 d_c) 2 + T (2 a' d_qk + 2 a' d_v) 2 + 4 b a' s = 16 x 112 x 2 + 32 x 72 x 2 + 256
    = 3584 + 4608 + 256 = 8448; with the layer input, the residual and norm2's output (16 x 32 x 2
    each) and the MLP's gate, up and SwiGLU outputs at f / 2 = 20 (32 x 20 x 2 each): 15360 per layer.
    Without sp R = T: 7168 + 4608 + 256 = 12032, the rest 3 x 2048 + 3 x 1280: 22016. Parameters of a
    layer: h d_q + d_q + d_q a' d_qk + h (d_c + d_r) + d_c + d_c a' (d_n + d_v) + a' d_v h = 2856, two
    norms 64, the MLP 3 h f / 2 = 1920: 4840. Forward collectives of a layer under sp (bytes): the q
    latent 32 x 24 x 2, the kv latent 32 x 16 x 2 and the rotary key 32 x 4 x 2 gathered, the output
    projection's reduce-scatter and the MLP's gather and reduce-scatter of T h 2 = 2048."""
    from slackswap.profile.builder import GraphBuilder
    from slackswap.profile.layers import build_forward

    sp = ParallelConfig(tp=2, sp=True)
    mla = mla_saved_bytes(32, 2, 16, 32, 2, 24, 16, 12, 6, 2, rep_tokens=16)
    assert mla == 8448
    graph = build_graph(small(), HW, parallel=sp)
    saved, _, _ = per_layer(graph)
    assert [saved[layer] for layer in range(2)] == [1024 + mla + 1024 + 1024 + 3 * 1280] * 2 == [15_360] * 2
    plain, _, _ = per_layer(build_graph(small(), HW, parallel=ParallelConfig(tp=2)))
    assert mla_saved_bytes(32, 2, 16, 32, 2, 24, 16, 12, 6, 2) == 12_032
    assert plain[0] == 12_032 + 3 * 2048 + 3 * 1280 == 22_016
    fb = build_forward(small(), GraphBuilder(None, "bf16"), sp)
    assert fb.layer_params[0] == 2856 + 64 + 1920 == 4840
    forward = [(c.name, c.kind, c.size_bytes) for c in fb.collectives if c.layer == 0 and c.phase == "forward"]
    assert forward == [("L0.q_latent_in", "all_gather", 1536), ("L0.kv_latent_in", "all_gather", 1024),
                       ("L0.k_rope_in", "all_gather", 256), ("L0.attn_out", "reduce_scatter", 2048),
                       ("L0.mlp_in", "all_gather", 2048), ("L0.mlp_out", "reduce_scatter", 2048)]
    backward = [(c.name, c.kind, c.size_bytes) for c in build_forward(small(), GraphBuilder(None, "bf16"),
                                                                     ParallelConfig(tp=2)).collectives
                if c.layer == 0 and c.phase == "backward"]
    assert backward == [("L0.q_latent_in", "all_reduce", 1536), ("L0.kv_latent_in", "all_reduce", 1024),
                        ("L0.mlp_in", "all_reduce", 2048)]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["model.mla.kv_lora_rank=0"], "error: model.mla.kv_lora_rank=0: must be an integer >= 1"),
        (["model.moe.score_function=relu"], "error: model.moe.score_function='relu': unknown"),
    ],
)
def test_the_cli_exits_2_with_one_line(tmp_path, mlflow_store, monkeypatch, capsys, args, line):
    from tests.test_faults import _errors, _in_process, _runs, _store_args

    code = _in_process(monkeypatch, tmp_path, "model=deepseek_v3", *args, *_store_args(mlflow_store),
                       f"hydra.run.dir={tmp_path}/run")
    err = _errors(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err
    assert _runs(mlflow_store.db_path) == []


def test_a_pipeline_stage_has_experts_where_the_whole_model_has_them():
    """`first_dense_layers` counts from the model's first layer, not a stage's: with one leading dense
    layer, a 2-stage pipeline's second stage (layers 2-3) holds the same MoE layers as with none, and
    only the first stage loses experts, one layer's worth."""
    from slackswap.profile.stages import stage_parameter_counts

    def stages(first_dense_layers: int) -> list[int]:
        moe = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 8, "first_dense_layers": first_dense_layers}
        model = dataclasses.replace(small(moe=moe), num_layers=4)
        return [stage_parameter_counts(model, ParallelConfig(pp=2), s)[0] for s in (0, 1)]

    all_moe, one_dense = stages(0), stages(1)
    assert one_dense[1] == all_moe[1]
    assert all_moe[0] - one_dense[0] == (4 * 3 * 32 * 8 + 32 * 4) - 3 * 32 * 40
