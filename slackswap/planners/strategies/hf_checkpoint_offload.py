"""`hf_checkpoint_offload`: Hugging Face's `activation_checkpointing_enable(offload=True)` (transformers
5.24 modeling_utils.py): every decoder layer checkpointed (`full_recompute`'s decisions) with the
checkpoint run under `save_on_cpu(pin_memory=True)`, which moves what non-reentrant checkpointing
saves, the layer's inputs, to pinned host memory; the tensors recomputed in backward are saved by
checkpoint's own inner hooks and stay on the device. Priced as that tool runs its copies (offloader
`save_on_cpu`; `slackswap.schedule.offloader`).

A layer input is a boundary tensor (`boundary_tensors`) that a forward op of another layer of the stack
reads: the residual stream, and on traced graphs what every layer is handed (rotary cos / sin). Only
those autograd saves are offloaded; a checkpoint candidate (`Graph.candidate_tensors`, a layer input
autograd does not save) stays kept as in `full_recompute`: slackswap's runtime, which the tests run
every planner's plan on (tests/test_runtime_exact.py), refuses hook-only steps for a swapped
candidate and holds its prefetched copy past the plan's release. Where HF would offload such a
tensor, this baseline is flattered by one kept tensor per layer.
"""

from __future__ import annotations

from slackswap.graph import FORWARD_PHASES, NO_LAYER, Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.strategies.full_recompute import full_recompute_decisions
from slackswap.planners.support.analysis import boundary_tensors
from slackswap.planners.support.tool_offload import build_for_offloader, pin_option
from slackswap.schedule.offloader import PIN_S_PER_TENSOR, get_offloader


@register_planner("hf_checkpoint_offload")
class HfCheckpointOffload:
    name = "hf_checkpoint_offload"

    def __init__(self, pin_s_per_tensor: float = PIN_S_PER_TENSOR):
        self.offloader = get_offloader("save_on_cpu", pin_s_per_tensor=pin_option(pin_s_per_tensor))

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        ops = graph.op_by_name
        boundary = boundary_tensors(graph)
        decisions = full_recompute_decisions(graph)
        for name, decision in decisions.items():
            tensor = graph.tensors[name]
            # A layer's checkpoint input: a boundary tensor a forward op of another layer of the stack reads.
            same_or_outside = (NO_LAYER, ops[tensor.producer].layer)
            if (decision is Decision.KEEP and tensor.saved and name in boundary and tensor.size_bytes > 0
                    and any(ops[c].phase in FORWARD_PHASES and ops[c].layer not in same_or_outside
                            for c in tensor.consumers)):
                decisions[name] = Decision.SWAP
        return build_for_offloader(graph, decisions, self.offloader, planner=self.name, budget_bytes=budget_bytes,
                                   hardware=hardware, what="checkpointing every layer and offloading its input")
