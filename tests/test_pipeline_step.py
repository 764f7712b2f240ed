"""The pipeline step model (`slackswap.simulate.pipeline`) and per-stage graphs (`slackswap.profile.stages`):
an exact event log of a 2-stage pipeline worked by hand, the 1F1B formula, in-flight counts equal to
the schedule's, and the stage graphs' split of the model."""

from __future__ import annotations

import pytest

from slackswap.errors import ConfigError
from slackswap.graph import Phase
from slackswap.parallel import ParallelConfig
from slackswap.pipeline_stages import in_flight_microbatches
from slackswap.schedule.build import keep_all_plan
from slackswap.simulate import simulate
from slackswap.simulate.pipeline import PipelineEvent, StageTimes, simulate_pipeline
from slackswap.simulate.pipeline_stage import stage_peak_bytes, stage_times
from slackswap.testing import bwd, fwd, make_graph, toy_hardware


def _ops(result, stage):
    return [(e.kind, e.microbatch, e.start_s, e.end_s) for e in result.stage_events(stage)]


def test_two_stage_1f1b_event_log_worked_by_hand():
    # Stage 0: forward 1, backward 2; stage 1: forward 3, backward 4; 3 micro-batches; a send takes 0.5.
    # Stage 0 runs F0 F1 B0 F2 B1 B2 (1 warm-up forward), stage 1 runs F0 B0 F1 B1 F2 B2.
    #   s0 F0 [0,1]   -> s1 F0 after the send [1,1.5]: [1.5,4.5]; s1 B0 [4.5,8.5]
    #   s0 F1 [1,2]   (sent [2,2.5])
    #   s0 B0 waits for s1 B0's gradient: sent [8.5,9], B0 [9,11]
    #   s1 F1: input at 2.5, stage free at 8.5 -> [8.5,11.5]; s1 B1 [11.5,15.5]
    #   s0 F2 [11,12] (sent [12,12.5]); s0 B1 gradient sent [15.5,16] -> [16,18]
    #   s1 F2 [15.5,18.5]; s1 B2 [18.5,22.5]; gradient [22.5,23]; s0 B2 [23,25]
    r = simulate_pipeline([StageTimes(1, 2), StageTimes(3, 4)], microbatches=3, p2p_s=0.5)
    assert _ops(r, 0) == [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 9, 11), ("F", 2, 11, 12),
                          ("B", 1, 16, 18), ("B", 2, 23, 25)]
    assert _ops(r, 1) == [("F", 0, 1.5, 4.5), ("B", 0, 4.5, 8.5), ("F", 1, 8.5, 11.5), ("B", 1, 11.5, 15.5),
                          ("F", 2, 15.5, 18.5), ("B", 2, 18.5, 22.5)]
    sends = [e for e in r.events if e.kind.startswith("send")]
    assert sends == [
        PipelineEvent(0, "send_F", 0, 1, 1.5), PipelineEvent(0, "send_F", 1, 2, 2.5),
        PipelineEvent(1, "send_B", 0, 8.5, 9), PipelineEvent(0, "send_F", 2, 12, 12.5),
        PipelineEvent(1, "send_B", 1, 15.5, 16), PipelineEvent(1, "send_B", 2, 22.5, 23),
    ]
    assert r.step_s == 25
    assert r.stage_busy_s == (9, 21)
    assert r.bubble_fraction == pytest.approx(1 - 30 / 50)


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 4), (4, 8), (4, 3), (8, 16)])
def test_equal_stages_follow_the_1f1b_formula(p, m):
    f, b = 1.25, 2.5
    r = simulate_pipeline([StageTimes(f, b)] * p, microbatches=m)
    assert r.step_s == pytest.approx((m + p - 1) * (f + b))
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert r.in_flight == tuple(in_flight_microbatches(i, p, m) for i in range(p))
    assert r.in_flight[0] == min(p, m) and r.in_flight[-1] == 1


def test_tail_and_hidden_copy_wait():
    # Stage 0's backward waits 1.5 for a prefetch before its first step: its idle time absorbs it.
    hidden = simulate_pipeline([StageTimes(1, 3, backward_hideable_s=1.5), StageTimes(1, 1)], microbatches=1)
    plain = simulate_pipeline([StageTimes(1, 1.5), StageTimes(1, 1)], microbatches=1)
    # F0 [0,1] on both, stage 1 B0 [2,3]; stage 0 idles [1,3] > 1.5, so its B0 runs [3, 4.5] either way
    assert hidden.step_s == plain.step_s == 4.5
    exposed = simulate_pipeline([StageTimes(1, 3, backward_hideable_s=1.5), StageTimes(0.1, 0.1)], microbatches=1)
    assert exposed.step_s == pytest.approx(1 + 0.1 + 0.1 + 3 - (1.2 - 1.0))  # only 0.2 idle to hide in
    tail = simulate_pipeline([StageTimes(1, 1, tail_s=0.25), StageTimes(1, 1, tail_s=2)], microbatches=2)
    assert tail.step_s == pytest.approx(max(6 + 0.25, 5 + 2))


def test_bad_pipeline_input_is_one_config_error():
    with pytest.raises(ConfigError, match="parallel.pipeline_schedule"):
        simulate_pipeline([StageTimes(1, 1)], 2, schedule="zero_bubble")
    with pytest.raises(ConfigError, match="stage.forward_s"):
        StageTimes(-1, 1)
    with pytest.raises(ConfigError, match="microbatches"):
        simulate_pipeline([StageTimes(1, 1)] * 2, 0)
    with pytest.raises(ConfigError, match="parallel.microbatches"):
        ParallelConfig(pp=1, microbatches=4)
    with pytest.raises(ConfigError, match="parallel.pipeline_schedule"):
        ParallelConfig(pp=2, pipeline_schedule="zero_bubble")


def test_stage_times_split_a_simulated_stage_graph_at_its_forward():
    # One stage by hand: f1 [0,1] f2 [1,3], loss [3,3.5], b2 [3.5,6], b1 [6,7]; nothing swapped.
    g = make_graph(
        [fwd("f1", (), ("a",), 1.0), fwd("f2", ("a",), ("b",), 2.0),
         fwd("loss", ("b",), ("l",), 0.5), bwd("b2", ("l", "a"), ("gb",), 2.5), bwd("b1", ("gb",), (), 1.0)],
        {"a": 10, "b": 20, "l": 1, "gb": 5},
    )
    g = g.__class__(g.name, tuple(op if op.name != "loss" else op.__class__(**{**op.__dict__, "phase": Phase.LOSS})
                                  for op in g.ops), g.tensors, g.num_layers)
    r = simulate(g, keep_all_plan(g), toy_hardware(), None)
    t = stage_times(g, r)
    assert (t.forward_s, t.backward_s, t.tail_s) == (3.5, 3.5, 0.0)
    # At the end of the forward it holds a (saved), and l (read by b2): b was freed after loss.
    assert stage_peak_bytes(g, r, 1) == r.peak_activation_bytes
    assert stage_peak_bytes(g, r, 3) == 2 * 11 + r.peak_activation_bytes


def _stage_graph(fwd_s: tuple[float, float], bwd_s: tuple[float, float], loss: bool):
    """A hand-made stage: two forward ops (the second the loss on the last stage), two backward ops."""
    specs = [fwd("a", (), ("x",), fwd_s[0]), fwd("b", ("x",), ("y",), fwd_s[1]),
             bwd("b.bwd", ("y", "x"), ("gx",), bwd_s[0]), bwd("a.bwd", ("gx",), (), bwd_s[1])]
    g = make_graph(specs, {"x": 4, "y": 2, "gx": 4})
    if loss:
        ops = tuple(op.__class__(**{**op.__dict__, "phase": Phase.LOSS}) if op.name == "b" else op for op in g.ops)
        g = g.__class__(g.name, ops, g.tensors, g.num_layers)
    return g


def test_two_stage_pipeline_of_hand_made_graphs_has_the_hand_worked_log():
    # The same pipeline as the first test, its op times now simulated from two stage graphs:
    # stage 0 forward 0.25 + 0.75 = 1, backward 1.5 + 0.5 = 2; stage 1 forward 1 + 2 = 3, backward 3 + 1 = 4.
    graphs = [_stage_graph((0.25, 0.75), (1.5, 0.5), loss=False), _stage_graph((1.0, 2.0), (3.0, 1.0), loss=True)]
    times = [stage_times(g, simulate(g, keep_all_plan(g), toy_hardware(), None)) for g in graphs]
    # ZB-H1's weight gradient: half of each backward GEMM (the ops are matmuls): 1 and 2
    assert times == [StageTimes(1.0, 2.0, weight_grad_s=1.0), StageTimes(3.0, 4.0, weight_grad_s=2.0)]
    r = simulate_pipeline(times, microbatches=3, p2p_s=0.5)  # 1F1B runs the backward whole
    assert _ops(r, 0) == [("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 9, 11), ("F", 2, 11, 12),
                          ("B", 1, 16, 18), ("B", 2, 23, 25)]
    assert _ops(r, 1)[-1] == ("B", 2, 18.5, 22.5) and r.step_s == 25
    # tests/test_pipeline_zero_bubble.py's hand-worked ZB-H1 log, from the same graphs
    zb = simulate_pipeline(times, microbatches=3, p2p_s=0.5, schedule="zb_h1")
    assert _ops(zb, 1)[-1] == ("W", 2, 20.5, 22.5) and zb.step_s == 22.5


def test_stage_graphs_split_the_model():
    from slackswap.hardware import load_preset
    from slackswap.memory.recipe import TrainingConfig
    from slackswap.model_config import ModelConfig
    from slackswap.profile import build_graph
    from slackswap.profile.stages import boundary_bytes, build_stage_graph

    m = ModelConfig(name="t", family="llama", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                    ffn_hidden_size=128, seq_len=32, micro_batch_size=2, vocab_size=128, dtype="bf16",
                    dropout=False, attention="flash", include_optimizer=True)
    hw, tr = load_preset("a100_80gb_pcie4"), TrainingConfig()
    whole = build_graph(m, hw, tr)
    stages = [build_stage_graph(m, hw, tr, ParallelConfig(pp=2, microbatches=4), i) for i in range(2)]
    assert [g.num_layers for g in stages] == [2, 2]
    def model_s(graphs):  # the optimizer's NO_LAYER group is two ops over the stages, each with its launch
        return sum(op.duration_s for g in graphs for op in g.ops if op.phase != Phase.OPTIMIZER)

    assert model_s(stages) == pytest.approx(model_s([whole]))
    assert sum(t.size_bytes for g in stages for t in g.saved_tensors) == sum(t.size_bytes for t in whole.saved_tensors)
    assert boundary_bytes(stages[0]) == 2 * 32 * 64 * 2 and boundary_bytes(stages[1]) == 0
    assert sum(g.meta["num_params"] for g in stages) == whole.meta["num_params"]  # llama: untied head
    with pytest.raises(ConfigError, match="parallel.pp"):
        build_stage_graph(m, hw, tr, ParallelConfig(pp=3, microbatches=4), 0)


def test_run_one_plans_each_stage_and_takes_the_pipelines_step():
    from slackswap.experiment.run import Verdict, run_one
    from slackswap.experiment.spec import RunSpec

    model = {"name": "t", "family": "llama", "num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
             "ffn_hidden_size": 128, "seq_len": 32, "micro_batch_size": 2, "vocab_size": 128, "dtype": "bf16",
             "dropout": False, "attention": "flash"}
    import yaml

    from slackswap.hardware import preset_dir

    hardware = yaml.safe_load((preset_dir() / "a100_80gb_pcie4.yaml").read_text())
    cfg = {"model": model, "hardware": hardware, "budget": {"fraction": 0.5}, "planner": {"name": "swap_only"},
           "parallel": {"pp": 2, "microbatches": 3}}
    out = run_one(RunSpec.from_dict(cfg))
    m = out.metrics
    assert out.verdict == Verdict.OK, out.reason
    assert m["pipeline_in_flight_by_stage"] == "2,1"
    peaks = [int(v) for v in m["pipeline_peak_bytes_by_stage"].split(",")]
    budgets = [int(v) for v in m["pipeline_budget_bytes_by_stage"].split(",")]
    assert all(p <= b for p, b in zip(peaks, budgets, strict=True))
    assert m["step_s"] >= m["ideal_step_s"] > 0 and m["bound_step_s"] is None
    assert m["tokens_per_step"] == 2 * 32 * 3 // 2
    with pytest.raises(ConfigError, match=r"^parallel.pp=3: does not divide model.num_layers=4"):
        RunSpec.from_dict(cfg | {"parallel": {"pp": 3, "microbatches": 3}})
