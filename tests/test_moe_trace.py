"""A small Hugging Face Mixtral traced on meta tensors in bf16 against a real CPU step: the saved tensors
`saved_tensors_hooks` sees in the real step equal the trace's, identity by identity and byte by byte
(issue 43's test), whatever the routing the random weights give."""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

require_torch_extra("torch")
require_torch_extra("transformers")

from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.profile.torch.spec import TorchSpec  # noqa: E402
from slackswap.profile.torch.verify import compare_saved  # noqa: E402

#: 2 layers of width 64, 4 heads over 2 KV heads, sequence 16, micro-batch 2, bf16; MixtralConfig's 8
#: local experts, top 2.
SHAPE = ModelConfig(name="mixtral_small", family="llama", num_layers=2, hidden_size=64, num_heads=4,
                    num_kv_heads=2, ffn_hidden_size=128, seq_len=16, micro_batch_size=2, vocab_size=96,
                    dtype="bf16", dropout=False)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_mixtral_traced_on_meta_in_bf16_saves_what_a_real_cpu_step_saves(seed: int) -> None:
    spec = TorchSpec(builder="hf", config_class="MixtralConfig", attention="eager")
    result = compare_saved(SHAPE, spec, "cpu", seed=seed)  # traced on meta, then run for real with hooks
    assert result.traced == result.real, result.summary()
    assert len(result.real) == 60  # 26 per layer, 4 of the final norm, 2 of the rotary embedding, 2 of the loss
    for layer in range(SHAPE.num_layers):  # the router's and the experts' tensors are among them
        assert {f"model.layers.{layer}.mlp.gate/topk#0:1", f"model.layers.{layer}.mlp.experts/bmm#0:0"} <= set(
            result.real)
    tokens = SHAPE.micro_batch_size * SHAPE.seq_len
    # bf16 activations (b s h x 2 B); the router's softmax is taken in fp32 by HF (tokens x 8 experts x 4 B)
    assert result.real["model.layers.0.input_layernorm/mul#1:0"] == tokens * SHAPE.hidden_size * 2
    assert result.real["model.layers.0.mlp.gate/_softmax#0:0"] == tokens * 8 * 4
