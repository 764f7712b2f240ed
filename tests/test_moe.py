"""Mixture-of-experts in the analytic profile (slackswap/moe_config.py, slackswap/profile/moe.py): the
load rule, an MoE layer's saved bytes by hand to the byte, the dense limit, expert parallelism and
its all-to-alls, the bad inputs, and the planners on the MoE presets."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from fractions import Fraction

import pytest

from slackswap.communication import Fabric, Topology, all_gather_s
from slackswap.errors import ConfigError
from slackswap.graph import Phase
from slackswap.model_config import ModelConfig
from slackswap.moe_config import MoEConfig
from slackswap.parallel import ParallelConfig
from slackswap.profile import build_graph, layout_collectives, parameter_counts
from slackswap.profile.collectives import price
from slackswap.profile.moe import moe_mlp_saved_bytes
from tests.test_profile import HW, per_layer, preset_model

#: A small llama-family MoE: T = s b = 64 tokens, h 64, 4 heads (2 kv heads), 4 experts top-2, f_e 48.
SMALL = dict(name="small_moe", family="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=96, seq_len=32, micro_batch_size=2, vocab_size=100, dropout=False, attention="flash")
MOE = {"num_experts": 4, "top_k": 2, "expert_ffn_hidden_size": 48}

#: Roles of the tensors the dense SwiGLU MLP saves, and of the same tensors of an expert.
DENSE_MLP = ("rmsnorm_out@norm2", "gate_out", "up_out", "swiglu_out")
EXPERT = ("expert_in", "expert_gate_out", "expert_up_out", "expert_swiglu_out")


def small(**moe) -> ModelConfig:
    return ModelConfig.from_dict({**SMALL, "moe": {**MOE, **moe}})


def binomial_percentile(n: int, p: float, q: float) -> int:
    """The smallest x with P(Binomial(n, p) <= x) >= q, summed term by term in exact integers (no scipy)."""
    prob = Fraction(p)
    a, c = prob.numerator, prob.denominator
    target = Fraction(q).limit_denominator(10**6) * c**n
    cdf = 0
    for x in range(n + 1):
        cdf += math.comb(n, x) * a**x * (c - a) ** (n - x)
        if cdf >= target:
            return x
    return n


def saved_by_role(graph, layer: int) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for t in graph.saved_tensors:
        if t.layer == layer:
            role = f"{t.role}@norm2" if t.name.endswith("norm2.out") else t.role
            out[role] += t.size_bytes
    return out


# ---------------------------------------------------------------------------------------- load rule


def test_planned_tokens_follow_the_percentile_then_the_capacity():
    moe = MoEConfig(8, 2, 16)  # k / E = 1/4
    assert moe.percentile_load(4096) == binomial_percentile(4096, 0.25, 0.99) > 4096 * 2 // 8
    assert moe.planned_tokens_per_expert(4096) == moe.percentile_load(4096)
    assert MoEConfig(8, 2, 16, load_percentile=50.0).planned_tokens_per_expert(4096) == 1024  # the mean
    assert MoEConfig(8, 2, 16, load_percentile=100.0).planned_tokens_per_expert(4096) == 4096  # every token
    # ep 2: an expert can receive the tokens of both ranks of its group
    assert moe.planned_tokens_per_expert(4096, ep=2) == binomial_percentile(8192, 0.25, 0.99)
    # capacity 1.0: C = ceil(1.0 * 4096 * 2 / 8) = 1024 per source rank, below the percentile load
    capped = MoEConfig(8, 2, 16, capacity_factor=1.0)
    assert capped.capacity_per_source(4096) == 1024
    assert capped.planned_tokens_per_expert(4096) == 1024
    assert capped.planned_tokens_per_expert(4096, ep=2) == 2048
    # a generous capacity does not bind: the percentile does
    assert MoEConfig(8, 2, 16, capacity_factor=2.0).planned_tokens_per_expert(4096) == moe.percentile_load(4096)


# ------------------------------------------------------------------------------- bytes by hand


def test_an_moe_layers_saved_bytes_by_hand_to_the_byte():
    """T = 64, h = 64, E = 4, k = 2, f_e = 48, bf16. Rows per expert: the 99th percentile of
    Binomial(64, 1/2) = 41. MoE MLP: T h 2 (router input 8192) + 4 T E (fp32 probabilities 1024)
    + 12 T k (fp32 weights + int64 indices 1536) + E L (2 h + 3 f_e) 2 (per expert: input, gate, up,
    SwiGLU, down output: 4 x 41 x 272 x 2 = 89216) = 99968. Attention part (flash, GQA 2 kv heads):
    layer input 8192, norm1 out 8192, v 4096, rotated q 8192, rotated k 4096, context 8192, fp32 lse
    b a s 4 = 1024, first residual 8192 = 50176. Layer total 150144."""
    model = small()
    rows = binomial_percentile(64, 0.5, 0.99)
    assert rows == 41 == model.moe.planned_tokens_per_expert(64)
    mlp = 64 * 64 * 2 + 4 * 64 * 4 + 12 * 64 * 2 + 4 * rows * (2 * 64 + 3 * 48) * 2
    assert mlp == 99_968 == moe_mlp_saved_bytes(64, 64, 4, 2, 48, rows, 4, 2)
    attention = 5 * 8192 + 2 * 4096 + 2 * 4 * 32 * 4
    saved, _, _ = per_layer(build_graph(model, HW))
    for layer in range(model.num_layers):
        assert saved[layer] == attention + mlp == 150_144, layer


def test_one_expert_top_1_is_the_dense_mlp_plus_the_router():
    """E = 1, k = 1, f_e = f: the expert's saved tensors are the dense MLP's byte for byte (dropless or
    at capacity 1.0: every token, once); the layer adds the router's input, the expert's output (for
    the combine's weight gradient) and 16 bytes per token (fp32 probability and weight, int64 index)."""
    dense = ModelConfig.from_dict(SMALL)
    t, h, elt = 64, 64, 2
    dense_graph = build_graph(dense, HW)
    dense_roles = saved_by_role(dense_graph, 0)
    for extra in ({}, {"capacity_factor": 1.0}):
        model = small(num_experts=1, top_k=1, expert_ffn_hidden_size=96, **extra)
        graph = build_graph(model, HW)
        roles = saved_by_role(graph, 0)
        assert [roles[r] for r in EXPERT] == [dense_roles[r] for r in DENSE_MLP]
        diff = per_layer(graph)[0][0] - per_layer(dense_graph)[0][0]
        assert diff == t * h * elt + t * h * elt + 16 * t
        # the expert's FLOPs are the dense MLP's; the router adds 2 T h E forward
        fwd = {op.role: op.flops for op in graph.ops if op.phase == Phase.FORWARD and op.layer == 0}
        dense_fwd = {op.role: op.flops for op in dense_graph.ops if op.phase == Phase.FORWARD and op.layer == 0}
        assert [fwd["expert_gate"], fwd["expert_up"], fwd["expert_down"]] == [
            dense_fwd["gate"], dense_fwd["up"], dense_fwd["down"]]
        assert fwd["router"] == 2.0 * t * h * 1


def test_parameters_count_every_expert_and_the_router():
    model = small()
    h, e, f = 64, 4, 48
    dense_params, _ = parameter_counts(ModelConfig.from_dict(SMALL))
    dense_mlp = 3 * h * 96
    moe_params, _ = parameter_counts(model)
    assert moe_params - dense_params == model.num_layers * (e * 3 * h * f + h * e - dense_mlp)
    per_rank, _ = parameter_counts(model, ParallelConfig(dp=2, ep=2))
    assert moe_params - per_rank == model.num_layers * (e // 2) * 3 * h * f


# ------------------------------------------------------------------------------ expert parallelism


def test_expert_parallel_rank_holds_its_experts_and_the_all_to_alls():
    model = small()
    t, h, k, elt, ep = 64, 64, 2, 2, 2
    graph = build_graph(model, HW, parallel=ParallelConfig(dp=2, ep=ep))
    rows = binomial_percentile(ep * t, 0.5, 0.99)
    saved, _, _ = per_layer(graph)
    attention = 5 * 8192 + 2 * 4096 + 2 * 4 * 32 * 4
    assert saved[1] == attention + moe_mlp_saved_bytes(t, h, 4, k, 48, rows, 4 // ep, elt)
    experts = {n.split(".")[1] for n in graph.tensors if n.startswith("L1.expert")}
    assert experts == {"expert0", "expert1"}
    layer1 = [c for c in layout_collectives(graph) if c.layer == 1]
    assert sorted((c.name, c.phase) for c in layer1) == [
        ("L1.moe_combine", "backward"), ("L1.moe_combine", "forward"),
        ("L1.moe_dispatch", "backward"), ("L1.moe_dispatch", "forward")]
    routed = t * k * h * elt
    assert {(c.kind, c.group, c.ranks, c.size_bytes) for c in layer1} == {("all_to_all", "ep", ep, routed)}
    assert sum(c.bus_bytes for c in layer1) == 4 * routed * (ep - 1) / ep
    nvlink = Fabric("nvlink", 450e9, 2e-6)
    comm = price(layout_collectives(graph), ParallelConfig(dp=2, ep=ep), Topology(8, nvlink, None), "hgx")
    assert comm.forward_s == pytest.approx(2 * model.num_layers * all_gather_s(routed, ep, nvlink), rel=1e-12)
    assert comm.fabrics == {"ep": "nvlink"}


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"dp": 3, "ep": 3}, "parallel.ep=3: does not divide model.moe.num_experts=4"),
        ({"ep": 2}, "parallel.ep=2: does not divide parallel.dp * parallel.cp = 1"),
        ({"tp": 2}, "parallel.tp=2: expert tensor parallelism is not modelled for an MoE model; use parallel.ep"),
    ],
)
def test_a_bad_expert_layout_names_the_field(layout, message):
    with pytest.raises(ConfigError) as err:
        build_graph(small(), HW, parallel=ParallelConfig(**layout))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("moe", "message"),
    [
        ({"top_k": 5}, "model.moe.top_k=5: exceeds model.moe.num_experts=4"),
        ({"num_experts": 0}, "model.moe.num_experts=0: must be an integer >= 1"),
        ({"expert_ffn_hidden_size": 0}, "model.moe.expert_ffn_hidden_size=0: must be an integer >= 1"),
        ({"capacity_factor": -1.0}, "model.moe.capacity_factor=-1.0: must be a non-negative finite number"),
        ({"load_percentile": 0.0}, "model.moe.load_percentile=0.0: must be a positive finite number"),
        ({"load_percentile": 101.0}, "model.moe.load_percentile=101.0: must be in (0, 100]"),
        ({"experts": 4}, "model.moe=['experts']: unknown field(s)"),
    ],
)
def test_bad_moe_values_name_the_field(moe, message):
    with pytest.raises(ConfigError) as err:
        small(**moe)
    assert str(err.value).startswith(message)


def test_experts_only_on_the_llama_family():
    with pytest.raises(ConfigError, match=r"^model.family='gpt2': model.moe \(experts\) is modelled for the llama"):
        ModelConfig.from_dict({**SMALL, "family": "gpt2", "moe": MOE})


def test_the_moe_block_round_trips_through_graph_json(tmp_path):
    from slackswap.graph_io import read_graph_json, write_graph_json

    graph = build_graph(small(), HW)
    back = read_graph_json(write_graph_json(graph, tmp_path / "graph.json"))
    assert back.tensors == graph.tensors
    assert ModelConfig.from_dict(back.meta["model"]) == small()


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["parallel.ep=3", "parallel.dp=3"], "error: parallel.ep=3: does not divide model.moe.num_experts=8"),
        (["model.moe.top_k=9"], "error: model.moe.top_k=9: exceeds model.moe.num_experts=8"),
        (["model.moe.load_percentile=0"], "error: model.moe.load_percentile=0.0: must be a positive finite number"),
    ],
)
def test_the_cli_exits_2_with_one_line_and_records_nothing(tmp_path, mlflow_store, monkeypatch, capsys, args, line):
    from tests.test_faults import _errors, _in_process, _runs, _store_args

    code = _in_process(monkeypatch, tmp_path, "model=mixtral_8x7b", *args, *_store_args(mlflow_store),
                       f"hydra.run.dir={tmp_path}/run")
    err = _errors(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err
    assert _runs(mlflow_store.db_path) == []


# ------------------------------------------------------------------------------- presets, planners


@pytest.mark.parametrize("name", ["mixtral_8x7b", "qwen3_moe"])
def test_moe_presets_plan_within_the_budget(name):
    """slackswap plans a cut of each preset (Mixtral 4 layers at 50 %; Qwen3's 151936-entry fp32 loss
    dominates a 2-layer cut, so 80 %) and the simulated step stays within the budget, experts moved."""
    from slackswap.planners.registry import get_planner
    from slackswap.schedule import estimate_plan, keep_all_plan
    from slackswap.simulate import simulate

    graph = build_graph(preset_model(name, num_layers=4 if name == "mixtral_8x7b" else 2), HW)
    peak = estimate_plan(graph, keep_all_plan(graph), HW).peak_bytes
    budget = int(0.5 * peak) if name == "mixtral_8x7b" else int(0.8 * peak)
    plan = get_planner("slackswap").plan(graph, HW, budget)
    result = simulate(graph, plan, HW, budget)
    assert result.feasible and result.peak_activation_bytes <= budget
    assert any(t.startswith("L1.expert") for t in plan.decisions if plan.decisions[t].value != "keep")


def test_preset_figures():
    mixtral = preset_model("mixtral_8x7b")
    assert (mixtral.num_layers, mixtral.hidden_size, mixtral.num_kv_heads, mixtral.seq_len) == (32, 4096, 8, 4096)
    assert dataclasses.astuple(mixtral.moe)[:3] == (8, 2, 14336)
    qwen = preset_model("qwen3_moe")
    assert dataclasses.astuple(qwen.moe)[:3] == (128, 8, 768)
    # Mixtral's parameter count: 46.7B in Jiang et al. 2024 (section 1)
    params, _ = parameter_counts(mixtral)
    assert round(params / 1e9, 1) == 46.7


@pytest.mark.parametrize("name", ["mixtral_8x7b", "qwen3_moe"])
def test_preset_layer_is_the_dense_attention_plus_the_moe_formula(name):
    """One layer of each preset: the dense llama layer of the same shape, less its MLP (T (h + 3 f) elt),
    plus the MoE formula with the planned rows (docs/profile.md's per-layer figures)."""
    model = preset_model(name, num_layers=1)
    dense = dataclasses.replace(model, moe=None)
    t, h, elt, moe = model.seq_len * model.micro_batch_size, model.hidden_size, model.bytes_per_element, model.moe
    attention = per_layer(build_graph(dense, HW))[0][0] - t * (h + 3 * model.ffn_hidden_size) * elt
    rows = moe.planned_tokens_per_expert(t)
    assert rows == binomial_percentile(t, moe.top_k / moe.num_experts, 0.99)
    expected = attention + moe_mlp_saved_bytes(t, h, moe.num_experts, moe.top_k, moe.expert_ffn_hidden_size, rows,
                                               moe.num_experts, elt)
    assert per_layer(build_graph(model, HW))[0][0] == expected
