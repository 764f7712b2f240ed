"""A model of your own for SlackSwap: the hook `build(model_config, device)`.

SlackSwap calls `build` with the `ModelConfig` of the preset the run names (`model=tiny_torch`: its
shape keys, overridable on the command line as usual) and the device to build on (`"meta"` when it
traces the step, `"cpu"` or `"cuda"` when `pipelines.train` runs it). It returns the module, the
inputs of `module(*inputs)` and `loss_fn(output) -> scalar tensor`. Any `nn.Module` works; the
repeated blocks are found as the `nn.ModuleList` with the most children (ops under its i-th child are
layer i). Run it (docs/torch_profile.md, "Your own model, end to end"):

    PYTHONPATH=examples/byo_model python -m pipelines.run model=tiny_torch model.name=my_mlp model.num_layers=4 \\
        model.seq_len=128 model.torch.builder=hook model.torch.hook=my_model:build
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (torch's own convention)
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Block(nn.Module):
    """Pre-norm residual MLP block: what an activation planner sees as one layer."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MyMLP(nn.Module):
    def __init__(self, vocab: int, hidden: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(model, device: str):
    """(module, inputs, loss_fn) of `model`'s shape (a `slackswap.model_config.ModelConfig`) on `device`."""
    net = MyMLP(model.vocab_size, model.hidden_size, model.ffn_hidden_size, model.num_layers)
    net = net.to(device=device, dtype=DTYPES[model.dtype])
    net.train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(model.vocab_size, (model.micro_batch_size, model.seq_len), generator=generator)
    labels = torch.randint(model.vocab_size, (model.micro_batch_size * model.seq_len,), generator=generator)
    ids, labels = ids.to(device), labels.to(device)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels)

    return net, (ids,), loss_fn
