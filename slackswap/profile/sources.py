"""Profile sources: where the op graph of a training step comes from, chosen by name (the `profile`
config group of the pipeline). Each source is a function (model, hardware, training, **options) ->
Graph, imported only when chosen, so a source with heavy dependencies (torch) costs nothing to the
others.

- `analytic`: `slackswap.profile.build_graph`, the roofline model of docs/profile.md. No options.
- `torch`: `slackswap.profile.torch.profile_source`, the traced step of a real PyTorch model
  (docs/torch_profile.md); its options are `TorchSpec` fields.

A model preset with a `torch` node (conf/model/hf_*.yaml, tiny_torch.yaml) is a traced preset: the
node selects the `torch` source and is its options (`select_source`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from slackswap.errors import ConfigError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.model_config import ModelConfig
from slackswap.parallel import NO_PARALLELISM, ParallelConfig

#: Source name -> "module:function".
PROFILE_SOURCES: Mapping[str, str] = {
    "analytic": "slackswap.profile:build_graph",
    "torch": "slackswap.profile.torch:profile_source",
}


def check_profile_source(source: object) -> None:
    if source not in PROFILE_SOURCES:
        raise ConfigError("profile.source", source, f"unknown profile source; known: {sorted(PROFILE_SOURCES)}")


def select_source(
    source: str, options: Mapping[str, Any], torch_node: Mapping[str, Any] | None
) -> tuple[str, dict[str, Any]]:
    """(source, options) of a job: `profile.source` and `profile.options`, unless the model preset has
    a `torch` node, which selects the `torch` source with the node as its options. A traced preset
    with `profile.options` as well is a ConfigError: two places would set the same trace."""
    check_profile_source(source)
    if torch_node is None:
        return source, dict(options)
    if options:
        why = "the model preset's `torch` node sets the trace; leave profile.options empty"
        raise ConfigError("profile.options", dict(options), why)
    return "torch", dict(torch_node)


def profile_graph(
    source: str,
    model: ModelConfig,
    hardware: Hardware,
    training: TrainingConfig | None = None,
    parallel: ParallelConfig | None = None,
    **options: Any,
) -> Graph:
    """The graph of `model` on `hardware` (and `training` recipe) from profile source `source` with its
    keyword options; under `parallel` (analytic source only), one rank's graph."""
    check_profile_source(source)
    if training is not None and training.fp8_linear_inputs and source != "analytic":
        raise ConfigError("training.fp8_linear_inputs", True,
                          f"the {source} profile source saves what the traced model saves; FP8 copies are analytic")
    module_name, function_name = PROFILE_SOURCES[source].split(":")
    build = getattr(importlib.import_module(module_name), function_name)
    if source == "analytic" and options:
        raise ConfigError("profile.options", dict(options), "the analytic source takes no options")
    if parallel is not None and parallel != NO_PARALLELISM:
        if source != "analytic":
            raise ConfigError("parallel", parallel.as_dict(),
                              f"the {source} profile source builds one full replica; per-rank graphs are analytic")
        return build(model, hardware, training, parallel=parallel)
    return build(model, hardware, training, **options)
