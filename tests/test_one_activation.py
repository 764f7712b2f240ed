"""One definition of an activation for the captured and the traced graph (issue 39, item 5).

A weight gradient (a `param.grad` storage) is model state, not an activation: the traced graph never
made it a graph tensor, the captured graph made every one a backward tensor held to the step's end,
so on the same model the same plan peaked higher on the captured graph (on a 2-layer Qwen3 of width
64: 25 gradient storages, 1 068 288 B beside a 1 306 624 B keep-all peak). Here the gradient storages
are found independently of the capture (a post-accumulate-grad hook on every parameter, named through
the step's own numbering), and neither graph may count them; the capture lists them, with their bytes,
under `WEIGHT_GRADS_KEY` so the runtime can tell them from a tensor the graph lacks.
"""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.graph import WEIGHT_GRADS_KEY, Graph, Phase  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.profile.torch import build_torch_graph  # noqa: E402
from slackswap.profile.torch.spec import TorchSpec  # noqa: E402
from slackswap.runtime import capture_graph  # noqa: E402
from slackswap.runtime.training_workload import Workload, build_training_workload, small_config  # noqa: E402
from tests.runtime_support import h200  # noqa: E402


def qwen3_small() -> tuple[ModelConfig, TorchSpec]:
    """A 2-layer Hugging Face Qwen3 of width 64 built from its config class (the issue's small shape)."""
    model = ModelConfig(name="small_qwen3", family="llama", num_layers=2, hidden_size=64, num_heads=4,
                        num_kv_heads=2, ffn_hidden_size=160, seq_len=16, micro_batch_size=2, vocab_size=64,
                        dtype="fp32", dropout=True)
    return model, TorchSpec(builder="hf", attention="eager", semantics="cpu", config_class="Qwen3Config")


CASES = {"tiny": lambda: small_config("tiny"), "llama": lambda: small_config("llama", hidden=64),
         "qwen3": qwen3_small}


def capture_with_grad_names(w: Workload, monkeypatch: pytest.MonkeyPatch) -> tuple[Graph, dict[str, int]]:
    """The captured graph and, found beside the capture, each parameter's gradient storage: the name the
    step's numbering gave it (or "<not a graph storage>") -> its bytes."""
    import slackswap.runtime.op_numbering as numbering

    made: dict[int, str] = {}
    end = numbering.OpNumbering.end

    def named_end(self, func, out):
        fresh = end(self, func, out)
        made.update((t.untyped_storage()._cdata, name) for _, name, t in fresh)
        return fresh

    monkeypatch.setattr(numbering.OpNumbering, "end", named_end)
    grads: dict[str, int] = {}

    def note(p: torch.Tensor) -> None:
        storage = p.grad.untyped_storage()
        grads[made.get(storage._cdata, "<not a graph storage>")] = storage.nbytes()

    hooks = [p.register_post_accumulate_grad_hook(note) for p in w.model.parameters()]
    try:
        graph = capture_graph(w.model, (w.batch,), w.loss_fn, h200(), w.name)
    finally:
        for h in hooks:
            h.remove()
        monkeypatch.undo()
    return graph, grads


def _backward_tensors(graph: Graph) -> int:
    return sum(1 for t in graph.tensors.values() if graph.op_by_name[t.producer].phase == Phase.BACKWARD)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_weight_gradients_are_activations_in_neither_graph(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, spec = CASES[name]()
    w = build_training_workload(model, spec, "cpu", 0)
    captured, grads = capture_with_grad_names(w, monkeypatch)
    traced = build_torch_graph(model, spec, h200())
    params = sum(p.numel() * p.element_size() for p in w.model.parameters())
    assert "<not a graph storage>" not in grads and len(grads) == len(list(w.model.parameters()))
    counted = sorted(set(grads) & set(captured.tensors))
    assert counted == [], f"{len(counted)} weight gradient(s) counted as activations, e.g. {counted[:3]}"
    assert dict(captured.meta[WEIGHT_GRADS_KEY]) == grads
    assert sum(grads.values()) == params == captured.weight_grad_bytes == traced.weight_grad_bytes
    # What is left is the traced graph's count: the backward tensors differ only in their names.
    assert _backward_tensors(captured) == _backward_tensors(traced)
    assert {t.name for t in captured.saved_tensors} == {t.name for t in traced.saved_tensors}
