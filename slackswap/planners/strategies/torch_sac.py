"""`torch_sac`: PyTorch's selective activation checkpointing as its users apply it, per layer.

`torch.utils.checkpoint.checkpoint(layer, ..., use_reentrant=False,
context_fn=partial(create_selective_checkpoint_contexts, policy))` around every transformer layer, with
one of the two policies users write (torchtitan's `_save_list`, the PyTorch SAC tutorial):
- `matmuls`: `CheckpointPolicy.MUST_SAVE` for every matmul output (aten mm / addmm, the attention
  batched matmuls bmm / baddbmm, fused sdpa kernels), `PREFER_RECOMPUTE` for everything else;
- `matmuls_except_attention_core`: the same without the attention core's products (bmm / baddbmm /
  sdpa: the s^2 scores and the fused kernels), which are cheap per byte.

What the checkpointed step then holds at the end of forward, and what this planner keeps:
- the inputs of each checkpointed layer (checkpoint saves its arguments): the layer boundaries,
  saved by autograd or not (the residual stream of a pre-norm model is a checkpoint candidate,
  `Graph.candidate_tensors`);
- every output of a policy op inside a layer (SAC's cache), saved by autograd or not;
- what autograd saves outside the checkpointed layers (embeddings, final norm, head, loss), and a
  layer's tensor that an op outside its layer saves (the last layer's output, saved by the final norm);
- everything else autograd saves inside a layer is recomputed in that layer's backward, from the
  kept tensors.
The plan does not depend on the budget: it fits or is infeasible. Differences from the real mechanism
on the CPU are in docs/planners.md ("torch_sac and torch_budget against PyTorch").
"""

from __future__ import annotations

from collections.abc import Callable

from slackswap.errors import ConfigError
from slackswap.graph import FORWARD_PHASES, NO_LAYER, Graph, OpClass, Phase
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import boundary_tensors
from slackswap.planners.support.budget_check import build_within_budget

POLICIES: tuple[str, ...] = ("matmuls", "matmuls_except_attention_core")


def policy_saves(graph: Graph, op_name: str, policy: str) -> bool:
    """Whether `policy` marks the forward op MUST_SAVE (its outputs go to SAC's cache)."""
    op = graph.op_by_name[op_name]
    if policy == "matmuls":
        return op.op_class in (OpClass.MATMUL, OpClass.ATTENTION)
    return op.op_class == OpClass.MATMUL and not op.attention_core


def sac_decisions(graph: Graph, policy: str, cached: Callable[[str], bool] | None = None) -> dict[str, Decision]:
    """Keep / recompute per saved tensor and keep per checkpoint candidate (module docstring).

    `cached(tensor)`: whether SAC's cache holds that forward output (default: its producer is a
    `policy` op); a policy that decides per output, not per op, passes its own (torch_sac_torchtitan)."""
    boundary = boundary_tensors(graph)
    ops = graph.op_by_name
    if cached is None:
        def cached(name: str) -> bool:
            return policy_saves(graph, graph.tensors[name].producer, policy)
    out: dict[str, Decision] = {}
    for t in graph.saved_tensors:
        layer = ops[t.producer].layer
        read_outside = any(ops[c].phase == Phase.BACKWARD and ops[c].layer != layer for c in t.consumers)
        keep = (layer == NO_LAYER or t.name in boundary or read_outside
                or ops[t.producer].phase not in FORWARD_PHASES or cached(t.name))
        out[t.name] = Decision.KEEP if keep else Decision.RECOMPUTE
    for t in graph.candidate_tensors:
        if t.name in boundary and any(ops[c].layer != NO_LAYER for c in t.consumers):
            out[t.name] = Decision.KEEP  # a checkpointed layer's input
        elif ops[t.producer].layer != NO_LAYER and cached(t.name):
            out[t.name] = Decision.KEEP
    return out


@register_planner("torch_sac")
class TorchSAC:
    name = "torch_sac"

    def __init__(self, policy: str = "matmuls"):
        if policy not in POLICIES:
            raise ConfigError("planner.options.policy", policy, f"known: {POLICIES}")
        self.policy = policy

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        decisions = sac_decisions(graph, self.policy)
        kept_candidates = sum(1 for t in graph.candidate_tensors if t.name in decisions)
        return build_within_budget(
            graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
            what=f"selective checkpointing per layer (policy {self.policy})",
            notes={"policy": self.policy, "kept_candidates": kept_candidates},
        )
