"""The collectives a run's parallel layout adds to its step: priced on the node's fabrics, and the part
the step waits on added to the simulated figures. Apart from `run` so that the pipeline run
(`pipeline_run`) and the one-stage run (`run`) price them alike without importing each other."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slackswap.experiment.advise_node import topology_from_node
from slackswap.experiment.spec import RunSpec
from slackswap.graph import Graph


def layout_communication(spec: RunSpec, graph: Graph):
    """The collectives `graph`'s layout adds, priced on the node's fabrics with their exposed part
    (`slackswap.profile.collectives.price`); None for one full replica."""
    from slackswap.parallel import NO_PARALLELISM
    from slackswap.profile import layout_collectives
    from slackswap.profile.collectives import price

    if spec.parallel == NO_PARALLELISM:
        return None
    topology = None
    if spec.node is not None:
        topology = topology_from_node(spec.node, spec.hardware)
    return price(layout_collectives(graph), spec.parallel, topology, spec.node.name if spec.node else "", graph=graph)


def with_layout_comm(simulation: Mapping[str, Any], layout_comm_s: float | None) -> Mapping[str, Any]:
    """The simulation's step figures with the layout's exposed collective time added (the compute step
    plus `layout_comm_s`, which the simulated graph does not wait on), the keep-all step and the
    planner's bound likewise, and the ratios taken again. No exposed time (no layout, nothing priced,
    or none on the critical path): `simulation` itself, so a run without a layout is unchanged."""
    if not layout_comm_s:
        return simulation
    out = dict(simulation)
    for key in ("step_s", "ideal_step_s", "bound_step_s"):
        if out[key] is not None:
            out[key] += layout_comm_s
    step, ideal, bound = out["step_s"], out["ideal_step_s"], out["bound_step_s"]
    out["throughput_ratio"] = None if step is None else ideal / step
    out["optimality_gap"] = None if step is None or bound is None else (step - bound) / bound
    return out
