"""The torch profile source: traced saved bytes against a real CPU run, the formula, named errors.

Small configs of every family run for real on the CPU with `saved_tensors_hooks` counting each saved
storage once (slackswap.profile.torch.measure); the meta trace under CPU semantics must name the same
tensors with the same bytes. Under CUDA semantics the trace may differ only in the ops that
docs/torch_profile.md lists.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")

from slackswap.errors import ConfigError  # noqa: E402
from slackswap.formulas import korthikanti_saved_bytes_per_layer  # noqa: E402
from slackswap.hardware import Hardware  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402
from slackswap.profile.report import layer_profile  # noqa: E402
from slackswap.profile.torch import build_torch_graph, trace_model  # noqa: E402
from slackswap.profile.torch.spec import TorchSpec  # noqa: E402
from slackswap.profile.torch.tracer import TraceError, trace_step  # noqa: E402
from slackswap.profile.torch.verify import compare_saved  # noqa: E402
from slackswap.profile.torch.workloads import MissingDependencyError, build_workload  # noqa: E402

#: Ops whose saved tensors differ between CPU and CUDA kernels (docs/torch_profile.md, "ops that differ").
DOCUMENTED_DIFFERENCES = {
    "native_layer_norm", "empty_like", "native_dropout", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
}


CONF = Path(__file__).resolve().parents[1] / "conf"
HW = Hardware.from_dict(yaml.safe_load((CONF / "hardware" / "a100_80gb_pcie4.yaml").read_text()))


def small(family: str, **changes) -> ModelConfig:
    base = ModelConfig(name=f"small_{family}", family=family, num_layers=2, hidden_size=64, num_heads=4,
                       num_kv_heads=4, ffn_hidden_size=128, seq_len=16, micro_batch_size=2, vocab_size=96,
                       dropout=family != "llama")
    return replace(base, **changes)


def traced_saved(model: ModelConfig, spec: TorchSpec) -> dict[str, int]:
    trace, _ = trace_model(model, spec)
    return {trace.storages[k].name: trace.storages[k].size_bytes for k in trace.saved}


CASES = [
    ("hf_bert", small("bert"), "eager"),
    ("hf_gpt2", small("gpt2"), "eager"),
    ("hf_gpt2", small("gpt2"), "sdpa"),
    ("hf_llama", small("llama", num_kv_heads=2), "eager"),
    ("hf_llama", small("llama", num_kv_heads=2), "sdpa"),
    ("tiny_gpt", small("gpt2"), "eager"),
]


@pytest.mark.parametrize(("builder", "model", "attention"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_traced_saved_tensors_equal_a_real_cpu_run_tensor_by_tensor(builder, model, attention):
    spec = TorchSpec(builder, attention=attention, semantics="cpu")
    result = compare_saved(model, spec, "cpu")  # what pipelines.verify_torch runs on a GPU
    assert result.traced == result.real, result.summary()  # same identities, same bytes, storage by storage
    assert result.equal and len(result.real) > 10 * model.num_layers
    graph = build_torch_graph(model, spec, HW)
    assert {t.name: t.size_bytes for t in graph.saved_tensors} == result.traced  # graph 'saved' = autograd's


@pytest.mark.parametrize(("builder", "model", "attention"), CASES[:3] + CASES[4:5], ids=[
    f"{c[0]}-{c[2]}" for c in CASES[:3] + CASES[4:5]])
def test_cuda_semantics_differ_from_cpu_only_in_documented_ops(builder, model, attention):
    graphs = {sem: build_torch_graph(model, TorchSpec(builder, attention=attention, semantics=sem), HW)
              for sem in ("cpu", "cuda")}
    saved = {sem: {t.name: t.size_bytes for t in g.saved_tensors} for sem, g in graphs.items()}
    cpu, cuda = saved["cpu"], saved["cuda"]
    differing = {name for name in cpu.keys() | cuda.keys() if cpu.get(name) != cuda.get(name)}
    dropout_calls = {n.split("/")[0] for n in differing if "/empty_like#" in n or "/native_dropout#" in n}
    # Module calls that ran a fused attention kernel on either side: the kernel choice differs there as a
    # whole (CPU takes the math decomposition when attention dropout is on, CUDA takes flash), and so do
    # the saved inputs it reads (q, k, v).
    attention_calls = {n.split("/")[0] for n in cpu.keys() | cuda.keys() if "/_scaled_dot_product_" in n}

    def read_by_attention(name: str) -> bool:
        return any(name in g.tensors and any(c.split(":")[1] in attention_calls for c in g.tensors[name].consumers)
                   for g in graphs.values())

    for name in differing:
        module_call, op = name.split("/", 1)[0], name.split("/", 1)[1].split("#", 1)[0]
        # The CPU dropout's output is a `mul` in the same module call as its noise (renamed, same bytes).
        assert (op in DOCUMENTED_DIFFERENCES or module_call in attention_calls or read_by_attention(name)
                or (op == "mul" and module_call in dropout_calls)), name
    if model.dropout:  # CUDA keeps 1-byte bool masks where the CPU keeps noise of the input's dtype
        assert any("/native_dropout#" in n for n in cuda)
        assert not any("/empty_like#" in n for n in cuda)


def test_a_model_built_like_the_formula_equals_it_per_layer():
    """TinyGPT's layer is Korthikanti's; the traced layer = sbh(34 + 5as/h) + LayerNorm statistics."""
    model = small("gpt2", hidden_size=64, num_heads=4, ffn_hidden_size=256, seq_len=32)
    hw = HW
    graph = build_torch_graph(model, TorchSpec("tiny_gpt", semantics="cuda"), hw)
    analytic = layer_profile(build_graph(model, hw))
    s, b, h, a = model.seq_len, model.micro_batch_size, model.hidden_size, model.num_heads
    ln_stats = 2 * 2 * s * b * 4  # two LayerNorms, mean and rstd, fp32 per token (not in the formula)
    for row, ref in zip(layer_profile(graph), analytic, strict=True):
        assert row.saved_bytes - ln_stats == korthikanti_saved_bytes_per_layer(s, b, h, a) == ref.saved_bytes
        assert row.fwd_flops == pytest.approx(ref.fwd_flops)  # 24bsh^2 + 4bs^2h from flop_counter


def test_user_hook_traces_like_the_builtin_model():
    model = small("gpt2")
    hook = traced_saved(model, TorchSpec("hook", hook="slackswap.profile.torch.tiny:tiny_workload"))
    builtin = traced_saved(model, TorchSpec("tiny_gpt"))
    assert hook == builtin


def test_named_errors():
    model = small("gpt2")
    net, inputs, loss_fn = build_workload(model, TorchSpec("tiny_gpt"), "meta")

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    with pytest.raises(TraceError, match="forward raised ValueError: boom"):
        trace_step(Broken(), inputs, loss_fn)
    with pytest.raises(TraceError, match="loss must be a scalar"):
        trace_step(net, inputs, lambda logits: logits.float().sum(-1))
    with pytest.raises(ConfigError, match="model.torch.attention.*flash2"):
        TorchSpec("hf_gpt2", attention="flash2")
    with pytest.raises(ConfigError, match="model.torch.hook"):
        build_workload(model, TorchSpec("hook", hook="no_such_module:f"))


def test_missing_transformers_is_a_named_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependencyError, match="transformers.*pip install"):
        build_workload(small("gpt2"), TorchSpec("hf_gpt2"))


def test_core_imports_and_runs_without_torch():
    code = """
import sys
sys.modules['torch'] = None; sys.modules['transformers'] = None
from slackswap.profile import build_graph
from slackswap.profile.torch import TorchSpec
from slackswap.simulate.metrics import simulate_ideal
from slackswap.planners.registry import get_planner
import yaml
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
hw = Hardware.from_dict(yaml.safe_load(open('conf/hardware/a100_80gb_pcie4.yaml')))
tiny = ModelConfig.from_dict(yaml.safe_load(open('conf/model/tiny.yaml')))
g = build_graph(tiny, hw)
assert simulate_ideal(g, hw).feasible
TorchSpec('hf_llama', attention='sdpa')
try:
    from slackswap.profile.torch import build_torch_graph
    build_torch_graph(tiny, TorchSpec('tiny_gpt'), hw)
except Exception as exc:
    assert type(exc).__name__ == 'MissingDependencyError', exc
else:
    raise AssertionError('no error without torch')
print('ok')
"""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=root,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_optimizer_step_ops_follow_the_traced_parameters():
    from slackswap.graph import Phase
    from slackswap.memory.static import optimizer_step_bytes_per_param
    from slackswap.profile import default_training

    model = small("gpt2", include_optimizer=True)
    graph = build_torch_graph(model, TorchSpec("tiny_gpt"), HW)
    opt = [op for op in graph.ops if op.phase == Phase.OPTIMIZER]
    assert [op.layer for op in opt] == [0, 1, -1] and graph.ops[-len(opt):] == tuple(opt)
    per_param = optimizer_step_bytes_per_param(default_training("bf16"), "bf16")
    assert sum(op.moved_bytes for op in opt) == per_param * graph.meta["num_params"]
    net = build_workload(model, TorchSpec("tiny_gpt"))[0]
    assert graph.meta["num_params"] == sum(p.numel() for p in net.parameters())
    # A traced graph depends on the torch and transformers code that ran: graph.json names both.
    import torch
    import transformers

    from slackswap.graph_io import graph_from_dict, graph_to_dict

    versions = graph_from_dict(graph_to_dict(graph)).meta["versions"]
    assert versions["torch"] == torch.__version__ and versions["transformers"] == transformers.__version__


def test_random_ops_and_in_place_writes_are_marked():
    cuda, _ = trace_model(small("gpt2"), TorchSpec("hf_gpt2", attention="sdpa", semantics="cuda"))
    random = {op.aten for op in cuda.ops if op.random}
    assert random == {"native_dropout", "_scaled_dot_product_flash_attention"}  # attention dropout 0.1: random
    assert not any(op.writes for op in cuda.ops)  # the CUDA kernels write nothing in place here
    cpu, _ = trace_model(small("gpt2"), TorchSpec("hf_gpt2", semantics="cpu"))
    written = {op.aten for op in cpu.ops if op.writes}
    assert written == {"bernoulli_", "div_"}  # the CPU dropout fills and scales its noise in place
    assert all(set(op.writes) <= set(op.reads) for op in cpu.ops)


def test_an_analytic_preset_traces_with_its_family_class():
    from slackswap.profile.torch import profile_source, spec_for_family

    model = small("llama", attention="flash")
    assert spec_for_family(model) == TorchSpec("hf_llama", attention="sdpa")
    graph = profile_source(model, HW, semantics="cpu")
    assert graph.meta["torch"]["builder"] == "hf_llama" and graph.meta["semantics"] == "cpu"
    with pytest.raises(ConfigError, match="model.torch.attention"):
        profile_source(model, HW, attention="flash")


def test_graph_marks_random_ops_in_place_versions_and_the_attention_core():
    cpu = build_torch_graph(small("gpt2"), TorchSpec("hf_gpt2", semantics="cpu"), HW)
    writers = [op for op in cpu.ops if op.writes]
    assert {op.name.rsplit(":", 1)[1] for op in writers} == {"bernoulli_", "div_"}  # the CPU dropout noise
    for op in writers:  # each write outputs the next version, an alias of the written one
        assert [cpu.tensors[o].base for o in op.outputs] == list(op.writes)
    noise = [t for t in cpu.saved_tensors if "/empty_like#" in t.name]
    assert noise and all(t.base and t.producer.endswith(":div_") for t in noise)  # the scaled noise is saved
    cuda = build_torch_graph(small("gpt2"), TorchSpec("hf_gpt2", semantics="cuda"), HW)
    assert {op.role for op in cuda.ops if op.random} >= {"native_dropout", "softmax_dropout"}
    assert {op.role for op in cuda.ops if op.attention_core} == {"qk_bmm", "softmax", "softmax_dropout", "attn_core",
                                                                   "pv_bmm"}


def test_the_fast_leaves_are_pytrees_leaves_in_pytrees_order() -> None:
    """`identity.leaves` (the dispatch modes' flattening) against `tree_leaves`: the same objects in the
    same order on what an ATen call takes and returns (nested lists, kwargs, torch.Size, a structseq
    result) and on the nodes it hands to pytree (a namedtuple, OrderedDict, defaultdict), and a node
    type registered after a first call is a node from then on."""
    import collections

    from torch.utils._pytree import register_pytree_node, tree_leaves

    from slackswap.profile.torch.identity import leaves

    t = torch.ones(2)
    pair = collections.namedtuple("pair", "a b")
    cases = [((t, 1, None, [t, t], 2.0, torch.float32), {"dim": 1, "out": t}), (t, torch.Size([2, 3]), pair(t, [t])),
             {"b": [t, {"z": 2, "y": (3,)}], "a": pair(1, 2)}, collections.OrderedDict(b=t, a=1),
             collections.defaultdict(int, x=t), [torch.max(torch.ones(3, 2), 1), 5], ((), [[]], {}), "ab",
             (torch.device("cpu"), torch.strided, torch.contiguous_format)]
    for case in cases:
        expected = tree_leaves(case)
        got = leaves(case)
        assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected, strict=True)), (case, got)

    class Box:
        def __init__(self, *items: object) -> None:
            self.items = items

    box = Box(t, 3)
    assert leaves([box]) == [box]  # a leaf while unregistered
    register_pytree_node(Box, lambda b: (list(b.items), None), lambda items, _: Box(*items))
    try:
        assert leaves([box, 4]) == tree_leaves([box, 4]) == [t, 3, 4]
    finally:
        from torch.utils._pytree import _deregister_pytree_node

        _deregister_pytree_node(Box)
