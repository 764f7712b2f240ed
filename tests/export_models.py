"""Small models for the export's tests: hand-written `nn.Module`s that reproduce one pattern of a real
architecture each, and tiny Hugging Face models built from their config classes (random weights, CPU),
captured and run one step from seed 1 as the runtime tests do (tests/runtime_support.py)."""

from __future__ import annotations

import torch
from torch import nn

from slackswap.runtime import capture_graph
from slackswap.runtime.training_workload import Workload
from slackswap.simulate.metrics import simulate_ideal
from tests.runtime_support import Captured, h200, run_step


class Router(nn.Module):
    """Mixtral's router (`MixtralTopKRouter`): softmax, topk, then the top values divided in place by their
    sum, which read the values before the division."""

    def __init__(self, width: int):
        super().__init__()
        self.gate = nn.Linear(width, 4)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).float().softmax(-1)
        top, _ = torch.topk(probs, 2, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return self.proj(x) * top[..., :1]


class Stack(nn.Module):
    """Layers in a ModuleList (the export's checkpoint regions) between an input and an output Linear."""

    def __init__(self, layer, width: int = 16, layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(layer(width) for _ in range(layers))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def capture_module(name: str, model: nn.Module, batch: torch.Tensor, loss_fn) -> Captured:
    """`model` in train mode captured on `batch` (a Workload the runtime tests' helpers run)."""
    model.train()
    w = Workload(name, model, batch, loss_fn, 0)
    graph = capture_graph(model, (batch,), loss_fn, h200(), name)
    peak = simulate_ideal(graph, h200()).peak_activation_bytes
    loss, grads, _ = run_step(w)
    return Captured(w, graph, peak, (loss, grads))


def stack(layer, width: int = 16, rows: int = 8) -> Captured:
    torch.manual_seed(0)
    model = Stack(layer, width)
    batch = torch.randn(rows, width)
    return capture_module(f"stack_{layer.__name__.lower()}", model, batch, lambda out: out.square().mean())


def hf_causal_lm(config_class: str, *, dtype: torch.dtype = torch.float32, seq: int = 16, batch_size: int = 2,
                 **overrides: object) -> Captured:
    """A 2-layer causal LM of `transformers.<config_class>` (width 64, 4 heads, 2 KV heads, seq 16, batch 2 unless
    given), eager attention, random weights from seed 0, a random token batch as its own labels."""
    import transformers

    cfg = getattr(transformers, config_class)(**{
        "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": max(64, seq), **overrides})
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    batch = torch.randint(0, 64, (batch_size, seq), generator=torch.Generator().manual_seed(0))

    def loss_fn(out) -> torch.Tensor:
        logits = out.logits.float()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.reshape(-1))

    return capture_module(config_class, model, batch, loss_fn)


class BatchNormBlock(nn.Module):
    """A ResNet-style block's core: Linear, BatchNorm (whose normalised output ReLU reads, so autograd saves
    only its statistics), ReLU. BatchNorm's op makes its output beside the saved statistics."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x)))


class TopKBlock(nn.Module):
    """topk whose indices a gather reads: the values are made beside the saved indices."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        _, idx = torch.topk(y.detach(), 4, dim=-1)
        return torch.gather(y, -1, idx).sum(-1, keepdim=True) * y


class ScoresBlock(nn.Module):
    """Falcon's attention in small: scores divided in place (`attention_scores /= math.sqrt(head_dim)`), the
    probabilities returned beside the output (Falcon's decoder layer returns them; its caller reads only
    the output, holding the tuple until the next layer returns)."""

    def __init__(self, width: int):
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.q(x) @ self.k(x).T
        scores /= 4.0
        probs = scores.softmax(-1)
        return probs @ x, probs


class TupleStack(Stack):
    """`Stack` whose layers return (output, extra) and whose loop keeps the tuple, as HF's loops do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            outputs = layer(x)
            x = x + outputs[0]
        return self.out(x)


def tuple_stack(layer, width: int = 16, rows: int = 8) -> Captured:
    torch.manual_seed(0)
    model = TupleStack(layer, width)
    batch = torch.randn(rows, width)
    return capture_module(f"tuple_stack_{layer.__name__.lower()}", model, batch, lambda out: out.square().mean())
