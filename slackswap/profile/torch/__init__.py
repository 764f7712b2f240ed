"""The torch profile source: the graph of a real PyTorch model's training step, traced on meta tensors.

Importing this package does not import torch (configs validate without it); the functions below do,
and raise `MissingDependencyError` naming the extra to install when torch or transformers is missing.
The runtime (slackswap.runtime) names saved tensors with `slackswap.profile.torch.identity`, the same
scheme as the traced graph's tensor names. docs/torch_profile.md has the details.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.profile.torch.spec import TorchSpec

__all__ = ["TorchSpec", "build_torch_graph", "trace_model"]

_TRACES: dict[str, Any] = {}


def trace_model(model: ModelConfig, spec: TorchSpec) -> tuple[Any, float]:
    """(Trace, trace wall seconds; 0.0 when cached): one trace per (model, spec) per process."""
    import json

    from slackswap.profile.torch.workloads import build_workload, import_torch, meta_trace_patches

    import_torch()  # a named error, not an ImportError, when the extra is missing
    from slackswap.profile.torch.tracer import trace_step

    key = json.dumps([asdict(model), asdict(spec)], sort_keys=True, default=str)
    if key in _TRACES:
        return _TRACES[key], 0.0
    t0 = time.perf_counter()
    net, inputs, loss_fn = build_workload(model, spec, "meta")
    with meta_trace_patches(spec):
        trace = trace_step(net, inputs, loss_fn, semantics=spec.semantics, dtype=model.dtype)
    _TRACES[key] = trace
    return trace, time.perf_counter() - t0


def build_torch_graph(model: ModelConfig, spec: TorchSpec, hardware: Hardware) -> Graph:
    """The traced training step of `model` (built by `spec`) timed on `hardware`."""
    hardware.peak_for(model.dtype)
    trace, _ = trace_model(model, spec)
    from slackswap.profile.torch.assemble import graph_from_trace

    meta = {"model": asdict(model), "torch": asdict(spec)}
    return graph_from_trace(trace, hardware, f"{model.name}@{hardware.name}", meta)
