"""The advise's inputs, typed and checked before any work, and the search run from them.

`AdviseSpec.from_dict(config, presets)` takes plain mappings: `config` holds the nodes of one resolved
advise config (`model`, `hardware`, `node`, `profile`, `budget`, `advise`, optionally `parallel`), and
`presets` the training recipes and planners the search may name, by group and preset name
(`{"training": {"adamw_mixed": {...}}, "planner": {"milp": {"name": "milp", "options": {...}}}}`): the
pipeline reads them from `conf/`, a script may write them by hand. Every bad value raises one
`ConfigError` naming its dotted field and the value, here and not halfway through a search of
minutes. `spec.search(on_row)` then runs the search of `slackswap.experiment.advise` on the graphs,
per-rank hardware and host check the node gives (`slackswap.experiment.advise_node`).

Why a spec apart from the search: the search takes typed values and a graph function (it is also
called by benchmarks and tests on hand-built spaces); reading a config's presets, its profile source
and its node into those values is the one step every caller of the advise shares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from slackswap import validation as check
from slackswap.communication import Topology
from slackswap.errors import ConfigError
from slackswap.experiment.advise_space import Advice, Row, SearchSpace
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.node import Node

#: Where the search's graphs come from (`advise.graph`).
GRAPH_SOURCES = ("analytic", "traced")
#: Config groups a single run takes one preset of and the advise searches instead: group -> the field
#: that lists the presets searched.
SEARCHED_GROUPS = {"planner": "advise.planners", "training": "advise.recipes"}


def _preset(presets: Mapping[str, Mapping[str, Any]], group: str, name: Any, field_name: str) -> Mapping[str, Any]:
    known = presets.get(group) or {}
    if not isinstance(name, str) or name not in known:
        raise ConfigError(field_name, name, f"no preset conf/{group}/{name}.yaml; known: {', '.join(sorted(known))}")
    preset = known[name]
    if not isinstance(preset, Mapping):
        raise ConfigError(field_name, name, f"preset conf/{group}/{name}.yaml is not a mapping")
    return preset


def _names(field_name: str, value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(field_name, value, "must be a non-empty list of preset names")
    if len(set(value)) != len(value):
        raise ConfigError(field_name, list(value), "lists a preset twice")
    return list(value)


def _values(field_name: str, value: Any) -> tuple[Any, ...]:
    """A list of the config as a tuple; anything else (a scalar, a mapping) named, not iterated."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(field_name, value, "must be a list")
    return tuple(value)


def _schedule_names(value: Any) -> str | tuple[Any, ...]:
    """`advise.pipeline_schedule`: one schedule name, or a list of them (`SearchSpace` checks the names)."""
    return value if isinstance(value, str) else _values("advise.pipeline_schedule", value)


@dataclass(frozen=True)
class AdviseSpec:
    """Every input of one advise: what is trained, where, what is searched, and the notes printed with
    the answer (how the graphs were made, how the optimizer step is priced)."""

    model: ModelConfig
    hardware: Hardware
    node: Node
    topology: Topology
    space: SearchSpace
    #: "analytic" or "traced": where the search's graphs come from.
    graph: str
    profile_source: str
    profile_options: Mapping[str, Any] = field(default_factory=dict)
    #: Rows of the printed table (`advise.top`).
    top: int = 10
    notes: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], presets: Mapping[str, Mapping[str, Any]],
                  choices: Mapping[str, str] | None = None) -> AdviseSpec:
        """All checks of an advise before any work. `choices` (optional): the preset name each config
        group was composed from, to name a group in an error as the user chose it (`budget='half'`)."""
        from slackswap.budget import Budget
        from slackswap.experiment.advise_node import topology_from_node
        from slackswap.parallel import NO_PARALLELISM, ParallelConfig
        from slackswap.planners.registry import get_planner
        from slackswap.profile.sources import select_source

        choices = dict(choices or {})
        for group, instead in SEARCHED_GROUPS.items():
            if config.get(group) is not None:
                raise ConfigError(group, choices.get(group, config[group]),
                                  f"advise searches {instead}; list the presets there instead")
        for node_name in ("advise", "model", "hardware", "node", "profile", "budget"):
            if not isinstance(config.get(node_name), Mapping):
                raise ConfigError(node_name, config.get(node_name), "must be a mapping (a config node)")
        adv = dict(config["advise"])
        model_node = dict(config["model"])
        torch_node = model_node.pop("torch", None)
        profile = config["profile"]
        source, options = select_source(profile.get("source"), profile.get("options") or {}, torch_node)
        model = ModelConfig.from_dict(model_node)
        hardware = Hardware.from_dict(config["hardware"])
        hardware.peak_for(model.dtype)
        parallel = ParallelConfig.from_dict(config.get("parallel"))
        parallel.check_model(model)
        if parallel != NO_PARALLELISM:
            for gpus in adv.get("gpus") or ():
                if isinstance(gpus, int) and not isinstance(gpus, bool):
                    parallel.check_gpus(gpus, "advise.gpus")
            # Never silently ignored: the search chooses the layout itself.
            raise ConfigError("parallel", parallel.as_dict(),
                              "advise searches the layout: list degrees in advise.tp / advise.pp / advise.cp / "
                              "advise.ep and leave parallel at none")
        node = Node.from_dict(config["node"])
        budget = Budget.from_dict(config["budget"])
        if not budget.device:
            raise ConfigError("budget", choices.get("budget", "?"),
                              "advise plans against the device: use budget=device")
        graph = adv.get("graph")
        if graph not in GRAPH_SOURCES:
            raise ConfigError("advise.graph", graph, f"must be one of {GRAPH_SOURCES}")
        recipes = _recipes(adv, presets)
        planners = _planners(adv, presets, get_planner)
        top = check.integer("advise.top", adv.get("top"), 1)
        space = SearchSpace(
            gpus=_values("advise.gpus", adv.get("gpus")), recipes=recipes,
            micro_batches=_values("advise.micro_batches", adv.get("micro_batches")), planners=planners,
            plan_against=_values("advise.plan_against", adv.get("plan_against")),
            zero_stages=_values("advise.zero_stages", adv.get("zero_stages")),
            grad_accum=adv.get("grad_accum"), milp_top_k=adv.get("milp_top_k"), reserve_bytes=budget.reserve_bytes,
            margin_bytes=adv.get("margin_bytes", 0), tp=_values("advise.tp", adv.get("tp", [1])),
            pp=_values("advise.pp", adv.get("pp", [1])), cp=_values("advise.cp", adv.get("cp", [1])),
            ep=_values("advise.ep", adv.get("ep", [1])),
            sp=adv.get("sp", True),
            pipeline_microbatches=_values("advise.pipeline_microbatches", adv.get("pipeline_microbatches", [8])),
            pipeline_schedule=_schedule_names(adv.get("pipeline_schedule", "1f1b")),
            virtual_stages=_values("advise.virtual_stages", adv.get("virtual_stages", [2])),
            layout_top_n=adv.get("layout_top_n", 40),
            n_jobs=adv.get("n_jobs", 1), backend=adv.get("backend", "loky"),
        )
        topology = topology_from_node(node, hardware)
        for gpus in space.gpus:
            topology.fabric_for(gpus)  # a job wider than the node needs its network
        return cls(model, hardware, node, topology, space, graph, source, options, top,
                   _notes(model, source, options, graph))

    def search(self, on_row: Callable[[int, int, Row], None] | None = None) -> Advice:
        """Run the search (`slackswap.experiment.advise.run_search`) on this spec's graphs, each GPU
        count on the hardware one of its ranks plans on, offloads checked against the node's pinned
        host memory; `on_row(i, n, row)` after each evaluated configuration."""
        from slackswap.experiment.advise import run_search
        from slackswap.experiment.advise_node import graph_source, host_check, rank_hardware

        graphs = graph_source(self.model, self.hardware, self.graph, self.profile_source, self.profile_options)
        return run_search(self.model, self.hardware, self.topology, self.space, graphs, on_row=on_row,
                          rank_hardware=rank_hardware(self.hardware, self.node, self.space.gpus),
                          host_check=host_check(self.node), node=self.node)


def _recipes(adv: Mapping[str, Any], presets: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    from slackswap.memory.recipe import TrainingConfig

    return {name: TrainingConfig.from_dict(_preset(presets, "training", name, "advise.recipes"))
            for name in _names("advise.recipes", adv.get("recipes"))}


def _planners(adv: Mapping[str, Any], presets: Mapping[str, Mapping[str, Any]],
              get_planner: Callable[..., Any]) -> dict[str, dict[str, Any]]:
    planners: dict[str, dict[str, Any]] = {}
    for name in _names("advise.planners", adv.get("planners")):
        preset = _preset(presets, "planner", name, "advise.planners")
        options = preset.get("options") or {}
        if not isinstance(options, Mapping):
            raise ConfigError("advise.planners", name, f"preset conf/planner/{name}.yaml: options must be a mapping")
        planners[preset.get("name", name)] = dict(options)
        get_planner(preset.get("name", name), **options)  # unknown options fail here
    return planners


def _notes(model: ModelConfig, source: str, options: Mapping[str, Any], graph: str) -> tuple[str, ...]:
    """What the answer rests on that a reader should know: how the graphs were made and how the
    optimizer step is priced."""
    notes = []
    if source == "torch" and graph == "analytic":
        notes.append(
            f"graphs: the analytic {model.family} graph of {model.name}'s shape (attention "
            f"{'flash' if options.get('attention', 'sdpa') == 'sdpa' else 'eager'}), not the traced one: tracing "
            "costs seconds per micro-batch (advise.graph=traced searches on traced graphs, cached per micro-batch)"
        )
    if source == "torch" and graph == "traced":
        notes.append(f"graphs: traced from the torch model of {model.name}, once per micro-batch")
    if model.include_optimizer:
        notes.append("model.include_optimizer: the advise prices the optimizer step itself, from the recipe")
    else:
        notes.append("optimizer step: included in every step (advise prices whole training steps)")
    return tuple(notes)

