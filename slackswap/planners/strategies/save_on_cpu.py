"""`save_on_cpu`: `with torch.autograd.graph.save_on_cpu(pin_memory=True): loss = model(batch)` (torch
2.13, torch/autograd/graph.py): every saved tensor offloaded, priced as that tool runs its copies
(offloader `save_on_cpu`: copies on the compute stream, fetched at unpack, a pinned allocation per
tensor; `slackswap.schedule.offloader`, `slackswap.planners.support.tool_offload`).
"""

from __future__ import annotations

from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.support.tool_offload import build_for_offloader, pin_option
from slackswap.schedule.offloader import PIN_S_PER_TENSOR, get_offloader


@register_planner("save_on_cpu")
class SaveOnCpu:
    name = "save_on_cpu"

    def __init__(self, pin_s_per_tensor: float = PIN_S_PER_TENSOR):
        self.offloader = get_offloader("save_on_cpu", pin_s_per_tensor=pin_option(pin_s_per_tensor))

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        decisions = {t.name: Decision.SWAP if t.size_bytes > 0 else Decision.KEEP for t in graph.saved_tensors}
        return build_for_offloader(graph, decisions, self.offloader, planner=self.name, budget_bytes=budget_bytes,
                                   hardware=hardware, what="offloading every saved tensor")
