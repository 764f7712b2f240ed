"""The five models of the measured-profile benchmarks (`benchmarks/measured_profile.py`, and the
hf_gpt2_2l shape of `benchmarks/cross_shape_fit.py` and `benchmarks/export_cached_calls.py`) and the
hardware preset their plans are made for."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.common import conf

HARDWARE = "h200_sxm_pcie5"


def cases():
    """(name, ModelConfig, TorchSpec) of the 5 models."""
    from slackswap.model_config import ModelConfig
    from slackswap.profile.torch.spec import TorchSpec
    from slackswap.runtime.training_workload import small_config

    def preset(name: str, **change):
        data = conf("model", name)
        data.pop("defaults", None)
        base = conf("model", "gpt2_xl" if name == "hf_gpt2_2l" else "tiny")
        base.pop("defaults", None)
        data = {**base, **data, **change}
        torch_node = data.pop("torch")
        data.pop("source", None)
        return ModelConfig.from_dict(data), TorchSpec.from_dict(torch_node)

    bert, bert_spec = small_config("bert", hidden=128, heads=4, seq=128, batch=2, vocab=512)
    llama, llama_spec = small_config("llama", hidden=128, heads=4, seq=128, batch=2, vocab=512)
    mlp, _ = preset("tiny_torch")
    mlp = replace(mlp, name="my_mlp (hook)", num_layers=4, seq_len=128)
    return [("hf_gpt2_2l", *preset("hf_gpt2_2l")), ("tiny_torch", *preset("tiny_torch")),
            ("small_bert", bert, bert_spec), ("small_llama", llama, llama_spec),
            ("my_mlp (hook)", mlp, TorchSpec(builder="hook", hook="my_model:build"))]
