"""The run spec: every input of one run, typed, validated before any work.

`RunSpec.from_dict(config)` takes the plain mapping of a resolved config (the pipeline's Hydra config
turned into dicts, or a dict written by hand) with the nodes `model`, `hardware`, `budget`, `planner`,
and optionally `training`, `profile` and `simulate`. Every bad value raises `ConfigError` naming its
field and value, here and not halfway through a run; the planner is built here once (unknown names
and options fail before profiling) and the same instance plans the run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slackswap.budget import Budget
from slackswap.errors import ConfigError
from slackswap.experiment.fitting import FitOptions
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.model_config import ModelConfig
from slackswap.node import Node
from slackswap.parallel import NO_PARALLELISM, ParallelConfig
from slackswap.planners.base import Planner
from slackswap.profile.torch.spec import TorchSpec


def hardware_from_config(config: Mapping[str, Any]) -> tuple[Hardware, Node | None, Any]:
    """The device a run is planned for, with the node around it. The one place a run's hardware is
    built from its config: on a node (`config["node"]`), the per-rank `Hardware` whose host link runs at
    the rates sharing leaves each GPU (`slackswap.sharing`), the `Node`, and that `SharedLink`; with no
    node, the preset's hardware as given and None, None."""
    from slackswap.sharing import shared_hardware

    hardware = Hardware.from_dict(config["hardware"])
    if config.get("node") is None:
        return hardware, None, None
    node = Node.from_dict(config["node"])
    shared, link = shared_hardware(hardware, node)
    return shared, node, link


def _alone(config: Mapping[str, Any], hardware: Hardware) -> Hardware | None:
    """The preset's hardware when the node changed it (the GPU alone on its link), else None."""
    preset = Hardware.from_dict(config["hardware"])
    return None if preset == hardware else preset


@dataclass(frozen=True)
class RunSpec:
    model: ModelConfig
    #: The per-rank hardware (on `node`: its link at the rates this GPU really gets).
    hardware: Hardware
    budget: Budget
    planner_name: str
    planner_options: Mapping[str, Any]
    training: TrainingConfig = field(default_factory=TrainingConfig)
    fit: FitOptions = field(default_factory=FitOptions)
    #: `slackswap.profile.sources` name and options (a preset's `torch` node selects `torch`).
    profile_source: str = "analytic"
    profile_options: Mapping[str, Any] = field(default_factory=dict)
    #: Set when the source is `torch`: the graph is traced from the real model.
    torch_spec: TorchSpec | None = None
    #: Identity of the workload (model, hardware, training and profile nodes as given): runs with equal
    #: keys profile the same graph, so a process profiles it once (`slackswap.experiment.baseline`).
    workload_key: str = ""
    #: The server (conf/node) and what sharing it left each GPU (`slackswap.sharing.SharedLink`); None
    #: for a spec given without a node.
    node: Node | None = None
    shared_link: Any = field(default=None, compare=False)
    #: The GPU alone on its preset link, kept when the node changed the link: the run also plans and
    #: simulates it there, so a table can show what sharing cost (`alone_throughput_ratio`).
    alone_hardware: Hardware | None = field(default=None, compare=False)
    #: The planner, built once from `planner_name` and `planner_options`.
    planner: Planner | None = field(default=None, compare=False, repr=False)
    #: The parallel layout (conf/parallel); the graph is one rank's (docs/profile.md, "Per-rank graphs").
    parallel: ParallelConfig = NO_PARALLELISM

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> RunSpec:
        """All value checks of a run, before any work starts. Raises `ConfigError` naming the field."""
        from slackswap.planners.registry import get_planner
        from slackswap.profile.sources import select_source
        from slackswap.profile.torch import spec_from_options

        for node in ("model", "hardware", "budget", "planner"):
            if not isinstance(config.get(node), Mapping):
                raise ConfigError(node, config.get(node), "must be a mapping (a config node)")
        planner = config["planner"]
        name = planner.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError("planner.name", name, "must be a non-empty planner name")
        options = planner.get("options") or {}
        if not isinstance(options, Mapping):
            raise ConfigError("planner.options", options, "must be a mapping of the planner's options")
        model = dict(config["model"])
        torch_node = model.pop("torch", None)
        profile = config.get("profile") or {"source": "analytic"}
        if profile.get("timing", "roofline") != "roofline":  # never a roofline run that says "measured"
            raise ConfigError("profile.timing", profile.get("timing"),
                              "measured op times need a real step on a device: python -m pipelines.train")
        source, profile_options = select_source(profile.get("source"), profile.get("options") or {}, torch_node)
        model_config = ModelConfig.from_dict(model)
        hardware, node, shared_link = hardware_from_config(config)
        training = TrainingConfig.from_dict(config.get("training") or {})
        parallel = ParallelConfig.from_dict(config.get("parallel"))
        parallel.check_model(model_config)
        if parallel != NO_PARALLELISM and source != "analytic":
            raise ConfigError("parallel", parallel.as_dict(), "per-rank graphs are analytic; the torch source traces "
                              "one full replica (use parallel=none or an analytic model preset)")
        if training.fp8_linear_inputs and source != "analytic":
            raise ConfigError("training.fp8_linear_inputs", True, "FP8 copies of linear inputs are modelled by "
                              "the analytic profile; the torch source saves what the traced model saves")
        hardware.peak_for(model_config.dtype)  # e.g. bf16 on a V100: ConfigError naming model.dtype
        training.check_model_dtype(model_config.dtype)
        workload = {
            "model": config["model"],
            "hardware": config["hardware"],
            "node": config.get("node"),
            "training": config.get("training"),
            "profile": config.get("profile"),
        }
        if parallel != NO_PARALLELISM:  # one full replica keeps the key it always had
            workload["parallel"] = parallel.as_dict()
        return cls(
            model=model_config,
            hardware=hardware,
            budget=Budget.from_dict(config["budget"]),
            planner_name=name,
            planner_options=dict(options),
            training=training,
            fit=FitOptions.from_dict(config.get("simulate")),
            profile_source=source,
            profile_options=profile_options,
            torch_spec=spec_from_options(model_config, profile_options) if source == "torch" else None,
            workload_key=json.dumps(workload, sort_keys=True, default=str),
            node=node,
            shared_link=shared_link,
            alone_hardware=_alone(config, hardware),
            # Unknown planner names and options fail here, before profiling, naming what was asked for.
            planner=get_planner(name, **options),
            parallel=parallel,
        )

    @property
    def tokens_per_step(self) -> int | float:
        """Tokens one GPU processes per step: micro-batch x sequence length (x the pipeline's
        micro-batches), shared by the tp x cp (x pp) ranks that work on them together under a layout."""
        tokens = self.model.micro_batch_size * self.model.seq_len * self.parallel.microbatches
        shared = self.parallel.tp * self.parallel.cp * self.parallel.pp
        return tokens // shared if tokens % shared == 0 else tokens / shared
