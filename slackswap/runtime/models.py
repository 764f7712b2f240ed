"""Small models for the runtime's tests and the training entry point: a plain-torch tiny transformer
and 2-layer Hugging Face BERT / GPT-2 / Llama built from their config classes (no download).

Each builder returns a `Workload`: the model in train mode, a random token batch, and the loss. The
HF configs keep the families' layer structure (attention, MLP, norms, dropout where the family has
it) at toy widths; eager attention, so every op is a plain ATen call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Workload:
    name: str
    model: nn.Module
    batch: torch.Tensor
    loss_fn: Callable[[object], torch.Tensor]
    vocab_size: int

    def new_batch(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, tuple(self.batch.shape), generator=generator,
                             device=self.batch.device)


def token_loss(batch: torch.Tensor) -> Callable[[object], torch.Tensor]:
    """Next-token cross entropy of the model's logits against the batch itself (labels = inputs)."""

    def loss_fn(out: object) -> torch.Tensor:
        logits = getattr(out, "logits", out)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.flatten())

    return loss_fn


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = self.drop(scores.masked_fill(causal, float("-inf")).softmax(-1))
        return self.out((probs @ v).transpose(1, 2).reshape(b, s, h))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = _Attention(hidden, heads, dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)))))


class TinyTransformer(nn.Module):
    """A GPT-style decoder at toy sizes: embedding, `layers` pre-LN blocks with dropout, LM head."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def _hf(kind: str, hidden: int, heads: int, layers: int, seq: int, vocab: int) -> nn.Module:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the torch extra installs it
        raise ImportError("the HF workloads need transformers: pip install -e '.[torch]'") from exc
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq,
                                         vocab_size=vocab)
        cls = transformers.GPT2LMHeadModel
    elif kind == "bert":
        config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                         intermediate_size=4 * hidden, max_position_embeddings=seq,
                                         vocab_size=vocab)
        cls = transformers.BertForMaskedLM
    elif kind == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                          num_key_value_heads=max(1, heads // 2),
                                          intermediate_size=2 * hidden + hidden // 2,
                                          max_position_embeddings=seq, vocab_size=vocab)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"workload kind={kind!r}: unknown; known: tiny, gpt2, bert, llama")
    config._attn_implementation = "eager"
    config.use_cache = False  # training: a KV cache would keep K and V alive to the end of the forward
    return cls(config)


def build_workload(kind: str, *, hidden: int = 32, heads: int = 4, layers: int = 2, seq: int = 16, batch: int = 2,
                   vocab: int = 64, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
                   ) -> Workload:
    """Build a workload in train mode with seeded weights and a seeded random token batch."""
    torch.manual_seed(seed)
    model = TinyTransformer(vocab, hidden, heads, layers) if kind == "tiny" else _hf(kind, hidden, heads, layers,
                                                                                      seq, vocab)
    model = model.to(device=device, dtype=dtype).train()
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return Workload(kind, model, ids, token_loss(ids), vocab)
