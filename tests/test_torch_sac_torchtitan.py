"""torch_sac_torchtitan keeps what torchtitan's "op" selective-checkpointing policy keeps: per block the
fused attention kernel's outputs and the odd-numbered matmuls' (Q, V of the three projections, the
gate and the down projection of a Llama block), recomputing the rest."""

from __future__ import annotations

from pathlib import Path

import yaml

from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Decision
from slackswap.planners.registry import available_planners, get_planner
from slackswap.profile import build_graph

CONF = Path(__file__).resolve().parents[1] / "conf"
HW = Hardware.from_dict(yaml.safe_load((CONF / "hardware" / "a100_80gb_pcie4.yaml").read_text()))


def _graph(attention: str):
    data = yaml.safe_load((CONF / "model" / "tiny.yaml").read_text())
    model = ModelConfig.from_dict({**data, "family": "llama", "dropout": False, "attention": attention,
                                   "num_kv_heads": data["num_heads"]})
    return build_graph(model, HW)


def test_registered_with_a_conf_file():
    assert "torch_sac_torchtitan" in available_planners()
    preset = yaml.safe_load((CONF / "planner" / "torch_sac_torchtitan.yaml").read_text())
    assert preset["name"] == "torch_sac_torchtitan"


def test_saves_attention_and_every_other_matmul_per_block():
    graph = _graph("flash")
    plan = get_planner("torch_sac_torchtitan").plan(graph, HW, None)
    kept = {t for t, d in plan.decisions.items() if d == Decision.KEEP}
    recomputed = {t for t, d in plan.decisions.items() if d == Decision.RECOMPUTE}
    # mm 1, 3 (q, v), 5 (gate) and 7 (down) kept; 2 (k), 4 (proj), 6 (up) not cached
    assert {"L0.qkv.q", "L0.qkv.v", "L0.gate.out", "L0.down.out"} <= kept
    # K (mm 2) and up (mm 6) are not cached; neither are the norms, rotary outputs and SwiGLU
    assert {"L0.up.out", "L0.rope.k", "L0.norm1.out", "L0.norm2.out", "L0.swiglu.out"} <= recomputed
    flash = next(op for op in graph.ops if op.layer == 0 and op.op_class == "attention")
    assert all(t in kept for t in flash.outputs if t in plan.decisions)
    # between torch_sac's "save every matmul" and recomputing everything inside the blocks
    sac = get_planner("torch_sac").plan(graph, HW, None)
    full = get_planner("full_recompute").plan(graph, HW, None)
    n = lambda p: sum(d == Decision.RECOMPUTE for d in p.decisions.values())  # noqa: E731
    assert n(sac) < n(plan) < n(full)


def test_eager_attention_core_is_recomputed():
    graph = _graph("eager")
    plan = get_planner("torch_sac_torchtitan").plan(graph, HW, None)
    core = [t for t in graph.saved_tensors if graph.op_by_name[t.producer].attention_core
            and graph.op_by_name[t.producer].layer == 0]
    assert core and all(plan.decisions[t.name] == Decision.RECOMPUTE for t in core)
