"""`torch_sac_torchtitan`: torchtitan's default selective activation checkpointing, as its runs apply it.

torchtitan (`activation_checkpoint.mode = "selective"`, `selective_ac_option = "op"`,
torchtitan/models/llama3/infra/parallelize.py, `_apply_ac_to_transformer_block`) wraps every
transformer block in non-reentrant `torch.utils.checkpoint` with a selective-checkpoint policy made
fresh per block call: an op in its `_save_list` (aten `mm`, the fused scaled-dot-product attention
kernels, ...) is MUST_SAVE, except every second `mm` of the block (the policy counts `mm` calls and
recomputes the even-numbered ones); everything else is PREFER_RECOMPUTE. So a block keeps its input,
the attention kernel's outputs and the outputs of its 1st, 3rd, 5th ... matmul, and recomputes the
rest in backward. This is the policy behind torchtitan's published Llama runs with selective AC.

How the graph maps onto it: torchtitan's models project Q, K and V with three `mm` calls (wq, wk,
wv), so the fused QKV op of `slackswap.profile` counts as three matmuls, one per output in Q, K, V
order (Q and V kept, K recomputed; recomputing K re-runs the fused op, so its recompute cost is the
whole QKV GEMM's, an overstatement of wk's). Eager attention's batched matmuls (`bmm`) are not in
`_save_list`: with `model.attention=eager` the attention core is recomputed; with `flash` the fused
kernel's outputs are kept. Everything outside the blocks (embeddings, final norm, head, loss) is
what autograd saves, as with `torch_sac`. The plan does not depend on the budget: it fits or is
infeasible.
"""

from __future__ import annotations

from slackswap.graph import Graph, OpClass, Phase
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.strategies.torch_sac import sac_decisions
from slackswap.planners.support.budget_check import build_within_budget


def torchtitan_cached(graph: Graph) -> set[str]:
    """The forward outputs torchtitan's "op" policy caches, per block: the fused attention kernel's,
    and those of the odd-numbered matmuls (module docstring)."""
    cached: set[str] = set()
    mm_count: dict[int, int] = {}
    for op in graph.ops:
        if op.phase != Phase.FORWARD:
            continue
        if op.op_class == OpClass.ATTENTION and len(op.inputs) >= 3:
            cached.update(op.outputs)  # a fused kernel reads Q, K and V at once; an eager bmm reads two
        elif op.op_class == OpClass.MATMUL:
            for out in op.outputs:  # the fused QKV op: one mm per output (wq, wk, wv)
                mm_count[op.layer] = mm_count.get(op.layer, 0) + 1
                if mm_count[op.layer] % 2 == 1:
                    cached.add(out)
    return cached


@register_planner("torch_sac_torchtitan")
class TorchSACTorchtitan:
    name = "torch_sac_torchtitan"

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        cached = torchtitan_cached(graph)
        decisions = sac_decisions(graph, "matmuls", cached=cached.__contains__)
        return build_within_budget(
            graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
            what="torchtitan selective checkpointing (save attention and every other matmul)",
            notes={"policy": "torchtitan_op", "cached_outputs": len(cached)},
        )
