"""torch_sac and torch_budget against the PyTorch mechanisms they model, run for real on the CPU.

- torch_sac: every layer of a small HF GPT-2 / Llama wrapped in non-reentrant
  `torch.utils.checkpoint.checkpoint` with a selective-checkpointing policy; the storages alive when
  the loss is computed are what the step keeps for backward. The plan's kept storages must be the
  same multiset of (op, dtype, bytes), up to the one difference docs/planners.md names.
- torch_budget: `torch.compile` (inductor) under `activation_memory_budget`; the saved values are read
  off the partition. On a stack of Linear-ReLU-Linear residual blocks, where torch's decomposed graph
  and the traced graph have the same ops, the saved bytes must be equal at 0.3 / 0.5 / 0.7 (and 1).
- the side finding: with `aot_eager_decomp_partition` at a budget of 0.5 or less the partition
  recomputes dropout's random mask in backward with a fresh draw, so the gradients are wrong.
- plans that keep checkpoint candidates run for real under the runtime, bit for bit.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.graph import Graph  # noqa: E402
from slackswap.hardware import Hardware  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.plan import Decision  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.planners.strategies.torch_budget import torch_budget_saved  # noqa: E402
from slackswap.profile.torch import build_torch_graph  # noqa: E402
from slackswap.profile.torch.assemble import graph_from_trace  # noqa: E402
from slackswap.profile.torch.layer_stacks import find_layer_stacks  # noqa: E402
from slackswap.profile.torch.mechanisms import (  # noqa: E402
    checkpointed_layers,
    compiled_saved,
    inductor_partition,
    resident_after_forward,
)
from slackswap.profile.torch.spec import TorchSpec  # noqa: E402
from slackswap.profile.torch.tracer import ATTENTION_OPS, MATMUL_OPS, trace_step  # noqa: E402
from slackswap.profile.torch.workloads import build_workload  # noqa: E402

HW = Hardware.from_dict(yaml.safe_load(
    (Path(__file__).resolve().parents[1] / "conf/hardware/a100_80gb_pcie4.yaml").read_text()))
#: The aten names each torch_sac policy marks MUST_SAVE in the real SAC policy function.
POLICY_OPS = {"matmuls": MATMUL_OPS | ATTENTION_OPS, "matmuls_except_attention_core": MATMUL_OPS}
SEQ = 32


def small(family: str) -> tuple[ModelConfig, TorchSpec]:
    model = ModelConfig(name=f"small_{family}", family=family, num_layers=2, hidden_size=64, num_heads=4,
                        num_kv_heads=4, ffn_hidden_size=128, seq_len=SEQ, micro_batch_size=2, vocab_size=96,
                        dropout=family != "llama", dtype="fp32")
    return model, TorchSpec(builder=f"hf_{family}", attention="eager", semantics="cpu")


def kept_storages(graph: Graph, decisions) -> Counter:
    roots = {graph.storage_root(t) for t, d in decisions.items() if d == Decision.KEEP}
    return Counter((graph.tensors[r].role, graph.tensors[r].size_bytes) for r in roots)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", sorted(POLICY_OPS))
def test_torch_sac_keeps_what_selective_checkpointing_keeps(family: str, policy: str) -> None:
    model, spec = small(family)
    graph = build_torch_graph(model, spec, HW)
    plan = get_planner("torch_sac", policy=policy).plan(graph, HW, None)
    assert plan.notes["kept_candidates"] > 0  # SAC keeps matmul outputs autograd never saves
    torch.manual_seed(0)
    net, inputs, loss_fn = build_workload(model, spec, "cpu")
    layers = find_layer_stacks(net).modules(net)
    with checkpointed_layers(layers, frozenset(POLICY_OPS[policy])):
        resident, loss = resident_after_forward(lambda: loss_fn(net(*inputs)), [*net.parameters(), *inputs])
        loss.backward()
    real = Counter((f"{r.aten}:{r.dtype}", r.size_bytes) for r in resident)
    ours = kept_storages(graph, plan.decisions)
    assert ours - real == Counter()
    # The one difference (docs/planners.md): checkpoint holds every tensor argument of a layer; HF Llama
    # passes its int64 position ids [1, s] to each layer, and no op of the layer reads them.
    assert real - ours == (Counter({("add:int64", 8 * SEQ): 1}) if family == "llama" else Counter())


class _Block(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Stack(torch.nn.Module):
    def __init__(self, layers: int = 4, hidden: int = 64, ffn: int = 256):
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        self.layers = torch.nn.ModuleList(_Block(hidden, ffn) for _ in range(layers))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _stack(device: str):
    torch.manual_seed(0)
    with torch.device(device):
        return _Stack(), torch.randn(128, 64)


@pytest.mark.slow
def test_torch_budget_saves_the_bytes_torch_compile_saves() -> None:
    """At each budget the bytes inductor's partition saves (read through `inductor_partition`: inductor's
    compile up to its partition, no C++; the next test shows it saves what inductor's full compile saves)."""
    net, x = _stack("meta")
    graph = graph_from_trace(trace_step(net, (x,), lambda y: (y * y).sum(), semantics="cpu", dtype="fp32"), HW, "mlp")
    net, x = _stack("cpu")
    seen = []
    for fraction in (1.0, 0.7, 0.5, 0.3):
        saved, _ = torch_budget_saved(graph, fraction)
        real, loss = compiled_saved(lambda: (net(x) ** 2).sum(), fraction, inductor_partition)
        loss.backward()
        ours_bytes = sum(graph.tensors[t].size_bytes for t in saved)
        assert ours_bytes == sum(v.size_bytes for v in real), fraction
        seen.append(ours_bytes)
    assert seen == sorted(seen, reverse=True) and len(set(seen)) == 4  # four different partitions


@pytest.mark.slow
def test_inductor_partition_saves_what_inductors_compile_saves() -> None:
    """`inductor_partition` (inductor's compile without code generation) and inductor itself save the same
    values, node for node, at a budget where the partitioner recomputes (the test above: fewer bytes at 0.5
    than at 1.0), and compute the same loss."""
    net, x = _stack("cpu")
    got = {}
    for backend in ("inductor", inductor_partition):
        saved, loss = compiled_saved(lambda: (net(x) ** 2).sum(), 0.5, backend)
        loss.backward()
        got[backend] = (saved, loss.detach())
    (full, full_loss), (partition, partition_loss) = got.values()
    assert full and full == partition
    torch.testing.assert_close(full_loss, partition_loss)


class _Dropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.nn.functional.dropout(torch.relu(layer(x)), 0.5, training=True)
        return x


def _compiled_step(budget: float, backend: str):
    torch.manual_seed(0)
    net, x = _Dropout(), torch.randn(16, 32)
    torch.manual_seed(1)
    saved, loss = compiled_saved(lambda: (net(x) ** 2).sum(), budget, backend)
    loss.backward()
    return loss.detach(), [p.grad for p in net.parameters()], {v.target for v in saved}


@pytest.mark.slow
def test_aot_eager_decomp_partition_redraws_dropout_masks_at_budget_half_or_less() -> None:
    """At 1.0 the mask (gt of rand) is saved and backward uses the forward's mask. At 0.5 and 0.3 it
    is not saved: backward draws a new one, so the loss is the same and the gradients are not."""
    loss, grads, saved = _compiled_step(1.0, "aot_eager_decomp_partition")
    assert "gt.Scalar" in saved
    for budget in (0.5, 0.3):
        loss_b, grads_b, saved_b = _compiled_step(budget, "aot_eager_decomp_partition")
        assert torch.equal(loss, loss_b)  # the same forward draws
        assert "gt.Scalar" not in saved_b
        worst = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(grads, grads_b, strict=True))
        assert worst > 0.1, budget  # not rounding: a different mask


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_plans_that_keep_checkpoint_candidates_run_bit_exact(kind: str) -> None:
    from tests.runtime_support import bit_equal, capture, h200, run_step

    c = capture(kind)
    for planner in ("torch_sac", "full_recompute"):
        plan = get_planner(planner).plan(c.graph, h200(), None)
        kept = [t for t, d in plan.decisions.items() if t in c.graph.candidate_names]
        assert kept, planner
        loss, grads, report = run_step(c.workload, plan, c.graph)
        assert bit_equal(c.reference, loss, grads), planner


def _preset_graph(name: str) -> Graph:
    conf = Path(__file__).resolve().parents[1] / "conf" / "model"
    hf = yaml.safe_load((conf / f"{name}.yaml").read_text())
    data = {**yaml.safe_load((conf / f"{hf.pop('defaults')[0]}.yaml").read_text()), **hf}
    data.pop("source", None)
    spec = TorchSpec.from_dict(data.pop("torch"))
    return build_torch_graph(ModelConfig.from_dict(data), spec, HW)


@pytest.mark.slow
def test_full_recompute_on_hf_llama7b_at_half_keeps_one_residual_stream_tensor_per_layer() -> None:
    """HF Llama's layer input (the residual stream) is not saved by autograd: its RMSNorm saves a
    float32 copy. full_recompute keeps it as a checkpoint candidate, the input of every layer once."""
    from slackswap.simulate.metrics import simulate_ideal

    graph = _preset_graph("hf_llama7b")
    budget = simulate_ideal(graph, HW).peak_activation_bytes // 2
    plan = get_planner("full_recompute").plan(graph, HW, budget)  # feasible: no InfeasibleBudgetError
    ops = graph.op_by_name
    fed = Counter()
    for t in plan.decisions:
        if t in graph.candidate_names:
            layers = {ops[c].layer for c in graph.tensors[t].consumers} - {ops[graph.tensors[t].producer].layer, -1}
            assert len(layers) == 1, t
            fed[layers.pop()] += 1
    assert fed == Counter(range(graph.num_layers))
