"""Profile sources: where the op graph of a training step comes from, chosen by name (`profile=` in
the pipeline config). Each source is a function (model, hardware, training, **options) -> Graph, imported only
when chosen, so a source with heavy dependencies (torch) costs nothing to the others.

- `analytic`: `slackswap.profile.build_graph`, the roofline model of docs/profile.md.
A traced source (torch) is registered here beside it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from slackswap.errors import ConfigError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.memory.training import TrainingConfig
from slackswap.model_config import ModelConfig

#: Source name -> "module:function".
PROFILE_SOURCES: Mapping[str, str] = {
    "analytic": "slackswap.profile:build_graph",
}


def check_profile_source(source: str) -> None:
    if source not in PROFILE_SOURCES:
        raise ConfigError("profile.source", source, f"unknown profile source; known: {sorted(PROFILE_SOURCES)}")


def profile_graph(
    source: str, model: ModelConfig, hardware: Hardware, training: TrainingConfig | None = None, **options: object
) -> Graph:
    """The graph of `model` on `hardware` (and `training` recipe) from profile source `source` with its
    keyword options."""
    check_profile_source(source)
    module_name, function_name = PROFILE_SOURCES[source].split(":")
    build = getattr(importlib.import_module(module_name), function_name)
    try:
        return build(model, hardware, training, **options)
    except TypeError as exc:
        if options:
            raise ConfigError(f"profile.options ({source})", sorted(options), f"not accepted: {exc}") from None
        raise
