"""The simulator's saved-tensor peak, the figure the runtime's ledger is compared with (no torch).

The ledger counts saved tensors only, and on the CPU a copy has arrived when it is issued. The
matching simulation is the same plan on the same graph with every tensor that is not saved weighing
0 bytes (transients and activation gradients drop out of the memory curve, nothing else changes)
and a host link that takes no time, with no budget. It lives with the simulator, so the runtime
(another executor) does not import the simulator (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import replace

from slackswap.graph import Graph
from slackswap.hardware import Hardware, HostLink
from slackswap.plan import Plan
from slackswap.simulate.engine import simulate

#: A link that moves any tensor of this project in far less than one op's duration.
_INSTANT_BYTES_PER_S = 1e30


def saved_only(graph: Graph) -> Graph:
    tensors = {name: t if t.saved else replace(t, size_bytes=0) for name, t in graph.tensors.items()}
    return replace(graph, tensors=tensors, name=f"{graph.name}/saved-only")


def instant_link(hardware: Hardware) -> Hardware:
    link = HostLink(
        name="instant",
        d2h_theoretical_bytes_per_s=_INSTANT_BYTES_PER_S,
        h2d_theoretical_bytes_per_s=_INSTANT_BYTES_PER_S,
        d2h_effective_bytes_per_s=_INSTANT_BYTES_PER_S,
        h2d_effective_bytes_per_s=_INSTANT_BYTES_PER_S,
        latency_s=0.0,
    )
    return replace(hardware, link=link, name=f"{hardware.name}/instant-link")


def simulated_saved_peak_bytes(graph: Graph, plan: Plan, hardware: Hardware, instant: bool = True) -> int:
    """Peak of saved bytes on the device when the simulator executes `plan` (no budget)."""
    weighed = saved_only(graph)
    # The same ops and tensors with other weights: the plan is re-addressed to the re-weighed graph on
    # purpose (its fingerprint covers sizes, so the plan's own fingerprint would be refused).
    plan = replace(plan, graph_fingerprint=weighed.fingerprint)
    result = simulate(weighed, plan, instant_link(hardware) if instant else hardware, None)
    return result.peak_activation_bytes
