"""A layout's collectives in the run's step: the exposed time `price` gives (tp in full, a cp ring beyond
the attention it overlaps), and `run_one`'s step = the simulated compute step + that time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slackswap.communication import Fabric, Topology
from slackswap.experiment import RunSpec, run_one
from slackswap.experiment.layout_comm import with_layout_comm
from slackswap.parallel import ParallelConfig
from slackswap.profile import build_graph, layout_collectives
from slackswap.profile.collectives import Collective, price
from tests.test_experiment import _config, _preset
from tests.test_profile import HW, preset_model

NVLINK = Fabric("nvlink", 100e9, 1e-6)


def test_tp2_exposed_time_by_hand():
    """tiny (2 layers, s=32, b=2, h=64, bf16), tp=2 without sp: each tensor-parallel all-reduce moves the
    b s h activation, 2 * 32 * 64 * 2 = 8192 bytes; a 2-rank ring all-reduce takes 2 (n-1) alpha +
    2 S (n-1)/n / B = 2e-6 + 8192 / 100e9 = 2.08192e-6 s. Forward: 2 per layer x 2 layers + the
    vocab-parallel embedding = 5, plus the loss's 3 fp32 all-reduces of 32 tokens x 2 x 4 bytes = 256
    bytes (2.00256e-6 s each); backward: 2 per layer x 2 + the LM head's input gradient = 5."""
    model = preset_model("tiny")
    par = ParallelConfig(tp=2)
    graph = build_graph(model, HW, parallel=par)
    comm = price(layout_collectives(graph), par, Topology(2, NVLINK, None), "hand", graph=graph)
    assert comm.forward_exposed_s == pytest.approx(5 * 2.08192e-6 + 3 * 2.00256e-6, rel=1e-12)
    assert comm.backward_exposed_s == pytest.approx(5 * 2.08192e-6, rel=1e-12)
    assert comm.exposed_s == pytest.approx(26.82688e-6, rel=1e-12)
    assert comm.exposed_s == pytest.approx(comm.total_s, rel=1e-12) and comm.hidden_s == pytest.approx(0.0)


def _ring(layer: int, phase: str, size: int) -> Collective:
    return Collective(f"L{layer}.ring", layer, phase, "ring_exchange", "cp", 2, size, "K, V")


def _attention(layer: int, phase: str, seconds: float) -> SimpleNamespace:
    return SimpleNamespace(attention_core=True, layer=layer, phase=phase, duration_s=seconds)


def test_a_cp_ring_is_exposed_only_beyond_its_layers_attention():
    """A 2-rank ring of 2e5 bytes: 1e-6 + 1e5 / 100e9 = 2e-6 s. Layer 0's forward attention takes 0.5e-6
    s (1.5e-6 exposed), layer 1's 5e-6 s (hides it all); a tp all-reduce beside them stays whole."""
    ring_s = 2e-6
    tp = Collective("L0.attn_out", 0, "forward", "all_reduce", "tp", 2, 8192, "g")
    graph = SimpleNamespace(ops=[_attention(0, "forward", 0.5e-6), _attention(1, "forward", 5e-6),
                                 SimpleNamespace(attention_core=False, layer=0, phase="forward", duration_s=1.0)])
    collectives = [_ring(0, "forward", 200_000), _ring(1, "forward", 200_000), tp]
    comm = price(collectives, ParallelConfig(tp=2, cp=2), Topology(4, NVLINK, None), graph=graph)
    assert comm.forward_s == pytest.approx(2 * ring_s + 2.08192e-6, rel=1e-12)
    assert comm.forward_exposed_s == pytest.approx(1.5e-6 + 2.08192e-6, rel=1e-12)
    assert comm.hidden_s == pytest.approx(0.5e-6 + ring_s, rel=1e-9)
    blind = price(collectives, ParallelConfig(tp=2, cp=2), Topology(4, NVLINK, None))  # no graph: none hidden
    assert blind.forward_exposed_s == pytest.approx(blind.forward_s, rel=1e-12)


def _node_spec(**parallel) -> RunSpec:
    node = _preset("node", "dgx_a100")
    config = _config("tiny", "slackswap", {"fraction": 0.5}, node=node, parallel=parallel)
    config["hardware"] = _preset("hardware", "a100_80gb_sxm_pcie4")
    return RunSpec.from_dict(config)


def test_run_step_is_the_compute_step_plus_the_exposed_collectives():
    out = run_one(_node_spec(tp=2))
    m = out.metrics
    assert m["layout_comm_s"] > 0 and m["layout_comm_fabric"] == "tp:nvlink"
    assert m["step_s"] == pytest.approx(out.result.step_s + m["layout_comm_s"], rel=1e-12)
    assert m["ideal_step_s"] == pytest.approx(out.baseline.ideal.step_s + m["layout_comm_s"], rel=1e-12)
    assert m["throughput_ratio"] == pytest.approx(m["ideal_step_s"] / m["step_s"], rel=1e-12)
    assert m["tokens_per_s"] == pytest.approx(m["tokens_per_step"] / m["step_s"], rel=1e-12)
    assert m["layout_comm_s"] == pytest.approx(m["layout_comm_forward_s"] + m["layout_comm_backward_s"], rel=1e-12)


def test_no_tp_or_cp_leaves_the_step_as_simulated():
    out = run_one(_node_spec(dp=2))  # a layout with no collectives inside the step
    assert out.metrics["layout_comm_s"] == 0.0 and out.metrics["step_s"] == out.result.step_s
    sim = {"step_s": 1.0, "ideal_step_s": 0.5, "bound_step_s": None, "throughput_ratio": 0.5,
           "optimality_gap": None}
    assert with_layout_comm(sim, None) is sim and with_layout_comm(sim, 0.0) is sim
    added = with_layout_comm(sim, 0.5)
    assert (added["step_s"], added["ideal_step_s"], added["throughput_ratio"]) == (1.5, 1.0, 1.0 / 1.5)


def test_a_pipeline_stage_waits_on_its_exposed_collectives():
    """tp=2 x pp=2: each stage's forward and backward carry the exposed time of its own collectives."""
    from slackswap.experiment import pipeline_run as pr
    from slackswap.experiment.layout_comm import layout_communication
    from slackswap.simulate.pipeline_stage import stage_times

    spec = _node_spec(tp=2, pp=2, microbatches=2)
    stage = pr.build_stages(spec)[0]
    comm = layout_communication(spec, stage.graph)
    plain, timed = stage_times(stage.graph, stage.ideal), pr._times(spec, stage.graph, stage.ideal)
    assert comm.forward_exposed_s > 0 and comm.backward_exposed_s > 0
    assert timed.forward_s == pytest.approx(plain.forward_s + comm.forward_exposed_s, rel=1e-12)
    assert timed.backward_s == pytest.approx(plain.backward_s + comm.backward_exposed_s, rel=1e-12)
    out = run_one(spec)
    assert out.metrics["layout_comm_s"] == pytest.approx(comm.exposed_s, rel=1e-12)
    assert out.metrics["ideal_step_s"] > pr.simulate_pipeline([plain, plain], 2, out.metrics["pipeline_p2p_s"]).step_s
