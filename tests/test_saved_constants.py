"""Constants made from Python data in forward are graph tensors (issue 39: "Falcon's
`fused_qkv[..., [-2], :]` saves four int64 constants no identity names, kept without the check the
docs promise").

Indexing with a Python list makes an int64 index tensor outside the dispatcher; `aten.index` saves
it for backward. Before, neither the capture nor the meta tracer named it: the runtime kept it as if
it were a weight, and no graph counted its bytes. Now the identities name it after the `lift_fresh`
call that brings it into the dispatcher (on meta, where no call reaches the mode, at its pack), the
graph prices it, the ledger counts it, and the replay rule keeps it (a replay would return the very
tensor it was to free).
"""

from __future__ import annotations

import copy

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")

nn = torch.nn

from slackswap.plan import Decision  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.profile.torch.tracer import trace_step  # noqa: E402
from slackswap.runtime import apply, capture_graph  # noqa: E402
from slackswap.simulate.saved_peak import simulated_saved_peak_bytes  # noqa: E402
from tests.runtime_support import h200  # noqa: E402

D, SEQ, BATCH = 16, 8, 2


class _Pick(nn.Module):
    """Falcon's multi-query split in small: key and value picked from a fused projection by a list index."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.qkv(x).view(*x.shape[:-1], 3, D)
        k, v = fused[..., [-2], :], fused[..., [-1], :]
        return x + (k * v).squeeze(-2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Pick() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _step(model: nn.Module, x: torch.Tensor, context=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    with context if context is not None else _Null():
        loss = _loss(model(x))
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _constants(names) -> list[str]:
    return sorted(n for n in names if "/lift_fresh#" in n)


def test_a_list_index_saved_by_autograd_is_a_named_graph_tensor_with_its_bytes() -> None:
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(BATCH, SEQ, D)
    graph = capture_graph(copy.deepcopy(net), (x,), _loss, h200(), "pick")
    saved = {t.name: t for t in graph.saved_tensors}
    constants = _constants(saved)
    assert constants == [f"layers.{i}/lift_fresh#{k}:0" for i in range(2) for k in range(2)]
    assert all(saved[n].size_bytes == 8 and saved[n].role == "int64" for n in constants)
    assert [saved[n].layer for n in constants] == [0, 0, 1, 1]
    # the meta tracer names the same tensors (no call reaches its mode there: named at the pack)
    meta_net = copy.deepcopy(net).to("meta")
    trace = trace_step(meta_net, (x.to("meta"),), _loss, semantics="cpu", dtype="fp32")
    traced = {trace.storages[k].name: trace.storages[k].size_bytes for k in trace.saved}
    assert traced == {t.name: t.size_bytes for t in graph.saved_tensors}


@pytest.mark.parametrize("planner", ["keep_all", "full_recompute"])
def test_the_constants_are_kept_by_plan_counted_by_the_ledger_and_gradients_stay_exact(planner: str) -> None:
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(BATCH, SEQ, D)
    graph = capture_graph(copy.deepcopy(net), (x,), _loss, h200(), "pick")
    constants = _constants(t.name for t in graph.saved_tensors)
    plan = get_planner(planner).plan(graph, h200(), None)  # full_recompute recomputes without a budget too
    assert all(plan.decisions[n] == Decision.KEEP for n in constants)
    if planner == "full_recompute":
        assert any(d == Decision.RECOMPUTE for d in plan.decisions.values())
        assert set(constants) <= set(plan.notes["not_recomputable"])
        assert "Python data" in plan.notes["not_recomputable"][constants[0]]
    reference = _step(copy.deepcopy(net), x)
    model = copy.deepcopy(net)
    run = apply(plan, graph, model)
    loss, grads = _step(model, x, run)
    assert torch.equal(loss, reference[0]) and all(torch.equal(a, b) for a, b in zip(grads, reference[1], strict=True))
    assert run.report.ledger_peak_bytes == simulated_saved_peak_bytes(graph, plan, h200())
    assert run.report.ledger_peak_bytes >= 32  # the four 8-byte index tensors are in it


@pytest.mark.slow
def test_falcon_saves_its_four_index_constants_named_traced_and_run_exact() -> None:
    """HF Falcon from its config class (2 layers, width 64, sequence 128, micro-batch 4, fp32)."""
    require_torch_extra("transformers")
    import transformers

    from slackswap.model_config import ModelConfig
    from slackswap.profile.torch.spec import TorchSpec
    from slackswap.profile.torch.verify import compare_saved
    from slackswap.runtime.training_workload import token_loss
    from slackswap.runtime.zoo import _Logits

    shape = ModelConfig(name="falcon", family="gpt2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4,
                        ffn_hidden_size=256, seq_len=128, micro_batch_size=4, vocab_size=64, dtype="fp32",
                        dropout=False)
    comparison = compare_saved(shape, TorchSpec(builder="hf", config_class="FalconConfig", attention="eager"), "cpu")
    assert comparison.equal, comparison.summary()
    constants = _constants(comparison.real)
    assert constants == [f"transformer.h.{i}.self_attention/lift_fresh#{k}:0" for i in range(2) for k in range(2)]
    assert all(comparison.real[n] == 8 for n in constants)

    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    pad_token_id=0, bos_token_id=0, eos_token_id=0)
    cfg.use_cache = False
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").train()
    batch = torch.randint(0, 64, (4, 128), generator=torch.Generator().manual_seed(0))
    net, loss_fn = _Logits(hf, lambda m, x: m(input_ids=x).logits), token_loss(batch)
    graph = capture_graph(copy.deepcopy(net), (batch,), loss_fn, h200(), "falcon")
    saved = {t.name: t for t in graph.saved_tensors}
    assert len(_constants(saved)) == 4 and sum(saved[n].size_bytes for n in _constants(saved)) == 32
    plan = get_planner("full_recompute").plan(graph, h200(), None)
    assert set(_constants(saved)) <= set(plan.notes["not_recomputable"])
    assert sum(d == Decision.RECOMPUTE for d in plan.decisions.values()) > 10

    def step(model: nn.Module, context=None):
        torch.manual_seed(1)
        for p in model.parameters():
            p.grad = None
        with context if context is not None else _Null():
            loss = loss_fn(model(batch))
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    reference = step(copy.deepcopy(net))
    model = copy.deepcopy(net)
    run = apply(plan, graph, model)
    loss, grads = step(model, run)
    assert torch.equal(loss, reference[0]) and all(torch.equal(a, b) for a, b in zip(grads, reference[1], strict=True))
    assert run.report.ledger_peak_bytes == simulated_saved_peak_bytes(graph, plan, h200())
