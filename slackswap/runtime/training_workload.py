"""Training workloads for the runtime: the torch profile source's models with a random token batch.

The model comes from `slackswap.profile.torch.workloads.build_workload` (HF BERT / GPT-2 / Llama from
config classes, any HF config class by name, the plain-torch TinyGPT, or a user hook), built on a real
device with seeded weights. The runtime adds what training needs and the trace does not: a random
token batch (seeded) and a loss whose labels are that batch, cross entropy in fp32 as the tracer's
loss computes it. A user's hook is the exception: its own inputs and loss are the step (SlackSwap
cannot know what a fresh batch of an arbitrary model is), every training step reuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from slackswap.model_config import ModelConfig
from slackswap.profile.torch.spec import TorchSpec


@dataclass
class Workload:
    name: str
    model: torch.nn.Module
    #: The token batch (`model(batch)` for the shipped builders); for a hook, its first tensor input.
    batch: torch.Tensor
    loss_fn: Callable[[object], torch.Tensor]
    vocab_size: int
    #: Everything `model(*inputs)` takes; empty means `(batch,)`.
    inputs: tuple = ()
    #: Positions in `inputs` that hold the token batch: a training step puts a fresh batch there and
    #: scores against it (`token_loss`). Empty for a user's hook, whose own inputs and loss every step uses.
    token_slots: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not self.inputs:
            self.inputs = (self.batch,)

    def inputs_for(self, batch: torch.Tensor) -> tuple:
        """The model's inputs with `batch` as the token batch (the hook's own inputs for a hook)."""
        return tuple(batch if i in self.token_slots else x for i, x in enumerate(self.inputs))

    def loss_for(self, batch: torch.Tensor) -> Callable[[object], torch.Tensor]:
        """The loss of a step on `batch`: cross entropy against it, or the hook's own loss."""
        return token_loss(batch) if self.token_slots else self.loss_fn


def token_loss(batch: torch.Tensor) -> Callable[[object], torch.Tensor]:
    """Cross entropy (fp32) of the logits against the batch's own tokens."""

    def loss_fn(out: object) -> torch.Tensor:
        logits = out if isinstance(out, torch.Tensor) else out.logits
        logits = logits.float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.reshape(-1))

    return loss_fn


def random_batch(model: ModelConfig, device: str, generator: torch.Generator | None = None) -> torch.Tensor:
    return torch.randint(0, model.vocab_size, (model.micro_batch_size, model.seq_len), generator=generator,
                         device=device)


def build_training_workload(model: ModelConfig, spec: TorchSpec, device: str = "cpu", seed: int = 0) -> Workload:
    """The preset's model on `device` in train mode, weights from `seed`, a random batch from `seed`."""
    from slackswap.profile.torch.workloads import build_workload

    torch.manual_seed(seed)
    net, inputs, hook_loss = build_workload(model, spec, device)
    if net.training is False:
        net.train()
    if spec.builder == "hook":  # the user's inputs and loss, as the trace had them
        first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
        if first is None:
            raise ValueError(f"the hook {spec.hook} returned no tensor among its inputs")
        return Workload(model.name, net, first, hook_loss, model.vocab_size, tuple(inputs), ())
    generator = torch.Generator(device=device).manual_seed(seed)
    batch = random_batch(model, device, generator)
    if tuple(inputs[0].shape) != tuple(batch.shape):
        raise ValueError(f"the workload's input shape {tuple(inputs[0].shape)} is not (micro_batch, seq)")
    # The token ids wherever the builder put them (an encoder-decoder reads them twice).
    slots = tuple(i for i, x in enumerate(inputs) if x is inputs[0])
    w = Workload(model.name, net, batch, token_loss(batch), model.vocab_size, tuple(inputs), slots)
    w.inputs = w.inputs_for(batch)
    return w


#: Small shapes of the three HF families and TinyGPT, for tests and CPU smoke runs (2 layers).
FAMILY_BUILDERS = {"tiny": ("gpt2", "tiny_gpt"), "gpt2": ("gpt2", "hf_gpt2"), "bert": ("bert", "hf_bert"),
                   "llama": ("llama", "hf_llama")}


def small_config(kind: str, *, layers: int = 2, hidden: int = 32, heads: int = 4, seq: int = 16, batch: int = 2,
                 vocab: int = 64, dtype: str = "fp32") -> tuple[ModelConfig, TorchSpec]:
    family, builder = FAMILY_BUILDERS[kind]
    kv_heads = max(1, heads // 2) if family == "llama" else heads
    ffn = 4 * hidden if family != "llama" else 2 * hidden + hidden // 2
    model = ModelConfig(name=f"small_{kind}", family=family, num_layers=layers, hidden_size=hidden, num_heads=heads,
                        num_kv_heads=kv_heads, ffn_hidden_size=ffn, seq_len=seq, micro_batch_size=batch,
                        vocab_size=vocab, dtype=dtype, dropout=True)
    extra = {"bos_token_id": 0, "eos_token_id": 0} if builder == "hf_gpt2" else {}
    return model, TorchSpec(builder=builder, attention="eager", semantics="cpu", extra=extra)
