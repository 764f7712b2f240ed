"""Any Hugging Face model from its config class by name (`builder: hf`, `model.torch.config_class`).

Why: the hf_* builders cover three families with presets; a user's model is often another
`transformers` architecture (Qwen, Phi-3, Gemma 2, GPT-NeoX, Falcon, Mixtral, T5...). This builder
takes the config class by name, sets the model's shape keys under their standard names (a config
with other names maps them through its own `attribute_map`: GPT-2's `hidden_size` is `n_embd`),
then the preset's `extra` keys, and builds the model head the config class has, in this order: causal
LM, masked LM, sequence-to-sequence LM (decoder inputs = the encoder's tokens). Random weights: nothing
is read from or fetched off a hub. The loss is the shipped one (cross entropy in fp32 over every
position against the input tokens, `slackswap.runtime.training_workload.token_loss`).

Mixture-of-experts models run their experts as `batched_mm`: transformers' default `grouped_mm`
refuses fp32 on the meta device the trace runs on, and its `eager` experts branch on data
(`nonzero`), which a meta trace cannot follow. `extra` may set `_experts_implementation` otherwise.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from slackswap.errors import ConfigError
from slackswap.model_config import ModelConfig

#: Head classes tried in order (`transformers.Auto*`), with whether the model is an encoder-decoder.
HEADS = (("AutoModelForCausalLM", False), ("AutoModelForMaskedLM", False), ("AutoModelForSeq2SeqLM", True))


def hf_config(model: ModelConfig, config_class: str, extra: dict[str, Any], transformers) -> Any:
    """The config object: shape keys by their standard names, dropout zeroed unless `model.dropout`,
    a pad token inside the vocabulary, then `extra`."""
    cls = getattr(transformers, config_class, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        raise ConfigError("model.torch.config_class", config_class, "is not a transformers config class")
    cfg = cls(vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
              num_attention_heads=model.num_heads, num_key_value_heads=model.num_kv_heads,
              intermediate_size=model.ffn_hidden_size, max_position_embeddings=model.seq_len)
    if not model.dropout:
        for key, value in cfg.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(cfg, key, 0.0)
    pad = getattr(cfg, "pad_token_id", None)
    if isinstance(pad, int) and pad >= model.vocab_size:
        cfg.pad_token_id = 0  # an embedding's padding index must lie inside the (toy) vocabulary
    if model.head_dim:
        cfg.head_dim = model.head_dim
    if model.mla is not None:  # DeepseekV3Config's keys have model.mla's names; its rotary width is head_dim
        for key, value in asdict(model.mla).items():
            setattr(cfg, key, value or None)  # q_lora_rank 0: HF's None (an uncompressed q_proj)
        cfg.qk_head_dim = model.mla.qk_head_dim
        cfg.head_dim = model.mla.qk_rope_head_dim
    if getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None):
        cfg._experts_implementation = "batched_mm"
    for key, value in extra.items():
        setattr(cfg, key, value)
    return cfg


def build_hf(model: ModelConfig, config_class: str, extra: dict[str, Any], attention: str, device: str, dtype):
    """(module in train mode, inputs, is_encoder_decoder) of `config_class` at `model`'s shape on `device`."""
    import torch
    import transformers

    cfg = hf_config(model, config_class, extra, transformers)
    cfg._attn_implementation = attention
    cfg.use_cache = False
    found = [(getattr(transformers, head), pair) for head, pair in HEADS
             if type(cfg) in getattr(transformers, head)._model_mapping]
    if not found:
        raise ConfigError("model.torch.config_class", config_class,
                          f"has no causal, masked or sequence-to-sequence LM head ({', '.join(h for h, _ in HEADS)})")
    auto, encoder_decoder = found[0]
    with torch.device(device):
        net = auto.from_config(cfg).to(dtype)
    net.train()
    ids = torch.zeros(model.micro_batch_size, model.seq_len, dtype=torch.long, device=device)
    return net, ((ids, None, ids) if encoder_decoder else (ids,)), encoder_decoder


__all__ = ["HEADS", "build_hf", "hf_config"]
