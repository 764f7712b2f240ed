"""Every byte the trace sees is in what the planners read.

The graph's saved tensors equal the tensors `saved_tensors_hooks` sees in a real CPU step, byte for
byte (tests/test_torch_profile.py). Here: the bytes the planners value each saved tensor at
(`analysis.TensorInfo.size_bytes`, from `Graph.drop_bytes_of`) equal them too. Under CPU semantics
dropout keeps a noise tensor of the input's dtype, the last in-place version (`div_`) of an
`empty_like` storage: an alias, which `owned_bytes` counts as 0, so the planners saw a 4-layer GPT-2
(width 256, s = 256, b = 2, fp32) 14 % lighter than its trace.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.extras import require_torch_extra

require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.planners.support.analysis import analyse  # noqa: E402
from slackswap.profile.torch import build_torch_graph  # noqa: E402
from slackswap.profile.torch.spec import TorchSpec  # noqa: E402
from slackswap.profile.torch.verify import compare_saved  # noqa: E402
from tests.test_torch_profile import HW, small  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("builder", ["hf_gpt2", "hf_bert"])
def test_planners_value_each_saved_tensor_at_its_traced_bytes(builder):
    model = small("gpt2" if builder == "hf_gpt2" else "bert")
    spec = TorchSpec(builder, attention="eager", semantics="cpu")
    real = compare_saved(model, spec, "cpu").real
    graph = build_torch_graph(model, spec, HW)
    valued = {name: info.size_bytes for name, info in analyse(graph, HW).tensors.items()}
    assert valued == real
    noise = [t for t in graph.saved_tensors if t.base and "empty_like" in graph.storage_root(t.name)]
    assert noise and all(graph.owned_bytes(t.name) == 0 < valued[t.name] for t in noise)


def test_the_4_layer_gpt2_of_the_issue_is_valued_at_its_traced_bytes():
    """No real run: the traced saved bytes (the trace's own storages) against the planners' sum."""
    from slackswap.profile.torch import trace_model

    model = replace(small("gpt2"), num_layers=4, hidden_size=256, ffn_hidden_size=1024, seq_len=256,
                    vocab_size=512, dtype="fp32")
    spec = TorchSpec("hf_gpt2", attention="eager", semantics="cpu")
    trace, _ = trace_model(model, spec)
    traced = sum(trace.storages[k].size_bytes for k in trace.saved)
    graph = build_torch_graph(model, spec, HW)
    assert sum(info.size_bytes for info in analyse(graph, HW).tensors.values()) == traced
    assert sum(graph.owned_bytes(t.name) for t in graph.saved_tensors) < 0.9 * traced  # what it was


def test_the_breakdown_shows_the_models_hold():
    from slackswap.profile import build_graph
    from slackswap.profile.report import format_breakdown

    model = small("gpt2")
    traced = build_torch_graph(model, TorchSpec("hf_gpt2", attention="eager", semantics="cuda"), HW)
    held = [t for t in traced.tensors.values() if t.held_until]
    assert held  # HF GPT-2 keeps its embeddings and the attention mask to the end of its forward
    text = format_breakdown(traced)
    assert f"held by the model's own code past their last reader: {len(held)} tensors" in text
    biggest = max(held, key=lambda t: (t.size_bytes, [-ord(ch) for ch in t.name]))
    assert f"{biggest.size_bytes:>12d}  {biggest.held_until}" in text
    assert "held by the model's own code" not in format_breakdown(build_graph(model, HW))  # analytic: none
