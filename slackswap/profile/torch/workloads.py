"""Build (model, example inputs, loss function) for a `ModelConfig` + `TorchSpec` on a device.

- hf_bert / hf_gpt2 / hf_llama: the real `transformers` classes (BertForMaskedLM, GPT2LMHeadModel,
  LlamaForCausalLM) from a config object built here from the model's shape plus the preset's
  published extra keys: nothing is read from or fetched off a hub. On the meta device nothing is
  allocated either, so a 70B model builds in milliseconds.
- tiny_gpt: a plain-torch GPT-2-style model (slackswap.profile.torch.tiny), the test model.
- hf: any `transformers` config class by name (`model.torch.config_class`), with its LM head
  (slackswap.profile.torch.hf_any).
- hook: a user's `package.module:function(model_config, device)` returning (model, inputs, loss_fn).

Loss: cross entropy over every position in fp32, as HF's `ForCausalLMLoss` and MLM loss compute it
(`logits.float()`), outside the model so the trace has a loss phase. Labels are inputs, not activations.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from slackswap.errors import ConfigError, SlackSwapError
from slackswap.model_config import ModelConfig
from slackswap.profile.torch.spec import TorchSpec


class MissingDependencyError(SlackSwapError):
    """torch or transformers is not installed: the message says which and how to install it."""


def import_torch():
    try:
        import torch
    except ImportError as exc:
        raise MissingDependencyError(
            "the torch profile source needs torch: pip install -e '.[torch]'") from exc
    return torch


def import_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            "the hf_* presets need transformers: pip install -e '.[torch]'") from exc
    return transformers


TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


#: Per builder, the HF config keys of every dropout probability: zeroed when `model.dropout` is false.
_HF_DROPOUT_KEYS = {
    "hf_bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "hf_gpt2": ("attn_pdrop", "embd_pdrop", "resid_pdrop"),
    "hf_llama": ("attention_dropout",),
}


def _hf_config(model: ModelConfig, spec: TorchSpec, transformers) -> Any:
    m, extra = model, dict(spec.extra)
    if not m.dropout:
        extra |= dict.fromkeys(_HF_DROPOUT_KEYS[spec.builder], 0.0)
    if spec.builder == "hf_bert":
        cfg = transformers.BertConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, intermediate_size=m.ffn_hidden_size,
            max_position_embeddings=max(m.seq_len, extra.pop("max_position_embeddings", 0)), **extra)
    elif spec.builder == "hf_gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=m.vocab_size, n_embd=m.hidden_size, n_layer=m.num_layers, n_head=m.num_heads,
            n_inner=m.ffn_hidden_size, n_positions=max(m.seq_len, extra.pop("n_positions", 0)), **extra)
    else:
        if m.mla is not None:  # LlamaConfig has no latent attention: a trace of it would be another model
            raise ConfigError("model.mla", m.mla, "is not built by the hf_llama builder; trace it with "
                              "model.torch.builder=hf model.torch.config_class=DeepseekV3Config")
        if m.head_dim:
            extra.setdefault("head_dim", m.head_dim)
        cfg = transformers.LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
            intermediate_size=m.ffn_hidden_size,
            max_position_embeddings=max(m.seq_len, extra.pop("max_position_embeddings", 0)), **extra)
    cfg._attn_implementation = spec.attention
    cfg.use_cache = False
    return cfg


_HF_CLASSES = {"hf_bert": "BertForMaskedLM", "hf_gpt2": "GPT2LMHeadModel", "hf_llama": "LlamaForCausalLM"}


def hook_function(hook: str) -> Callable:
    """The function `package.module:function` names; a ConfigError naming `model.torch.hook`, with what
    to check, when it cannot be imported: the usual cause is a module that is not on the import path
    of the process (the repository root is; a folder of one's own is not until PYTHONPATH has it)."""
    module_name, _, func_name = hook.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            "model.torch.hook", hook,
            f"cannot be imported ({type(exc).__name__}: {exc}); the part before ':' must be a module importable "
            "where you run (put its folder on PYTHONPATH), the part after it a function of that module",
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(
            "model.torch.hook", hook,
            f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no function {func_name!r}; "
            "write it as package.module:function",
        )
    return func


def build_workload(model: ModelConfig, spec: TorchSpec, device: str = "meta") -> tuple[Any, tuple, Callable]:
    """(nn.Module in train mode, example inputs, loss_fn(output) -> scalar) on `device`."""
    torch = import_torch()
    if spec.builder == "hook":
        result = hook_function(spec.hook)(model, device)
        if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], torch.nn.Module)
                and callable(result[2])):
            raise ConfigError("model.torch.hook", spec.hook, "must return (nn.Module, inputs tuple, loss_fn)")
        return result[0], tuple(result[1]), result[2]
    dtype = getattr(torch, TORCH_DTYPES[model.dtype])
    if spec.builder == "hf":
        from slackswap.profile.torch.hf_any import build_hf

        import_transformers()
        net, inputs, _ = build_hf(model, spec.config_class, dict(spec.extra), spec.attention, device, dtype)
        labels = torch.zeros(model.micro_batch_size * model.seq_len, dtype=torch.long, device=device)
        return net, inputs, _token_loss(labels, torch)
    if spec.builder == "tiny_gpt":
        from slackswap.profile.torch.tiny import TinyGPT

        with torch.device(device):
            net = TinyGPT(model, dropout=0.1 if model.dropout else 0.0, attention=spec.attention).to(dtype)
    else:
        transformers = import_transformers()
        cfg = _hf_config(model, spec, transformers)
        with torch.device(device):
            net = getattr(transformers, _HF_CLASSES[spec.builder])(cfg).to(dtype)
    net.train()
    b, s = model.micro_batch_size, model.seq_len
    ids = torch.zeros(b, s, dtype=torch.long, device=device)
    labels = torch.zeros(b * s, dtype=torch.long, device=device)

    return net, (ids,), _token_loss(labels, torch)


def _token_loss(labels: Any, torch) -> Callable[[Any], Any]:
    def loss_fn(output: Any) -> Any:
        logits = output if isinstance(output, torch.Tensor) else output.logits
        logits = logits.float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels)

    return loss_fn


@contextlib.contextmanager
def meta_trace_patches(spec: TorchSpec) -> Iterator[None]:
    """Answers the data-dependent checks HF models make in forward, which meta tensors cannot evaluate.

    `transformers.masking_utils.find_packed_sequence_indices` asks whether the position ids pack
    several sequences into one row (`.all()` on data). The example inputs here are one unpadded
    sequence per row, for which HF itself returns None, so the trace answers None. For the hf_* builders
    and for any model built with transformers loaded (a hook's Qwen, Phi-3, Gemma 2, Mixtral...: every
    decoder that builds its mask through masking_utils asks it); a run on a real device (measure.py)
    needs and gets no patch.
    """
    if not spec.builder.startswith("hf_") and "transformers" not in sys.modules:
        yield
        return
    masking_utils = importlib.import_module("transformers.masking_utils")
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
