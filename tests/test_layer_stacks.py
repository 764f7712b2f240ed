"""One layer rule for the tracer, the capture and the export (issue 39: "layer detection differs
between tracer and runtime and fits no encoder-decoder").

Before: the tracer took the `nn.ModuleList` with the most children, the capture and the export the
first one. On the zoo's T5 the tracer's layers were the three sub-layers of decoder block 0
(`model.decoder.block.0.layer`) and the runtime's the encoder blocks only. Now both read
`slackswap.profile.torch.layer_stacks.find_layer_stacks`: T5's encoder blocks are layers 0 and 1, its
decoder blocks 2 and 3; each storage the step creates in forward gets the same layer from the meta
tracer and from the real capture.
"""

from __future__ import annotations

import copy

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

nn = torch.nn

from slackswap.graph import NO_LAYER, Phase  # noqa: E402
from slackswap.profile.torch.layer_stacks import find_layer_stacks  # noqa: E402
from slackswap.profile.torch.tracer import trace_step  # noqa: E402
from slackswap.runtime.capture import capture_graph  # noqa: E402
from slackswap.runtime.export_facts import layer_paths  # noqa: E402
from slackswap.runtime.training_workload import Workload  # noqa: E402
from slackswap.runtime.zoo import build  # noqa: E402
from tests.runtime_support import deterministic_kernels, h200  # noqa: E402, F401 (a fixture)


class _Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def _sequential(seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    net = nn.Sequential(*(_Block() for _ in range(3)))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    return Workload("sequential", net, x, lambda out: out.square().mean(), 0)


def _workload(name: str) -> Workload:
    return _sequential() if name == "sequential" else build(name)


def _forward_layers_traced(w: Workload) -> tuple[dict[str, int], tuple[str, ...], int]:
    trace = trace_step(copy.deepcopy(w.model), (w.batch,), w.loss_fn, semantics="cpu", dtype="fp32")
    layers = {s.name: trace.ops[s.producer].layer for s in trace.storages.values()
              if trace.ops[s.producer].phase != Phase.BACKWARD}
    return layers, trace.layer_stacks, trace.num_layers


def _forward_layers_captured(w: Workload) -> tuple[dict[str, int], tuple[str, ...], int]:
    graph = capture_graph(copy.deepcopy(w.model), (w.batch,), w.loss_fn, h200(), w.name)
    layers = {t.name: graph.op_by_name[t.producer].layer for t in graph.tensors.values()
              if graph.op_by_name[t.producer].phase != Phase.BACKWARD}
    return layers, tuple(graph.meta["layer_stacks"]), graph.num_layers


STACKS = {
    "gpt2": ("model.transformer.h",),
    "llama": ("model.model.layers",),
    "t5": ("model.encoder.block", "model.decoder.block"),
    "vit": ("model.vit.layers",),
    "sequential": ("",),
}


@pytest.mark.parametrize("name", sorted(STACKS))
def test_tracer_capture_and_export_agree_on_every_layer(name: str) -> None:
    w = _workload(name)
    traced, traced_stacks, traced_n = _forward_layers_traced(w)
    captured, captured_stacks, captured_n = _forward_layers_captured(w)
    assert traced_stacks == captured_stacks == STACKS[name]
    n = 3 if name == "sequential" else 2 * len(STACKS[name])
    assert traced_n == captured_n == n
    assert traced.keys() == captured.keys() and len(traced) > 10
    assert traced == captured  # storage by storage, the same layer index
    assert set(captured.values()) - {NO_LAYER} == set(range(n))
    assert layer_paths(w.model) == list(find_layer_stacks(w.model).paths)
    assert len(layer_paths(w.model)) == n


def test_an_encoder_decoder_numbers_encoder_layers_first_then_decoder_layers() -> None:
    w = build("t5")
    stacks = find_layer_stacks(w.model)
    assert stacks.paths == ("model.encoder.block.0", "model.encoder.block.1",
                            "model.decoder.block.0", "model.decoder.block.1")
    # an identity's module path, call suffix and all, falls in its block; the T5Block's own `layer`
    # list (self-attention, cross-attention, feed-forward) is inside a layer, not a stack of its own
    assert stacks.layer_of("model.decoder.block.1.layer.1.EncDecAttention@1") == 3
    assert stacks.layer_of("model.encoder.block.0.layer.0") == 0
    assert stacks.layer_of("model.decoder.final_layer_norm") == NO_LAYER
    assert stacks.layer_of("model.encoder.block.10") == NO_LAYER


def test_only_repeated_blocks_make_a_sequential_a_stack() -> None:
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    assert find_layer_stacks(mlp).paths == ()
    nested = nn.Sequential(nn.Linear(4, 16), nn.Sequential(_Block(), _Block()), nn.Linear(16, 1))
    assert find_layer_stacks(nested).paths == ("1.0", "1.1")
    # a ModuleList anywhere wins over a Sequential: the Sequential inside each zoo block is no stack
    assert find_layer_stacks(build("tied").model).stacks == ("layers",)


@pytest.mark.slow
@pytest.mark.usefixtures("deterministic_kernels")
def test_t5s_decoder_blocks_are_checkpoint_regions_and_its_export_runs_exact() -> None:
    """With the decoder blocks outside every region (before), every decoder tensor was fixed to keep and
    full_recompute's export plan was infeasible at 70 % of the keep-all peak; now it runs bit-exact."""
    from benchmarks.zoo import Arch

    a = Arch("t5", h200())
    assert a.graph.num_layers == 4
    plan = a.plan("full_recompute", 0.7, "export")
    assert any(d.value == "recompute" and ".decoder.block." in name for name, d in plan.decisions.items())
    assert a.cell("full_recompute", 0.7, "export") == "exact"
