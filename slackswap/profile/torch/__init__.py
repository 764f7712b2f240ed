"""The torch profile source: the graph of a real PyTorch model's training step, traced on meta tensors.

Importing this package does not import torch (configs validate without it); the functions below do,
and raise `MissingDependencyError` naming the extra to install when torch or transformers is missing.
The runtime (slackswap.runtime) names saved tensors with `slackswap.profile.torch.identity`, the same
scheme as the traced graph's tensor names. docs/torch_profile.md has the details.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from typing import Any

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.model_config import ModelConfig
from slackswap.profile.torch.spec import TorchSpec

__all__ = ["TorchSpec", "build_torch_graph", "profile_source", "spec_for_family", "spec_from_options", "trace_model"]

#: The transformers builder of each analytic family (`profile=torch` with an analytic model preset).
FAMILY_BUILDERS = {"bert": "hf_bert", "gpt2": "hf_gpt2", "llama": "hf_llama"}

_TRACES: dict[str, Any] = {}


def trace_model(model: ModelConfig, spec: TorchSpec) -> tuple[Any, float]:
    """(Trace, trace wall seconds; 0.0 when cached): one trace per (model, spec) per process."""
    import json

    from slackswap.profile.torch.workloads import build_workload, import_torch, meta_trace_patches

    import_torch()  # a named error, not an ImportError, when the extra is missing
    from slackswap.profile.torch.tracer import trace_step

    # The kernel mode prices the trace (graph_from_trace); the trace itself does not depend on it.
    key = json.dumps([asdict(model), asdict(replace(spec, kernels="eager"))], sort_keys=True, default=str)
    if key in _TRACES:
        return _TRACES[key], 0.0
    t0 = time.perf_counter()
    net, inputs, loss_fn = build_workload(model, spec, "meta")
    with meta_trace_patches(spec):
        trace = trace_step(net, inputs, loss_fn, semantics=spec.semantics, dtype=model.dtype)
    _TRACES[key] = trace
    return trace, time.perf_counter() - t0


def build_torch_graph(model: ModelConfig, spec: TorchSpec, hardware: Hardware,
                      training: TrainingConfig | None = None) -> Graph:
    """The traced training step of `model` (built by `spec`) timed on `hardware`; with
    `model.include_optimizer`, optimizer-step ops of `training`'s recipe close the step."""
    hardware.peak_for(model.dtype)
    if training is not None:
        training.check_model_dtype(model.dtype)
    trace, _ = trace_model(model, spec)
    from slackswap.profile.torch.assemble import graph_from_trace
    from slackswap.versions import package_versions

    # The graph depends on the torch and transformers code that ran the step: graph.json says which.
    meta = {"model": asdict(model), "torch": asdict(spec), "versions": package_versions(("torch", "transformers"))}
    return graph_from_trace(trace, hardware, f"{model.name}@{hardware.name}", meta, training=training,
                            include_optimizer=model.include_optimizer, kernels=spec.kernels,
                            attention_kernel=model.attention_kernel)


def spec_for_family(model: ModelConfig, **options: Any) -> TorchSpec:
    """The TorchSpec that traces an analytic preset's shape with its family's transformers class:
    eager attention for `model.attention: eager`, sdpa for `flash`; the HF config class defaults for
    everything the shape does not fix. `options` (TorchSpec fields) override."""
    fields = {"builder": FAMILY_BUILDERS[model.family],
              "attention": "eager" if model.attention == "eager" else "sdpa"} | dict(options)
    return TorchSpec.from_dict(fields)


def spec_from_options(model: ModelConfig, options: dict[str, Any]) -> TorchSpec:
    """The TorchSpec of the torch source's options: TorchSpec fields; without a builder, the model's
    family decides (`spec_for_family`)."""
    return TorchSpec.from_dict(options) if "builder" in options else spec_for_family(model, **options)


def profile_source(model: ModelConfig, hardware: Hardware, training: TrainingConfig | None = None,
                   **options: Any) -> Graph:
    """The torch profile source (`slackswap.profile.sources`, name `torch`) as one function of
    (model, hardware, training): `options` as in `spec_from_options`."""
    return build_torch_graph(model, spec_from_options(model, options), hardware, training)
