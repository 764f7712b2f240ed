"""The analytic graph of a mixture-of-experts MLP (`model.moe`), one rank's share under expert parallelism.

Replaces the dense SwiGLU MLP of a llama-family layer (Mixtral, Jiang et al. 2024, arXiv 2401.04088,
section 2.1; Qwen3-MoE; Megatron-Core's MoELayer). Ops, on T = s / cp x b tokens of this rank:

1. router: x W_r, a [T, E] GEMM (no bias); saves x.
2. softmax in fp32 (HF Mixtral / Qwen3-MoE `softmax(router_logits, dtype=float)`, Megatron-Core
   `moe_router_dtype=fp32`); saves its fp32 output.
3. top-k: the k routing weights (fp32, renormalised to sum 1 where the model does, fused here) and
   their int64 expert indices (torch.topk); backward scatters through the indices.
4. dispatch (permute): each token row copied to its k experts; backward reads the indices.
5. per expert held by this rank (E / ep of them): gate, up, SwiGLU, down on L tokens, where L is
   `MoEConfig.planned_tokens_per_expert` (the load rule: a stated percentile, bounded by the capacity).
6. combine (unpermute): y_t = sum_i w_{t,i} expert_out; backward reads the expert outputs (for the
   weights' gradient) and the weights (for the outputs' gradient).

Saved bytes of one MoE MLP (elt: model dtype bytes; the formula of docs/profile.md, "Mixture of experts"):
    T h elt  +  4 T E  +  12 T k  +  (E / ep) L (2 h + 3 f_e) elt
(router input; fp32 probabilities; fp32 weights + int64 indices; per expert its input, gate, up,
SwiGLU output and down output). Under ep > 1 the combine's expert outputs are counted as this rank's
experts' outputs: the all-to-all is a permutation, so the rows a rank sends back equal the rows it
receives at the mean load.

Shared experts (`num_shared_experts` > 0, DeepSeek-V3): one SwiGLU of width f_s = num_shared_experts x f_e
on all T tokens of the rank, beside the routed ones, added to the combine's output; it reads the same
input as the router (saved once) and adds 3 T f_s elt (gate, up, SwiGLU outputs) to the formula.
Routing keeps the fp32 scores (softmax or sigmoid) and the top-k weights and indices; DeepSeek-V3's
group-limited selection (n_group, topk_group), its bias-adjusted choice (the auxiliary-loss-free
balancing bias, which takes no gradient) and its routed_scaling_factor change which experts are picked
or a scale, not the sizes: they are not ops here.
"""

from __future__ import annotations

from slackswap.graph import OpClass
from slackswap.profile.collectives import Collective

#: torch.softmax(..., dtype=torch.float) and the top-k weights: fp32.
ROUTER_PROB_BYTES = 4
#: torch.topk returns int64 indices.
INDEX_BYTES = 8


def _expert_linear(fb, name: str, layer: int, x: str, rows: int, d_in: int, d_out: int, role: str) -> str:
    """One expert GEMM on `rows` tokens (no bias): 2 rows d_in d_out FLOPs, backward twice that."""
    elt = fb.shape.elt
    fb._count(layer, d_in * d_out)
    flops = 2.0 * rows * d_in * d_out
    w_bytes = d_in * d_out * elt
    y = fb.g.tensor(f"{name}.out", rows * d_out * elt, f"{role}_out")
    fb.g.forward(name, OpClass.MATMUL, layer, (x,), (y,), role=role, flops=flops, extra_bytes=w_bytes,
                 bwd_reads=(x,), bwd_flops=2 * flops, bwd_extra_bytes=2 * w_bytes)
    return y


def _all_to_all(fb, name: str, layer: int, size_bytes: int, what: str) -> None:
    ep = fb.par.ep
    if ep == 1:
        return
    fb.collectives.append(Collective(name, layer, "forward", "all_to_all", "ep", ep, size_bytes, what))
    fb.collectives.append(Collective(name, layer, "backward", "all_to_all", "ep", ep, size_bytes,
                                     f"gradient of: {what}"))


def moe_mlp(fb, p: str, layer: int, x: str) -> str:
    """Emit router, dispatch, this rank's experts and combine on `x` ([T, h]); return the [T, h] output."""
    m, s = fb.m, fb.shape
    moe = m.moe
    h, e, k, f = m.hidden_size, moe.num_experts, moe.top_k, moe.expert_ffn_hidden_size
    tokens, elt = s.tokens, s.elt
    local = e // fb.par.ep
    rows = moe.planned_tokens_per_expert(tokens, fb.par.ep)

    logits = fb.linear(f"{p}.router", layer, x, h, e, bias=False, role="router")
    score = f"router_{moe.score_function}"  # softmax or sigmoid: both differentiate from their fp32 output
    probs = fb.g.tensor(f"{p}.{score}.out", tokens * e * ROUTER_PROB_BYTES, "router_probs")
    fb.g.forward(f"{p}.{score}", OpClass.ELEMENTWISE, layer, (logits,), (probs,), role=score, bwd_reads=(probs,))
    weights = fb.g.tensor(f"{p}.topk.weights", tokens * k * ROUTER_PROB_BYTES, "router_weights")
    index = fb.g.tensor(f"{p}.topk.indices", tokens * k * INDEX_BYTES, "router_indices", differentiable=False)
    fb.g.forward(f"{p}.topk", OpClass.ELEMENTWISE, layer, (probs,), (weights, index), role="topk",
                 bwd_reads=(index,))

    routed = tokens * k * h * elt  # this rank's token rows, one per (token, chosen expert)
    _all_to_all(fb, f"{p}.moe_dispatch", layer, routed, "token rows to the ranks of their experts")
    inputs = tuple(fb.g.tensor(f"{p}.dispatch.e{i}", rows * h * elt, "expert_in") for i in range(local))
    fb.g.forward(f"{p}.dispatch", OpClass.ELEMENTWISE, layer, (x, index), inputs, role="moe_dispatch",
                 bwd_reads=(index,))

    outs = []
    for i, xi in enumerate(inputs):
        q = f"{p}.expert{i}"
        gate = _expert_linear(fb, f"{q}.gate", layer, xi, rows, h, f, "expert_gate")
        up = _expert_linear(fb, f"{q}.up", layer, xi, rows, h, f, "expert_up")
        act = fb.g.tensor(f"{q}.swiglu.out", rows * f * elt, "expert_swiglu_out")
        fb.g.forward(f"{q}.swiglu", OpClass.ELEMENTWISE, layer, (gate, up), (act,), role="expert_swiglu",
                     bwd_reads=(gate, up))
        outs.append(_expert_linear(fb, f"{q}.down", layer, act, rows, f, h, "expert_down"))

    _all_to_all(fb, f"{p}.moe_combine", layer, routed, "expert outputs back to their tokens' ranks")
    y = fb.g.tensor(f"{p}.combine.out", s.act(h), "moe_out")
    fb.g.forward(f"{p}.combine", OpClass.ELEMENTWISE, layer, (*outs, weights, index), (y,), role="moe_combine",
                 bwd_reads=(*outs, weights, index))
    if not moe.num_shared_experts:
        return y
    width = moe.num_shared_experts * f  # the shared experts as one SwiGLU on every token (HF DeepseekV3MoE)
    gate = fb.linear(f"{p}.shared.gate", layer, x, h, width, bias=False, role="shared_gate")
    up = fb.linear(f"{p}.shared.up", layer, x, h, width, bias=False, role="shared_up")
    act = fb.g.tensor(f"{p}.shared.swiglu.out", fb.g.size(gate), "shared_swiglu_out")
    fb.g.forward(f"{p}.shared.swiglu", OpClass.ELEMENTWISE, layer, (gate, up), (act,), role="shared_swiglu",
                 bwd_reads=(gate, up))
    down = fb.linear(f"{p}.shared.down", layer, act, width, h, bias=False, role="shared_down")
    return fb.add(f"{p}.shared_add", layer, y, down)


def moe_mlp_saved_bytes(tokens: int, hidden: int, experts: int, top_k: int, expert_ffn: int, rows: int,
                        local_experts: int, elt: int, shared_ffn: int = 0) -> int:
    """The module docstring's formula: saved bytes of one MoE MLP on a rank (`rows` per expert;
    `shared_ffn`: the shared experts' total width, whose gate, up and SwiGLU outputs add 3 T f_s elt)."""
    return (tokens * hidden * elt + ROUTER_PROB_BYTES * tokens * experts
            + (ROUTER_PROB_BYTES + INDEX_BYTES) * tokens * top_k
            + local_experts * rows * (2 * hidden + 3 * expert_ffn) * elt + 3 * tokens * shared_ffn * elt)
