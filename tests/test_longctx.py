"""Long-context presets (Llama-3-8B/70B-like) and FP8 storage of linear inputs (issue 43, item 4).

The presets' per-layer saved bytes under a layout equal Korthikanti et al.'s accounting applied to a
Llama layer (slackswap.formulas.llama_flash_saved_bytes_per_layer) to the byte; FP8 storage halves
exactly the saved linear inputs (and the GPT-2 formula's 34 sbh become 27 sbh: QKV, projection, fc1
and fc2 inputs, 14 sbh, at one byte)."""

from __future__ import annotations

import pytest
import yaml

from slackswap.errors import ConfigError
from slackswap.formulas import korthikanti_saved_bytes_per_layer, llama_flash_saved_bytes_per_layer
from slackswap.graph import NO_LAYER, OpClass, Phase
from slackswap.memory.recipe import TrainingConfig
from slackswap.parallel import ParallelConfig
from slackswap.profile import build_graph
from slackswap.profile.sources import profile_graph
from tests.test_parallel import gpt
from tests.test_profile import CONF, HW, per_layer, preset_model

FP8 = TrainingConfig(fp8_linear_inputs=True)

#: The released config.json figures each preset cites (meta-llama/Meta-Llama-3-{8B,70B}).
CONFIG_JSON = {
    "llama3_8b": dict(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
                      vocab_size=128256, seq_len=8192),
    "llama3_70b": dict(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672,
                       vocab_size=128256, seq_len=8192),
}


@pytest.mark.parametrize("name", sorted(CONFIG_JSON))
def test_presets_carry_the_released_shapes_with_flash_and_gqa(name):
    model = preset_model(name)
    for field, value in CONFIG_JSON[name].items():
        assert getattr(model, field) == value, field
    assert model.attention == "flash" and model.family == "llama" and model.dtype == "bf16"


def _formula(model, layout: ParallelConfig, fp8: bool = False) -> int:
    m = model
    return llama_flash_saved_bytes_per_layer(
        m.seq_len, m.micro_batch_size, m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_hidden_size,
        tensor_parallel=layout.tp, sequence_parallel=layout.sp, context_parallel=layout.cp, fp8_linear_inputs=fp8)


CASES = [  # (preset, seq_len, layout): the modern experiment's layouts, and cp on top
    ("llama3_8b", 8192, ParallelConfig()),
    ("llama3_8b", 32768, ParallelConfig(tp=8, sp=True)),
    ("llama3_8b", 131072, ParallelConfig(tp=4, sp=True, cp=4)),
    ("llama3_70b", 8192, ParallelConfig(tp=4, sp=True)),
    ("llama3_70b", 32768, ParallelConfig(tp=8, sp=True)),
    ("llama3_70b", 32768, ParallelConfig(tp=8, cp=2)),
]


@pytest.mark.parametrize(("name", "seq", "layout"), CASES)
@pytest.mark.parametrize("fp8", [False, True])
def test_saved_bytes_per_layer_under_a_layout_equal_the_formula(name, seq, layout, fp8):
    model = preset_model(name, num_layers=2, seq_len=seq)
    saved, _, _ = per_layer(build_graph(model, HW, FP8 if fp8 else None, parallel=layout))
    for layer in range(model.num_layers):
        assert saved[layer] == _formula(model, layout, fp8), layer


def test_formula_by_hand_for_the_70b_at_32k_on_tp8_sp():
    # s=32768, b=1, h=8192, kv=1024, f=28672, a=64, t=8: sbh = 268,435,456; sb*kv = 33,554,432; sbf = 939,524,096
    # (1.048 GiB per layer per rank: the `layout` line of a run prints it).
    # whole 8 sbh / 8; split (4 sbh + 4 sb kv + 6 sbf) / 8 + 4 * 64 * 32768 / 8.
    sbh, sbkv, sbf = 268_435_456, 33_554_432, 939_524_096
    expected = 8 * sbh // 8 + (4 * sbh + 4 * sbkv + 6 * sbf) // 8 + 4 * 64 * 32768 // 8
    assert llama_flash_saved_bytes_per_layer(32768, 1, 8192, 64, 8, 28672, tensor_parallel=8,
                                             sequence_parallel=True) == expected == 1_125_122_048
    # FP8 linear inputs: QKV and gate/up inputs (2 sbh / 8 whole-region shards) and the down input (sbf / 8)
    # at one byte, plus the projection's 1-byte copy of flash's output (sbh / 8): docs/profile.md's figure.
    fp8 = expected - 2 * sbh // 8 - sbf // 8 + sbh // 8
    assert llama_flash_saved_bytes_per_layer(32768, 1, 8192, 64, 8, 28672, tensor_parallel=8,
                                             sequence_parallel=True, fp8_linear_inputs=True) == fp8 == 974_127_104


def _linear_inputs(graph) -> dict[str, str]:
    """{forward linear op: the tensor its backward reads} for the transformer layers' GEMMs."""
    bwd = {op.forward_op: op for op in graph.ops if op.phase == Phase.BACKWARD}
    out = {}
    for op in graph.ops:
        if op.phase == Phase.FORWARD and op.op_class == OpClass.MATMUL and op.layer != NO_LAYER:
            (read,) = [t for t in bwd[op.name].inputs if not t.startswith("grad:")]
            out[op.name] = read
    return out


@pytest.mark.parametrize("layout", [ParallelConfig(), ParallelConfig(tp=8, sp=True), ParallelConfig(tp=8, cp=2)])
def test_fp8_halves_exactly_the_saved_linear_inputs(layout):
    model = preset_model("llama3_8b", num_layers=2, seq_len=8192)
    plain, fp8 = build_graph(model, HW, parallel=layout), build_graph(model, HW, FP8, parallel=layout)
    before, after = _linear_inputs(plain), _linear_inputs(fp8)
    assert set(before) == set(after) and len(before) == 2 * 5  # qkv, proj, gate, up, down per layer
    for op, tensor in before.items():
        assert after[op] == f"{tensor}.fp8" and fp8.tensors[after[op]].saved, op
        assert 2 * fp8.tensors[after[op]].size_bytes == plain.tensors[tensor].size_bytes, op
    assert after["L0.gate"] == after["L0.up"]  # one cast shared, as TE's LayerNormMLP
    # Every other saved tensor is the same; a 16-bit input stays saved only where another backward reads
    # it: flash's own output (the projection's input).
    plain_saved = {t.name: t.size_bytes for t in plain.saved_tensors}
    fp8_saved = {t.name: t.size_bytes for t in fp8.saved_tensors}
    copies = {t for t in fp8_saved if t.endswith(".fp8")}
    assert {n: s for n, s in fp8_saved.items() if n not in copies} == {
        n: s for n, s in plain_saved.items() if n not in set(before.values()) or n.endswith("flash.out")}
    # Outside the stack (embedding, LM head, loss) nothing changes.
    assert {n: s for n, s in fp8_saved.items() if not n.startswith("L")} == {
        n: s for n, s in plain_saved.items() if not n.startswith("L")}


def test_fp8_turns_korthikanti_34_sbh_into_27_sbh():
    """GPT-2 with eager attention: the linear inputs are 14 of the 34 sbh (QKV 2, projection 2, fc1 2,
    fc2 8), and none of them is read by another backward, so FP8 saves exactly 7 sbh per layer."""
    s, b, h, a = 512, 4, 1024, 16
    model = gpt("gpt2", s, b, h, a)
    saved, _, _ = per_layer(build_graph(model, HW, TrainingConfig(fp8_linear_inputs=True)))
    for layer in range(model.num_layers):
        assert saved[layer] == korthikanti_saved_bytes_per_layer(s, b, h, a) - 7 * s * b * h


def test_fp8_is_off_by_default_and_leaves_the_graph_as_it_was():
    model = preset_model("llama7b", num_layers=2)
    assert TrainingConfig().fp8_linear_inputs is False
    assert build_graph(model, HW) == build_graph(model, HW, TrainingConfig())
    for name in ("adamw_mixed", "adamw_pure16", "adamw_mixed_fp32_grads", "sgd_mixed", "adamw_fp32"):
        assert not TrainingConfig.from_dict(yaml.safe_load((CONF / "training" / f"{name}.yaml").read_text())) \
            .fp8_linear_inputs


def test_fp8_bad_values_name_the_field():
    with pytest.raises(ConfigError, match=r"^training.fp8_linear_inputs='yes': must be true or false$"):
        TrainingConfig(fp8_linear_inputs="yes")
    with pytest.raises(ConfigError, match=r"^training.fp8_linear_inputs=True: .*analytic"):
        profile_graph("torch", preset_model("tiny"), HW, FP8)
