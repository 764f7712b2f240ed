"""Hooks (`build(model_config, device) -> (module, inputs, loss_fn)`) the bring-your-own-model tests name
as `tests.byo_hooks:<function>`: a Hugging Face decoder through the hook path, a vision transformer
whose inputs are pixels (not tokens), and a model the tracer cannot follow (a boolean mask's
data-dependent shape)."""

from __future__ import annotations

import torch
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def qwen3(model, device: str):
    """Qwen3 from its config class, as a user would write the hook (docs/torch_profile.md)."""
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
        num_key_value_heads=model.num_kv_heads, max_position_embeddings=model.seq_len)
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    with torch.device(device):
        net = transformers.AutoModelForCausalLM.from_config(cfg).to(DTYPES[model.dtype])
    net.train()
    ids = torch.randint(model.vocab_size, (model.micro_batch_size, model.seq_len),
                        generator=torch.Generator().manual_seed(0)).to(device)

    def loss_fn(out):
        logits = out.logits.float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))

    return net, (ids,), loss_fn


def vit(model, device: str):
    """A ViT image classifier: pixels in, class labels for the loss."""
    import transformers

    cfg = transformers.ViTConfig(hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
                                 num_attention_heads=model.num_heads, intermediate_size=model.ffn_hidden_size,
                                 image_size=32, patch_size=8, num_labels=10)
    cfg._attn_implementation = "eager"
    with torch.device(device):
        net = transformers.ViTForImageClassification(cfg).to(DTYPES[model.dtype])
    net.train()
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(model.micro_batch_size, 3, 32, 32, generator=generator).to(device, DTYPES[model.dtype])
    labels = torch.randint(10, (model.micro_batch_size,), generator=generator).to(device)
    return net, (pixels,), lambda out: nn.functional.cross_entropy(out.logits.float(), labels)


class _Gate(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return x + y[y > 0].sum()  # a boolean mask: its shape depends on the values


class _Masked(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.ModuleList(_Gate(width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def data_dependent(model, device: str):
    net = _Masked(8).to(device)
    return net, (torch.ones(4, 8, device=device),), lambda out: out.sum()
