"""`full_recompute`: gradient checkpointing (Chen, Xu, Zhang, Guestrin, "Training Deep Nets with
Sublinear Memory Cost", arXiv 1604.06174, 2016).

Keep only checkpoints and the activations outside the transformer stack (embedding, head, loss);
drop every other saved activation and regenerate it in backward from the nearest checkpoint below.
`segments` picks the checkpoints (conf/planner/full_recompute.yaml):
- `every_layer`: every layer boundary (the tensors a layer hands to the next,
  `analysis.boundary_tensors`), saved by autograd or not (a checkpoint candidate: the residual
  stream of a traced pre-norm model), as Megatron's "full" activation recompute (Korthikanti et al. 2022);
  each layer is recomputed from its own input.
- `sqrt`: Chen et al.'s sqrt(n) segmenting with the transformer layer as the unit: segments of
  ceil(sqrt(L)) consecutive layers; only the boundaries entering a segment are kept, and the first
  backward use in a segment regenerates the whole segment forward once (`build_schedule` shares a
  regenerated copy with every later reader), so its activations are alive together, as in the paper.
  Memory O(sqrt(L)) segment checkpoints + one segment's activations; one extra forward pass.
The plan does not depend on the budget: it either fits or the budget is infeasible for this strategy.
Departure from the paper: Chen et al. segment a chain of ops; we segment layers (a layer's internal
tensors are always recomputed, a layer is the natural unit of a transformer stack).
"""

from __future__ import annotations

import math

from slackswap.errors import ConfigError
from slackswap.graph import FORWARD_PHASES, NO_LAYER, Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import boundary_tensors
from slackswap.planners.support.budget_check import build_within_budget

SEGMENTS: tuple[str, ...] = ("every_layer", "sqrt")


def full_recompute_decisions(graph: Graph) -> dict[str, Decision]:
    boundary = boundary_tensors(graph)
    out = {}
    for t in graph.saved_tensors:
        in_stack = graph.op_by_name[t.producer].layer != NO_LAYER
        out[t.name] = Decision.RECOMPUTE if in_stack and t.name not in boundary else Decision.KEEP
    return out | boundary_candidates(graph, boundary)


def boundary_candidates(graph: Graph, checkpoints: frozenset[str] | set[str]) -> dict[str, Decision]:
    """Keep the checkpoints autograd does not save (`Graph.candidate_tensors`): a traced pre-norm
    model's residual stream is read by the next layer's norm, which saves only its float32 copy, so
    without these the layer's recompute chain runs back to the embedding. Only the inputs of a layer
    (read by a stack op of another layer than their producer's), as torch.utils.checkpoint keeps its
    arguments: the last layer's output, read only outside the stack, is no layer's input."""
    ops = graph.op_by_name
    return {t.name: Decision.KEEP for t in graph.candidate_tensors
            if t.name in checkpoints and any(ops[c].layer not in (NO_LAYER, ops[t.producer].layer)
                                             for c in t.consumers)}


def segment_length(num_layers: int) -> int:
    """Chen et al.'s segment size: ceil(sqrt(n)) layers."""
    return max(1, math.ceil(math.sqrt(num_layers)))


def sqrt_segment_decisions(graph: Graph) -> dict[str, Decision]:
    """Keep a stack tensor only if a forward op of another *segment* reads it (a segment checkpoint)."""
    length = segment_length(graph.num_layers)

    def segment(layer: int) -> int:
        return NO_LAYER if layer == NO_LAYER else layer // length

    crosses: set[str] = set()
    for op in graph.ops:
        if op.phase not in FORWARD_PHASES:
            continue
        for t in op.inputs:
            if segment(graph.op_by_name[graph.tensors[t].producer].layer) != segment(op.layer):
                crosses.add(t)
    out = {}
    for t in graph.saved_tensors:
        in_stack = graph.op_by_name[t.producer].layer != NO_LAYER
        out[t.name] = Decision.RECOMPUTE if in_stack and t.name not in crosses else Decision.KEEP
    return out | boundary_candidates(graph, crosses)


@register_planner("full_recompute")
class FullRecompute:
    name = "full_recompute"

    def __init__(self, segments: str = "every_layer"):
        if segments not in SEGMENTS:
            raise ConfigError("planner.options.segments", segments, f"known: {SEGMENTS}")
        self.segments = segments

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        if self.segments == "sqrt":
            decisions = sqrt_segment_decisions(graph)
            notes = {"segments": "sqrt", "segment_layers": segment_length(graph.num_layers)}
        else:
            decisions = full_recompute_decisions(graph)
            notes = {"segments": "every_layer", "segment_layers": 1}
        return build_within_budget(
            graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
            what=f"full recompute ({self.segments})", notes=notes,
        )
