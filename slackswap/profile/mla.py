"""The analytic graph of multi-head latent attention (`model.mla`, `slackswap.mla_config`), one rank's share.

Replaces the QKV GEMM and rotary op of a llama-family layer with DeepSeek-V2/V3's low-rank projections
in the form the released model runs them (HF transformers `DeepseekV3Attention`; the equations are
in the DeepSeek-V3 Technical Report, arXiv 2412.19437, section 2.1.1). On T tokens of this rank, with
a heads, ranks d_q (q_lora_rank) and d_c (kv_lora_rank), head widths d_n (qk_nope_head_dim), d_r
(qk_rope_head_dim), d_v (v_head_dim) and d_qk = d_n + d_r:

1. q_a: x W^DQ, [T, d_q] (eq. 6); q_a_norm: RMSNorm on the query latent; q_b: [T, a d_qk] (eq. 7, 8:
   W^UQ and W^QR fused). With q_lora_rank 0: one q GEMM [T, a d_qk] on x.
2. kv_a: x [W^DKV; W^KR], one GEMM writing the latent [T, d_c] and the shared rotary key [T, d_r]
   (eq. 1, 3; HF `kv_a_proj_with_mqa`); kv_a_norm: RMSNorm on the latent; kv_b: [T, a (d_n + d_v)]
   writing the per-head keys [T, a d_n] and values [T, a d_v] (eq. 2, 5: W^UK and W^UV fused).
3. rope: rotates the queries' d_r parts and the shared key and writes the whole query [T, a d_qk]
   (HF: `cat(q_pass, q_rot)`); backward reads only the cos/sin tables (not activations).
4. k_cat: each head's key [k^C; k^R] = [T, a d_qk] (eq. 4; the shared rotary key broadcast to every head);
   backward slices the gradient, reading nothing.
5. the attention core (`FamilyBuilder.attention`) with query/key width d_qk and value width d_v; the
   output projection W^O (eq. 11) is the layer's `proj` GEMM on the [T, a d_v] context.

Saved bytes of one MLA attention block with flash attention (elt: model dtype bytes; docs/profile.md,
"Multi-head latent attention"):
    T (h + 2 d_q + 2 d_c + 2 a d_qk + 2 a d_v) elt  +  4 b a s
(the block's input, read by q_a and kv_a; the query latent and its norm; the kv latent and its norm;
query and key; value and context; fp32 log-sum-exp). Projection FLOPs, forward:
    2 T (h d_q + d_q a d_qk + h (d_c + d_r) + d_c a (d_n + d_v) + a d_v h),
and the core 2 b a s s' (d_qk + d_v) for s' the keys a query sees.

**Under tensor parallelism** (tp ranks, Megatron-Core's `MLASelfAttention` with its Transformer
Engine layer spec, `megatron/core/models/gpt/gpt_layer_specs.py` and
`megatron/core/transformer/multi_latent_attention.py`): the down-projections q_a and kv_a are
`TELinear(parallel_mode="duplicated")`, whole on every rank and run on the rank's own tokens R (T / tp
under sp, where the block's input stays a sequence shard: nothing h wide is gathered; T without sp);
the latents' RMSNorms run on the same R tokens (fused into the up-projections' TE LayerNormLinear);
the up-projections q_b and kv_b are column-parallel (`gather_output=False`: the rank's a / tp heads),
so their latent inputs enter the tensor-parallel region as a column GEMM's hidden input does
(`FamilyBuilder.tp_enter` at the latent's width: under sp all-gather forward, reduce-scatter and the
saved shard's re-gather backward; without sp an all-reduce of its gradient backward); the shared
rotary key is gathered along the sequence under sp (`gather_from_sequence_parallel_region`: all-gather
forward, reduce-scatter backward; the source has no collective for it without sp); the output
projection is row-parallel (`tp_exit`). Per rank, with a' = a / tp:
    saved  = R (h + 2 d_q + 2 d_c) elt  +  T (2 a' d_qk + 2 a' d_v) elt  +  4 b a' s
    params = h d_q + d_q + d_q a' d_qk + h (d_c + d_r) + d_c + d_c a' (d_n + d_v) + a' d_v h
and per layer and direction the latent collectives carry T d_q + T d_c (+ T d_r under sp) elements.
The gathered latents and rotary key are communication buffers, not graph tensors (as the sp gather of
an ordinary layer's input). Not modelled: the all-reduce of the duplicated down-projections' weight
gradients over tp once per step under sp (a per-step gradient collective, like the norms' weights).
"""

from __future__ import annotations

from slackswap.graph import OpClass


def _gemm(fb, name: str, layer: int, x: str, d_in: int, outs: tuple[tuple[str, int, str], ...], role: str,
          column: bool = False) -> tuple:
    """One GEMM x W of d_in x sum(widths), writing one tensor per (suffix, width, role) of `outs`
    (the fused projections of the released model); backward reads x (dgrad + wgrad: 2x the FLOPs).
    `column`: a column-parallel up-projection on the T gathered tokens (widths already this rank's);
    else a whole (duplicated) down-projection on the rank's R tokens (module docstring)."""
    s = fb.shape
    d_out = sum(width for _, width, _ in outs)
    fb._count(layer, d_in * d_out)
    flops = 2.0 * (s.tokens if column else s.rep_tokens) * d_in * d_out
    w_bytes = d_in * d_out * s.elt
    size = s.act if column else s.rep
    ys = tuple(fb.g.tensor(f"{name}.{suffix}", size(width), out_role) for suffix, width, out_role in outs)
    saved, copies = fb._saved_linear_input(x, layer)
    fb.g.forward(name, OpClass.MATMUL, layer, (x,), (*ys, *copies), role=role, flops=flops, extra_bytes=w_bytes,
                 bwd_reads=(saved,), bwd_flops=2 * flops, bwd_extra_bytes=2 * w_bytes)
    return ys


def mla_attention(fb, p: str, layer: int, x: str) -> tuple[str, int]:
    """Emit MLA's projections, rotary and attention core on `x` ([R, h], the normed layer input);
    return (this rank's [T, a' d_v] context, the full context width a d_v that the layer's row-parallel
    output projection splits)."""
    m, s = fb.m, fb.shape
    mla = m.mla
    h, heads = m.hidden_size, s.heads
    d_qk, d_n, d_r, d_v = mla.qk_head_dim, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    if mla.q_lora_rank:
        (c_q,) = _gemm(fb, f"{p}.q_a", layer, x, h, (("out", mla.q_lora_rank, "mla_q_latent"),), "mla_q_down")
        c_q = fb.norm(f"{p}.q_a_norm", layer, c_q, rms=True, role="rmsnorm", width=mla.q_lora_rank)
        fb.tp_enter(f"{p}.q_latent_in", layer, mla.q_lora_rank)
        (q,) = _gemm(fb, f"{p}.q_b", layer, c_q, mla.q_lora_rank, (("out", heads * d_qk, "q"),), "mla_q_up",
                     column=True)
    else:
        fb.tp_enter(f"{p}.q_in", layer)
        (q,) = _gemm(fb, f"{p}.q", layer, x, h, (("out", heads * d_qk, "q"),), "q", column=True)
    c_kv, k_r = _gemm(fb, f"{p}.kv_a", layer, x, h,
                      (("latent", mla.kv_lora_rank, "mla_kv_latent"), ("k_rope", d_r, "k_rope")), "mla_kv_down")
    c_kv = fb.norm(f"{p}.kv_a_norm", layer, c_kv, rms=True, role="rmsnorm", width=mla.kv_lora_rank)
    fb.tp_enter(f"{p}.kv_latent_in", layer, mla.kv_lora_rank)
    k_n, v = _gemm(fb, f"{p}.kv_b", layer, c_kv, mla.kv_lora_rank,
                   (("k_nope", heads * d_n, "k_nope"), ("v", heads * d_v, "v")), "mla_kv_up", column=True)
    if fb.par.tp > 1 and fb.par.sp:  # the shared rotary key, gathered along the sequence
        full = s.act(d_r)
        fb._collective(f"{p}.k_rope_in", layer, "forward", "all_gather", "tp", full, "gather the shared rotary key")
        fb._collective(f"{p}.k_rope_in", layer, "backward", "reduce_scatter", "tp", full,
                       "rotary key gradient back to shards")
    q_rot = fb.g.tensor(f"{p}.rope.q", s.act(heads * d_qk), "q_rot")
    k_rot = fb.g.tensor(f"{p}.rope.k", s.act(d_r), "k_rope_rot")
    fb.g.forward(f"{p}.rope", OpClass.ELEMENTWISE, layer, (q, k_r), (q_rot, k_rot), role="rope")
    k = fb.g.tensor(f"{p}.k_cat.out", s.act(heads * d_qk), "k_rot")
    fb.g.forward(f"{p}.k_cat", OpClass.ELEMENTWISE, layer, (k_n, k_rot), (k,), role="mla_k_cat")
    return fb.attention(p, layer, q_rot, k, v, qk_dim=d_qk, v_dim=d_v), m.num_heads * d_v


def mla_saved_bytes(tokens: int, batch: int, seq: int, hidden: int, heads: int, q_lora_rank: int,
                    kv_lora_rank: int, qk_head_dim: int, v_head_dim: int, elt: int, rep_tokens: int = 0) -> int:
    """The module docstring's formula (flash attention, q_lora_rank > 0): one MLA block's saved bytes on
    a rank of `heads` heads; `rep_tokens`: the tokens of its down-projections (T / tp under sp; 0: T)."""
    rep = rep_tokens or tokens
    return (rep * (hidden + 2 * q_lora_rank + 2 * kv_lora_rank) * elt
            + tokens * (2 * heads * qk_head_dim + 2 * heads * v_head_dim) * elt + 4 * batch * heads * seq)


def mla_projection_flops(tokens: int, hidden: int, heads: int, q_lora_rank: int, kv_lora_rank: int,
                         qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int) -> float:
    """The module docstring's forward FLOPs of MLA's five GEMMs (q_a, q_b, kv_a, kv_b, o)."""
    d_qk = qk_nope_head_dim + qk_rope_head_dim
    return 2.0 * tokens * (hidden * q_lora_rank + q_lora_rank * heads * d_qk
                           + hidden * (kv_lora_rank + qk_rope_head_dim)
                           + kv_lora_rank * heads * (qk_nope_head_dim + v_head_dim) + heads * v_head_dim * hidden)
