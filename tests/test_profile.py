"""build_graph against the published formulas, and the structural rules planners rely on."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap.errors import ConfigError
from slackswap.formulas import (
    korthikanti_bwd_flops_per_layer,
    korthikanti_fwd_flops_per_layer,
    korthikanti_saved_bytes_per_layer,
)
from slackswap.graph import NO_LAYER, OpClass, Phase
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.profile import build_graph
from slackswap.profile.builder import grad_name
from slackswap.profile.layers import FLASH_BWD_FLOPS_FACTOR

CONF = Path(__file__).resolve().parents[1] / "conf"


def preset_model(name: str, **overrides) -> ModelConfig:
    """An analytic preset's keys as a ModelConfig; its Hydra defaults list (an MoE preset's
    `model_kind` override, conf/model_kind) is not a model field."""
    data = yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text())
    data.pop("defaults", None)
    return ModelConfig.from_dict({**data, **overrides})


def preset_hardware(name: str = "a100_80gb_pcie4") -> Hardware:
    return Hardware.from_dict(yaml.safe_load((CONF / "hardware" / f"{name}.yaml").read_text()))


HW = preset_hardware()


def per_layer(graph):
    saved, fwd, bwd = defaultdict(int), defaultdict(float), defaultdict(float)
    for t in graph.saved_tensors:
        saved[t.layer] += t.size_bytes
    for op in graph.ops:
        if op.phase == Phase.FORWARD:
            fwd[op.layer] += op.flops
        elif op.phase == Phase.BACKWARD:
            bwd[op.layer] += op.flops
    return saved, fwd, bwd


def assert_korthikanti(model: ModelConfig, graph) -> None:
    s, b, h, a = model.seq_len, model.micro_batch_size, model.hidden_size, model.num_heads
    saved, fwd, bwd = per_layer(graph)
    for layer in range(model.num_layers):
        assert saved[layer] == korthikanti_saved_bytes_per_layer(s, b, h, a), f"layer {layer}"
        assert fwd[layer] == korthikanti_fwd_flops_per_layer(s, b, h), f"layer {layer}"
        assert bwd[layer] == korthikanti_bwd_flops_per_layer(s, b, h), f"layer {layer}"


@pytest.mark.parametrize("name", ["bert_large", "gpt2_xl"])
def test_presets_match_korthikanti_to_the_byte(name):
    model = preset_model(name)
    assert (model.attention, model.dropout, model.bytes_per_element) == ("eager", True, 2)
    assert_korthikanti(model, build_graph(model, HW))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["bert", "gpt2"]),
    dtype=st.sampled_from(["bf16", "fp16"]),
    num_layers=st.integers(1, 3),
    heads=st.integers(1, 12),
    head_dim=st.integers(1, 48),
    seq_len=st.integers(1, 160),
    batch=st.integers(1, 6),
    vocab=st.integers(1, 500),
)
def test_random_shapes_match_korthikanti(family, dtype, num_layers, heads, head_dim, seq_len, batch, vocab):
    h = heads * head_dim
    model = ModelConfig("rand", family, num_layers, h, heads, heads, 4 * h, seq_len, batch, vocab, dtype=dtype)
    assert_korthikanti(model, build_graph(model, HW))


def test_saved_means_read_by_backward_and_layer_is_the_first_reader():
    graph = build_graph(preset_model("tiny"), HW)
    phase = {op.name: op.phase for op in graph.ops}
    layer = {op.name: op.layer for op in graph.ops}
    for t in graph.tensors.values():
        bwd_readers = [c for c in t.consumers if phase[c] == Phase.BACKWARD]
        produced_fwd = phase[t.producer] in (Phase.FORWARD, Phase.LOSS)
        assert t.saved == (produced_fwd and bool(bwd_readers)), t.name
        if t.saved:
            in_stack = [layer[c] for c in bwd_readers if layer[c] != NO_LAYER]
            assert t.layer == (in_stack[0] if in_stack else NO_LAYER), t.name
    # The last layer's output is read only by the final norm's backward: outside the stack.
    assert graph.tensors["L1.add2.out"].layer == NO_LAYER
    # The embedding output is read by layer 0's first norm backward.
    assert graph.tensors["embed_drop.out"].layer == 0
    # Transient tensors stay in the graph: scores, pre-dropout projections, gradients.
    assert not graph.tensors["L0.qk.out"].saved and not graph.tensors["L0.proj.out"].saved


def test_backward_mirrors_forward_in_reverse():
    graph = build_graph(preset_model("tiny"), HW)
    fwd = [op for op in graph.ops if op.phase in (Phase.FORWARD, Phase.LOSS)]
    bwd = graph.backward_ops
    assert [op.forward_op for op in bwd] == [op.name for op in reversed(fwd)]
    by_name = graph.op_by_name
    for op in bwd:
        f = by_name[op.forward_op]
        assert (op.layer, op.op_class) == (f.layer, f.op_class)
        if f.op_class == OpClass.MATMUL:
            assert op.flops == 2 * f.flops


def test_gradient_accumulation_rule():
    """The residual stream gradient: first contributor produces it, later ones read it, producer's bwd last."""
    graph = build_graph(preset_model("tiny"), HW)
    g = graph.tensors[grad_name("L0.add1.out")]  # read by ln2 and add2 in forward
    assert g.producer == "L0.add2.bwd"
    assert g.consumers[-1] == "L0.add1.bwd"  # backward of the forward producer reads it last
    assert "L0.ln2.bwd" in g.consumers
    assert not g.saved and g.role == "grad"
    idx = graph.op_index
    for t in graph.tensors.values():
        if t.role == "grad":
            forward_tensor = t.name.removeprefix("grad:")
            producer_bwd = graph.tensors[forward_tensor].producer + ".bwd"
            assert t.consumers[-1] == producer_bwd, t.name
            assert all(idx[c] > idx[t.producer] for c in t.consumers)


def test_loss_keeps_fp32_probabilities_and_gets_16bit_logit_grads():
    model = preset_model("tiny")
    graph = build_graph(model, HW)
    tokens = model.seq_len * model.micro_batch_size
    assert graph.tensors["loss.probs"].size_bytes == tokens * model.vocab_size * 4
    assert graph.tensors["loss.probs"].saved
    assert graph.tensors["lm_head.out"].size_bytes == tokens * model.vocab_size * 2
    assert graph.tensors[grad_name("lm_head.out")].producer == "loss.bwd"
    assert graph.op_by_name["loss"].phase == Phase.LOSS


def test_llama_flash_saves_only_output_and_lse_besides_qkv():
    model = preset_model("llama7b")
    graph = build_graph(model, HW)
    s, b, h, a, f = model.seq_len, model.micro_batch_size, model.hidden_size, model.num_heads, model.ffn_hidden_size
    layer0 = {t.role: t.size_bytes for t in graph.saved_tensors if t.layer == 0}
    assert layer0["softmax_lse"] == a * s * b * 4
    assert "softmax_out" not in layer0 and "dropout_mask" not in layer0 and "attn_scores" not in layer0
    flash = graph.op_by_name["L0.flash"]
    assert set(graph.op_by_name["L0.flash.bwd"].inputs) >= {"L0.rope.q", "L0.rope.k", "L0.qkv.v", "L0.flash.out",
                                                           "L0.flash.lse"}
    assert flash.flops == 4 * b * s * s * h
    assert graph.op_by_name["L0.flash.bwd"].flops == FLASH_BWD_FLOPS_FACTOR * flash.flops
    # Saved per layer: x, norm1 out, rotated Q and K, V, ctx, lse, x_mid, norm2 out, gate, up, swiglu out.
    sbh2 = 2 * s * b * h
    assert sum(layer0.values()) == 7 * sbh2 + a * s * b * 4 + 3 * 2 * s * b * f
    # Rotary backward needs only cos/sin: pre-rotary Q and K are transient.
    assert not graph.tensors["L0.qkv.q"].saved and not graph.tensors["L0.qkv.k"].saved
    # FLOPs: GEMMs (q,k,v,o 4h^2 + 3 h f) plus 4bs^2h attention.
    saved, fwd, _ = per_layer(graph)
    assert fwd[0] == 2 * b * s * (4 * h * h + 3 * h * f) + 4 * b * s * s * h


def test_gqa_shrinks_k_and_v():
    model = preset_model("llama2_70b", num_layers=2)
    graph = build_graph(model, HW)
    kv_bytes = model.seq_len * model.micro_batch_size * model.num_kv_heads * model.attention_head_dim * 2
    assert graph.tensors["L0.qkv.k"].size_bytes == kv_bytes == graph.tensors["L0.qkv.v"].size_bytes
    assert graph.tensors["L0.qkv.q"].size_bytes == 8 * kv_bytes


@pytest.mark.parametrize(("name", "params"), [("gpt2_xl", 1_557_611_200), ("llama7b", 6_738_415_616),
                                              ("llama2_70b", 68_976_648_192)])
def test_parameter_counts_match_the_released_models(name, params):
    graph = build_graph(preset_model(name, num_layers=preset_model(name).num_layers), HW)
    assert graph.meta["num_params"] == params
    assert (graph.weight_bytes, graph.weight_grad_bytes, graph.optimizer_state_bytes) == (2 * params, 2 * params,
                                                                                            12 * params)


def test_fp32_state_bytes_and_eager_llama_override():
    model = preset_model("tiny", dtype="fp32")
    graph = build_graph(model, HW)
    p = graph.meta["num_params"]
    assert (graph.weight_bytes, graph.weight_grad_bytes, graph.optimizer_state_bytes) == (4 * p, 4 * p, 8 * p)
    eager = build_graph(preset_model("llama7b", attention="eager", num_layers=1), HW)
    assert "L0.softmax" in eager.op_by_name and "L0.flash" not in eager.op_by_name


def test_optimizer_ops_when_requested():
    model = preset_model("tiny", include_optimizer=True)
    graph = build_graph(model, HW)
    opt = [op for op in graph.ops if op.phase == Phase.OPTIMIZER]
    assert [op.name for op in opt] == ["L0.adam", "L1.adam", "adam"]
    assert all(not op.inputs and not op.outputs and op.flops == 0 for op in opt)
    assert sum(op.moved_bytes for op in opt) == 28 * graph.meta["num_params"]
    assert graph.ops[-1].phase == Phase.OPTIMIZER
    assert not any(op.phase == Phase.OPTIMIZER for op in build_graph(preset_model("tiny"), HW).ops)


def test_dropout_off_removes_masks():
    graph = build_graph(preset_model("tiny", dropout=False), HW)
    assert not any(t.role == "dropout_mask" for t in graph.tensors.values())
    model = preset_model("tiny")
    s, b, h, a = model.seq_len, model.micro_batch_size, model.hidden_size, model.num_heads
    saved, _, _ = per_layer(graph)
    # Without dropout: no masks (2 sbh + a s^2 b) and no dropout output (2 a s^2 b).
    assert saved[0] == korthikanti_saved_bytes_per_layer(s, b, h, a) - 2 * s * b * h - 3 * a * s * s * b


def test_every_op_is_timed():
    graph = build_graph(preset_model("gpt2_xl", num_layers=2), HW)
    assert all(op.duration_s >= HW.launch_overhead_s for op in graph.ops)
    assert all(op.moved_bytes > 0 for op in graph.ops)


def test_llama_with_dropout_is_rejected():
    with pytest.raises(ConfigError, match=r"model.dropout=True"):
        build_graph(preset_model("llama7b", dropout=True), HW)


def test_bf16_on_v100_is_rejected_with_the_field():
    with pytest.raises(ConfigError, match=r"model.dtype='bf16'"):
        build_graph(preset_model("tiny"), preset_hardware("v100_pcie3"))
    assert build_graph(preset_model("tiny", dtype="fp16"), preset_hardware("v100_pcie3")).num_layers == 2


def test_graph_meta_records_the_config():
    model = preset_model("tiny")
    graph = build_graph(model, HW)
    assert graph.meta["model"] == dataclasses.asdict(model)
    assert graph.meta["hardware"] == "a100_80gb_pcie4"


@pytest.mark.parametrize("name", ["bert_large", "gpt2_xl", "llama7b"])
@pytest.mark.parametrize("attention", ["eager", "flash"])
def test_every_tensor_has_a_reader_and_every_forward_op_a_backward(name, attention):
    """The simulator frees a tensor after its last reader: a tensor nobody reads would never be freed."""
    graph = build_graph(preset_model(name, num_layers=2, attention=attention, include_optimizer=True), HW)
    assert all(t.consumers for t in graph.tensors.values())
    forward = {op.name for op in graph.ops if op.phase in (Phase.FORWARD, Phase.LOSS)}
    assert {op.forward_op for op in graph.backward_ops} == forward
    saved, fwd, bwd = per_layer(graph)
    assert saved[0] == saved[1] > 0 and fwd[0] == fwd[1] > 0 and bwd[1] > fwd[1]
