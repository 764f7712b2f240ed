"""TinyGPT: a plain-torch GPT-2-style model whose layer is exactly Korthikanti's (docs/profile.md).

Megatron's [s, b, h] layout, so Q, K and V stay views of the fused QKV output (one storage, 6sbh) and
the attention bmms read them without copies; eager attention with a 16-bit softmax and dropout on the
probabilities; GeLU MLP; pre-LN; dropout after the projection and the second linear. With CUDA
semantics its traced layer saves sbh(34 + 5as/h) bytes plus the LayerNorm statistics (the analytic
graph leaves those out), which the tests check. `attention: sdpa` uses scaled_dot_product_attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slackswap.model_config import ModelConfig


class TinyBlock(nn.Module):
    def __init__(self, m: ModelConfig, dropout: float, attention: str):
        super().__init__()
        h = m.hidden_size
        self.heads, self.p, self.attention = m.num_heads, dropout, attention
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, m.ffn_hidden_size), nn.Linear(m.ffn_hidden_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s, b, h]
        s, b, h = x.shape
        a, d = self.heads, h // self.heads
        qkv = self.qkv(self.ln1(x)).view(s, b * a, 3 * d)
        q, k, v = (qkv[..., i * d:(i + 1) * d].transpose(0, 1) for i in range(3))  # [b*a, s, d] views
        if self.attention == "sdpa":
            ctx = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                                 dropout_p=self.p if self.training else 0.0).squeeze(0)
        else:
            scores = torch.bmm(q, k.transpose(1, 2)) * d**-0.5
            probs = F.dropout(torch.softmax(scores, dim=-1), self.p, self.training)
            ctx = torch.bmm(probs, v)
        ctx = ctx.transpose(0, 1).reshape(s, b, h)
        x = x + F.dropout(self.proj(ctx), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


class TinyGPT(nn.Module):
    def __init__(self, m: ModelConfig, dropout: float = 0.1, attention: str = "eager"):
        super().__init__()
        self.p = dropout
        self.embed = nn.Embedding(m.vocab_size, m.hidden_size)
        self.layers = nn.ModuleList(TinyBlock(m, dropout, attention) for _ in range(m.num_layers))
        self.ln_f = nn.LayerNorm(m.hidden_size)
        self.head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [b, s] -> logits [b, s, V]
        x = F.dropout(self.embed(ids.t()), self.p, self.training)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x)).transpose(0, 1)


def tiny_workload(model: ModelConfig, device: str):
    """The example `module:function` hook (docs/torch_profile.md): (model, inputs, loss_fn) for TinyGPT.

    `model.torch.hook=slackswap.profile.torch.tiny:tiny_workload` traces it like a user's own model.
    """
    net = TinyGPT(model, dropout=0.1 if model.dropout else 0.0).to(device=device, dtype=torch.bfloat16)
    net.train()
    ids = torch.zeros(model.micro_batch_size, model.seq_len, dtype=torch.long, device=device)
    labels = torch.zeros(model.micro_batch_size * model.seq_len, dtype=torch.long, device=device)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels)

    return net, (ids,), loss_fn
