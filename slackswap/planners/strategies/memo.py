"""`memo`: MEMO's swap-fraction rule (Zhao, Zhang, Fu, Nie, Liu, Yang, Peng, Jiao, Li, Xue, Tao, Cui,
"MEMO: Fine-grained Tensor Management For Ultra-long Context LLM Training", SIGMOD 2025,
arXiv 2407.12117).

MEMO offloads a layer's activations to host memory after the layer's forward pass and fetches them
back for its backward pass. To swap as much as possible *without hindering computation*, it swaps
only a fraction alpha of each layer's activations (token-wise: the activations of alpha of the
tokens) and recomputes the rest (1 - alpha) from the layer's input in backward. alpha is sized so
that the transfer hides behind the layer's compute:

    alpha_l = min(1, t_fwd(l) * B_d2h / M_l, t_bwd(l) * B_h2d / M_l)

with M_l the layer's saved activation bytes and t_fwd / t_bwd its forward / backward compute time.
MEMO applies this to every layer, whatever the budget: the plan either fits or the budget is
infeasible for MEMO.

Departures from the paper (docs/planners.md):
- tensors are atomic here (the graph has no token dimension), so alpha of a layer's bytes is
  approximated by whole tensors: the layer's saved non-boundary tensors are taken, most expensive to
  regenerate per byte first, while the summed copy times (latency included) stay within t_fwd and
  t_bwd (the same "never stalls" rule, per tensor); the rest are recomputed;
- the layer input (the boundary tensor) stays on the device, as the checkpoint the recompute starts
  from (MEMO keeps the input of the recomputed tokens);
- MEMO's bi-level MIP for memory fragmentation has no counterpart: the simulator has no fragmentation.
"""

from __future__ import annotations

from slackswap.graph import NO_LAYER, Graph, Phase
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget
from slackswap.planners.registry import register_planner
from slackswap.planners.support.analysis import analyse
from slackswap.planners.support.budget_check import build_within_budget


def memo_alpha(layer_bytes: int, fwd_s: float, bwd_s: float, hardware: Hardware) -> float:
    """MEMO's swap fraction: the largest share of the layer's bytes whose copies fit its compute time."""
    if layer_bytes <= 0:
        return 1.0
    link = hardware.link
    d2h = fwd_s * link.d2h_effective_bytes_per_s / link.d2h_engines
    h2d = bwd_s * link.h2d_effective_bytes_per_s / link.h2d_engines
    return min(1.0, d2h / layer_bytes, h2d / layer_bytes)


def memo_decisions(graph: Graph, hardware: Hardware) -> tuple[dict[str, Decision], dict[int, float]]:
    """Decisions of MEMO's rule and the alpha of each layer."""
    analysis = analyse(graph, hardware)
    infos = analysis.tensors
    decisions = {t: Decision.KEEP for t in infos}
    fwd_s: dict[int, float] = {}
    bwd_s: dict[int, float] = {}
    for op in graph.ops:
        if op.layer == NO_LAYER:
            continue
        if op.phase == Phase.FORWARD:
            fwd_s[op.layer] = fwd_s.get(op.layer, 0.0) + op.duration_s
        elif op.phase == Phase.BACKWARD:
            bwd_s[op.layer] = bwd_s.get(op.layer, 0.0) + op.duration_s
    by_layer: dict[int, list[str]] = {}
    for t, info in infos.items():
        if info.layer != NO_LAYER and not info.boundary and info.size_bytes > 0:
            by_layer.setdefault(info.layer, []).append(t)
    alphas = {}
    for layer, tensors in sorted(by_layer.items()):
        alphas[layer] = memo_alpha(sum(infos[t].size_bytes for t in tensors), fwd_s.get(layer, 0.0),
                                   bwd_s.get(layer, 0.0), hardware)
        d2h_left, h2d_left = fwd_s.get(layer, 0.0), bwd_s.get(layer, 0.0)
        for t in sorted(tensors, key=lambda t: (-infos[t].regen_s / infos[t].size_bytes, t)):
            if infos[t].d2h_s <= d2h_left and infos[t].h2d_s <= h2d_left:
                decisions[t] = Decision.SWAP
                d2h_left -= infos[t].d2h_s
                h2d_left -= infos[t].h2d_s
            else:
                decisions[t] = Decision.RECOMPUTE
    return decisions, alphas


@register_planner("memo")
class Memo:
    name = "memo"

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        decisions, alphas = memo_decisions(graph, hardware)
        swapped = sum(graph.tensors[t].size_bytes for t, d in decisions.items() if d == Decision.SWAP)
        dropped = sum(graph.tensors[t].size_bytes for t, d in decisions.items() if d != Decision.KEEP)
        return build_within_budget(
            graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
            what="MEMO's swap-alpha-recompute-the-rest plan (every layer alike, whatever the budget)",
            notes={
                "memo_alpha_mean": sum(alphas.values()) / max(len(alphas), 1),
                "memo_alpha_min": min(alphas.values(), default=1.0),
                "memo_swapped_share_of_dropped_bytes": swapped / dropped if dropped else 0.0,
            },
        )
