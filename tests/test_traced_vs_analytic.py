"""Traced and analytic graphs of one model priced alike (docs/profile.md, "Traced against analytic").

The calibrated presets were fitted on analytic graphs, whose elementwise ops are fused kernels. A
traced graph priced with `kernels: fused` must meet the analytic one on a calibrated preset; its GEMM
and attention FLOPs must equal the analytic ones exactly; `eager` keeps every aten call a kernel.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers.models.llama.modeling_llama")  # at collection, not in the first test

from slackswap.errors import ConfigError  # noqa: E402
from slackswap.graph import OpClass, Phase  # noqa: E402
from slackswap.hardware import load_preset  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402
from slackswap.profile.torch import build_torch_graph, trace_model  # noqa: E402
from slackswap.profile.torch.assemble import graph_from_trace, traced_attention_kernel  # noqa: E402
from slackswap.profile.torch.fusion import fused_groups, fused_traffic  # noqa: E402
from slackswap.profile.torch.identity import addressed_bytes  # noqa: E402
from slackswap.profile.torch.spec import TorchSpec  # noqa: E402
from slackswap.profile.torch.tracer import Trace, TracedOp, TracedStorage  # noqa: E402

#: Llama-7B's layer, 2 of them: wide and long enough that HBM and FLOPs, not launch gaps, set the op times (tracing
#: on meta costs the same at any width).
LLAMA = ModelConfig(name="llama_2l", family="llama", num_layers=2, hidden_size=4096, num_heads=32, num_kv_heads=32,
                    ffn_hidden_size=11008, seq_len=2048, micro_batch_size=1, vocab_size=8192, dropout=False,
                    attention="flash")
SPEC = TorchSpec("hf_llama", attention="sdpa")
#: Fused traced step / analytic step on a calibrated preset (1.026 on the A100, 1.041 on the H100):
#: what stays apart is traffic HF's autograd really saves (the fp32 RMSNorm copy, the SiLU output) and
#: dgrad / wgrad as two GEMMs.
TOLERANCE = 0.05


def _class_flops(graph, op_class):
    return sum(op.flops for op in graph.ops if op.op_class == op_class)


@pytest.mark.parametrize("preset", ["a100_80gb_sxm_calibrated", "h100_sxm_calibrated"])
def test_fused_traced_llama_meets_the_analytic_step_on_a_calibrated_preset(preset):
    hw = load_preset(preset)
    trace, _ = trace_model(LLAMA, SPEC)
    analytic = build_graph(LLAMA, hw)
    fused = graph_from_trace(trace, hw, "t", kernels="fused")
    eager = graph_from_trace(trace, hw, "t")
    a_step, f_step, e_step = (sum(op.duration_s for op in g.ops) for g in (analytic, fused, eager))
    assert abs(f_step / a_step - 1) < TOLERANCE
    assert e_step > f_step * 1.15  # eager HF runs ~8 kernels per RMSNorm: real traffic, kept apart
    for op_class in (OpClass.MATMUL, OpClass.ATTENTION):
        assert _class_flops(fused, op_class) == _class_flops(analytic, op_class) > 0
    # fusion changes elementwise bytes only, and never adds any
    for f_op, e_op in zip(fused.ops, eager.ops, strict=True):
        assert f_op.moved_bytes <= e_op.moved_bytes
        if f_op.op_class != OpClass.ELEMENTWISE:
            assert (f_op.moved_bytes, f_op.duration_s) == (e_op.moved_bytes, e_op.duration_s)


def test_the_spec_chooses_the_kernel_mode_and_the_trace_is_shared():
    hw = load_preset("a100_80gb_sxm_calibrated")
    eager = build_torch_graph(LLAMA, SPEC, hw)
    fused = build_torch_graph(LLAMA, replace(SPEC, kernels="fused"), hw)
    assert eager.meta["torch"]["kernels"] == "eager" and fused.meta["torch"]["kernels"] == "fused"
    assert [t.size_bytes for t in eager.tensors.values()] == [t.size_bytes for t in fused.tensors.values()]
    assert sum(op.duration_s for op in fused.ops) < sum(op.duration_s for op in eager.ops)
    with pytest.raises(ConfigError, match="model.torch.kernels"):
        TorchSpec("hf_llama", kernels="compiled")
    with pytest.raises(ConfigError, match="model.torch.kernels"):
        graph_from_trace(trace_model(LLAMA, SPEC)[0], hw, "t", kernels="compiled")


def _op(index, reads=(), creates=(), moved=0, op_class=OpClass.ELEMENTWISE, phase=Phase.FORWARD):
    return TracedOp(index, "mm" if op_class == OpClass.MATMUL else "mul", phase, "m", 0, op_class,
                    tuple(reads), tuple(creates), 0.0, moved)


def _trace(ops, sizes, saved=()):
    storages = {k: TracedStorage(k, f"s{k}", size, 0, "bfloat16", (size // 2,)) for k, size in sizes.items()}
    return Trace(tuple(ops), storages, frozenset(saved), frozenset(), 1, (), 0, 0, "cuda", "bf16", {})


def test_fusion_keeps_inputs_saved_and_escaping_outputs_and_drops_the_rest():
    # x(0) -> a: t1 -> b: t2 (saved) -> c: t3 -> GEMM reads t3; c also re-reads x
    ops = [_op(0, (0,), (1,), 200), _op(1, (1,), (2,), 200), _op(2, (2, 0), (3,), 300),
           _op(3, (3,), (4,), 1000, OpClass.MATMUL)]
    trace = _trace(ops, {0: 100, 1: 100, 2: 100, 3: 100, 4: 100}, saved={2})
    assert fused_groups(trace) == [[0, 1, 2]]
    fused = fused_traffic(trace)
    # a reads x; t1 is internal (no write); b writes saved t2; c reads t2 and x from registers, writes t3
    assert fused.moved_bytes == {0: 100, 1: 100, 2: 100, 3: 1000}
    assert fused.launches == {0: True, 1: False, 2: False, 3: True}


def test_a_gemm_that_reads_the_run_ends_it_and_one_that_does_not_is_hoisted():
    ops = [_op(0, (0,), (1,), 200), _op(1, (0,), (2,), 1000, OpClass.MATMUL), _op(2, (1, 2), (3,), 300),
           _op(3, (3,), (4,), 1000, OpClass.MATMUL), _op(4, (4,), (5,), 200),
           _op(5, (5,), (6,), 200, phase=Phase.BACKWARD)]
    trace = _trace(ops, dict.fromkeys(range(7), 100))
    assert fused_groups(trace) == [[0, 2], [4], [5]]


def test_a_broadcast_view_moves_its_distinct_elements():
    small = torch.empty(4, 1, dtype=torch.float32, device="meta")
    assert addressed_bytes(small.expand(4, 1024)) == 16
    assert addressed_bytes(torch.empty(4, 1024, dtype=torch.bfloat16, device="meta")) == 8192
    assert addressed_bytes(torch.empty(8, 8, device="meta").t()) == 256


@pytest.mark.parametrize(("aten", "configured", "kernel"), [
    ("bmm", "", ""), ("bmm", "eager", "eager"), ("bmm", "flash2", "eager"), ("bmm_backward", "flash3", "eager"),
    ("_scaled_dot_product_flash_attention", "flash3", "flash3"),
    ("_scaled_dot_product_flash_attention_backward", "", ""),
    ("_scaled_dot_product_efficient_attention", "eager", ""),
])
def test_traced_attention_follows_the_model_kernel_when_the_trace_runs_that_kind(aten, configured, kernel):
    assert traced_attention_kernel(aten, configured) == kernel
