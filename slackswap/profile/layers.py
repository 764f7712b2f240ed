"""Forward pass of the three model families, one kernel-level op at a time.

Granularity follows Korthikanti et al. 2022 (Table 2 / section 4.1): every tensor they count is a
graph tensor, so that with 16-bit activations, dropout and eager attention the saved bytes of one
BERT or GPT-2 layer are exactly s*b*h*(34 + 5*a*s/h). Op FLOPs count matrix multiplies only
(2*m*n*k); elementwise ops are timed by their HBM traffic. Backward ops are derived by
`GraphBuilder.backward` from each op's `bwd_reads` and `bwd_flops`.

Naming: ops and tensors of layer l are prefixed `L{l}.`; ops outside the stack have no prefix and
layer NO_LAYER.

Under a parallel layout (`slackswap.parallel.ParallelConfig`) the ops and tensors are ONE RANK's:
tensor parallelism splits the heads and the MLP's inner width (column-parallel QKV, fc1 / gate+up and
LM head; row-parallel projection and fc2 / down; vocab-parallel embedding), sequence parallelism splits
the LayerNorm/dropout/residual region along the sequence, context parallelism splits the sequence of
the whole layer. The collectives the layout adds are recorded in `FamilyBuilder.collectives`
(`slackswap.profile.collectives`), not as ops. With the default layout every size is the same integer
as without one.
"""

from __future__ import annotations

from dataclasses import dataclass

from slackswap.errors import ConfigError
from slackswap.graph import NO_LAYER, OpClass, Phase
from slackswap.model_config import ModelConfig
from slackswap.parallel import NO_PARALLELISM, ParallelConfig
from slackswap.profile.builder import GraphBuilder
from slackswap.profile.collectives import Collective
from slackswap.profile.mla import mla_attention
from slackswap.profile.moe import moe_mlp

#: Dropout masks are stored as torch.bool: one byte per element (Korthikanti et al. 2022).
MASK_BYTES_PER_ELEMENT = 1
#: FlashAttention keeps the softmax log-sum-exp in fp32, one value per (batch, head, query).
LSE_BYTES_PER_ELEMENT = 4
#: Cross-entropy works on fp32 probabilities, as Megatron's fused vocab cross entropy and HF do.
LOSS_BYTES_PER_ELEMENT = 4
#: Transformer Engine's FP8 formats (E4M3 forward, E5M2 gradients) are one byte per element; the
#: per-tensor scale lives in the module's FP8 metadata, not in the activation (TE docs, "Using FP8 with
#: Transformer Engine").
FP8_BYTES_PER_ELEMENT = 1
#: FlashAttention-2 backward runs 5 matmuls (recompute S=QK^T, dP=dO V^T, dV=P^T dO, dQ=dS K,
#: dK=dS^T Q) against 2 in the forward: 2.5x the forward FLOPs (Dao 2023, section 3.2 / 4.1).
FLASH_BWD_FLOPS_FACTOR = 2.5


@dataclass(frozen=True)
class Shape:
    """Element counts and bytes used throughout one rank's graph of one model."""

    model: ModelConfig
    parallel: ParallelConfig = NO_PARALLELISM

    @property
    def seq(self) -> int:
        """Sequence positions this rank holds: s / cp."""
        return self.model.seq_len // self.parallel.cp

    @property
    def tokens(self) -> int:
        """Tokens a GEMM of this rank works on (s / cp x b; a column-parallel GEMM's gathered input under sp)."""
        return self.seq * self.model.micro_batch_size

    @property
    def rep_tokens(self) -> int:
        """Tokens of the LayerNorm/dropout/residual region on this rank: split by tp under sp."""
        return self.tokens // self.parallel.sequence_shards

    @property
    def elt(self) -> int:
        return self.model.bytes_per_element

    @property
    def kv_dim(self) -> int:
        return self.model.num_kv_heads * self.model.attention_head_dim

    @property
    def heads(self) -> int:
        """Attention heads on this rank: a / tp."""
        return self.model.num_heads // self.parallel.tp

    @property
    def vocab_shard(self) -> int:
        """Vocabulary rows on this rank: ceil(V / tp) (Megatron pads V to a multiple of tp, at least)."""
        return -(-self.model.vocab_size // self.parallel.tp)

    def act(self, width: int) -> int:
        """Bytes of a [s / cp, b, width] activation in the model dtype (width already this rank's)."""
        return self.tokens * width * self.elt

    def rep(self, width: int) -> int:
        """Bytes of a [s / cp, b, width] activation of the LayerNorm/dropout/residual region (s / tp more under sp)."""
        return self.rep_tokens * width * self.elt

    def scores(self) -> int:
        """Elements of this rank's [b, a / tp, s / cp, s] attention scores (keys: the whole sequence)."""
        m = self.model
        return m.micro_batch_size * self.heads * self.seq * m.seq_len


class FamilyBuilder:
    """Emits the forward ops of one model into a GraphBuilder and counts its parameters."""

    def __init__(self, model: ModelConfig, gb: GraphBuilder, parallel: ParallelConfig = NO_PARALLELISM,
                 fp8_linear_inputs: bool = False):
        self.m = model
        #: Save the transformer layers' linear inputs as FP8 copies (`TrainingConfig.fp8_linear_inputs`).
        self.fp8_linear_inputs = fp8_linear_inputs
        self._fp8_copies: dict[str, str] = {}
        self.g = gb
        self.par = parallel
        self.shape = Shape(model, parallel)
        self.params = 0
        self.layer_params: dict[int, int] = {}
        #: The global index of this graph's layer 0: a pipeline stage numbers its layers from 0, while
        #: which layers have experts (`MoEConfig.is_moe_layer`) is a property of the whole model.
        self.first_layer_index = 0
        #: The collectives the layout adds, in the order the forward pass meets them.
        self.collectives: list[Collective] = []

    # -- primitives --------------------------------------------------------------------------------

    def _count(self, layer: int, n: int) -> None:
        self.params += n
        self.layer_params[layer] = self.layer_params.get(layer, 0) + n

    def _saved_linear_input(self, x: str, layer: int) -> tuple[str, tuple[str, ...]]:
        """(the tensor a linear's backward reads for its weight gradient, extra outputs of its forward op).

        Without FP8 storage: `x` itself. With it (Transformer Engine's FP8 Linear): a 1-byte copy of `x`,
        written by the first linear that reads `x` (the cast is fused into that GEMM's input path) and
        shared by every later linear on the same input (gate and up: TE's LayerNormMLP / Megatron's fused
        linear_fc1 cast it once). `x` stays in the model dtype for its other readers (the flash kernel
        keeps its own bf16 output). Only inside the transformer stack: the LM head and BERT's MLM dense
        stay in 16 bits, as Megatron-LM keeps its output layer out of Transformer Engine's FP8 region.
        """
        if not self.fp8_linear_inputs or layer == NO_LAYER:
            return x, ()
        if x in self._fp8_copies:
            return self._fp8_copies[x], ()
        elements = self.g.size(x) // self.shape.elt
        copy = self.g.tensor(f"{x}.fp8", elements * FP8_BYTES_PER_ELEMENT, "fp8_linear_input", differentiable=False)
        self._fp8_copies[x] = copy
        return copy, (copy,)

    # -- tensor-parallel region boundaries (slackswap.profile.collectives) --------------------------

    def _collective(self, name: str, layer: int, phase: str, kind: str, group: str, size: int, why: str) -> None:
        ranks = self.par.tp if group == "tp" else self.par.cp
        self.collectives.append(Collective(name, layer, phase, kind, group, ranks, size, why))

    def tp_enter(self, name: str, layer: int, width: int = 0) -> None:
        """Megatron's f (ḡ under sp): the replicated input of column-parallel GEMMs of hidden width
        (`width`: another input width, MLA's latents)."""
        if self.par.tp == 1:
            return
        full = self.shape.act(width or self.m.hidden_size)
        if self.par.sp:
            self._collective(name, layer, "forward", "all_gather", "tp", full, "gather the sequence for a column GEMM")
            self._collective(name, layer, "backward", "reduce_scatter", "tp", full, "input gradient back to shards")
            self._collective(name, layer, "backward", "all_gather", "tp", full,
                             "re-gather the saved sequence shard for the weight gradient")
        else:
            self._collective(name, layer, "backward", "all_reduce", "tp", full, "sum the replicated input's gradient")

    def tp_exit(self, name: str, layer: int) -> None:
        """Megatron's g (g̅ under sp): the partial sums of a row-parallel GEMM or vocab-parallel embedding."""
        if self.par.tp == 1:
            return
        full = self.shape.act(self.m.hidden_size)
        if self.par.sp:
            self._collective(name, layer, "forward", "reduce_scatter", "tp", full, "sum partials into sequence shards")
            self._collective(name, layer, "backward", "all_gather", "tp", full, "gather the output gradient")
        else:
            self._collective(name, layer, "forward", "all_reduce", "tp", full, "sum the row-parallel partials")

    def linear(
        self, name: str, layer: int, x: str, d_in: int, d_out: int, *, bias: bool, role: str, tied: bool = False,
        tp: str = "",
    ) -> str:
        """y = x W (+ b): one GEMM of 2*T*d_in*d_out FLOPs; backward = dgrad + wgrad = 2x.

        `tied`: W is another op's matrix (the token embedding), so only the bias is a new parameter.
        `tp`: "column" splits d_out over the tp ranks (output split too), "row" splits d_in (output
        summed by the following `tp_exit`, bias whole); "" a GEMM every rank runs whole on its tokens.
        """
        t = self.par.tp if tp else 1
        d_in, d_out_bias = (d_in // t, d_out) if tp == "row" else (d_in, d_out // t)
        d_out = d_out // t if tp == "column" else d_out
        w_bytes = d_in * d_out * self.shape.elt
        self._count(layer, (0 if tied else d_in * d_out) + (d_out_bias if bias else 0))
        tokens = self.shape.tokens if tp else self.shape.rep_tokens
        flops = 2.0 * tokens * d_in * d_out
        y = self.g.tensor(f"{name}.out", self.shape.act(d_out) if tp == "column" else self.shape.rep(d_out),
                          f"{role}_out")
        saved, copies = self._saved_linear_input(x, layer)
        self.g.forward(name, OpClass.MATMUL, layer, (x,), (y, *copies), role=role, flops=flops, extra_bytes=w_bytes,
                       bwd_reads=(saved,), bwd_flops=2 * flops, bwd_extra_bytes=2 * w_bytes)
        return y

    def norm(self, name: str, layer: int, x: str, *, rms: bool, role: str, width: int = 0) -> str:
        """LayerNorm / RMSNorm: backward reads the input (Korthikanti count the LN input only).
        `width`: the normalised dimension, for its weights (0: hidden_size; MLA's latents differ)."""
        h = width or self.m.hidden_size
        self._count(layer, h if rms else 2 * h)
        y = self.g.tensor(f"{name}.out", self.g.size(x), f"{role}_out")
        self.g.forward(name, OpClass.ELEMENTWISE, layer, (x,), (y,), role=role, bwd_reads=(x,))
        return y

    def dropout(
        self, name: str, layer: int, x: str, n_elements: int, *, role: str, attention_core: bool = False
    ) -> str:
        """Dropout: output plus a 1-byte mask; backward reads only the mask. A random op."""
        y = self.g.tensor(f"{name}.out", self.g.size(x), f"{role}_out")
        mask = self.g.tensor(f"{name}.mask", n_elements * MASK_BYTES_PER_ELEMENT, "dropout_mask",
                             differentiable=False)
        self.g.forward(name, OpClass.ELEMENTWISE, layer, (x,), (y, mask), role=role, bwd_reads=(mask,), random=True,
                       attention_core=attention_core)
        return y

    def maybe_dropout(self, name: str, layer: int, x: str, n_elements: int, *, role: str,
                      attention_core: bool = False) -> str:
        if not self.m.dropout:
            return x
        return self.dropout(name, layer, x, n_elements, role=role, attention_core=attention_core)

    def add(self, name: str, layer: int, a: str, b: str) -> str:
        """Residual add: backward needs no forward tensor."""
        y = self.g.tensor(f"{name}.out", self.g.size(a), "residual")
        self.g.forward(name, OpClass.ELEMENTWISE, layer, (a, b), (y,), role="residual_add")
        return y

    def gelu(self, name: str, layer: int, x: str) -> str:
        y = self.g.tensor(f"{name}.out", self.g.size(x), "gelu_out")
        self.g.forward(name, OpClass.ELEMENTWISE, layer, (x,), (y,), role="gelu", bwd_reads=(x,))
        return y

    # -- attention ---------------------------------------------------------------------------------

    def attention(self, p: str, layer: int, q: str, k: str, v: str, *, qk_dim: int = 0, v_dim: int = 0) -> str:
        """Eager (materialised s x s scores) or flash (fused) attention core; returns the context.
        `qk_dim`, `v_dim`: one head's query/key and value widths (0: the model's head width; MLA's differ)."""
        s = self.shape
        qk_dim = qk_dim or self.m.attention_head_dim
        v_dim = v_dim or self.m.attention_head_dim
        qk_flops = 2.0 * s.scores() * qk_dim  # the two batched matmuls: Q K^T, then P V
        pv_flops = 2.0 * s.scores() * v_dim
        ctx_width = s.heads * v_dim
        ctx = None
        if self.par.cp > 1:  # ring attention: K and V shards travel round the cp ranks (collectives.py)
            kv = self.g.size(k) + self.g.size(v)
            self._collective(f"{p}.ring_kv", layer, "forward", "ring_exchange", "cp", self.par.cp * kv, "K, V")
            self._collective(f"{p}.ring_kv", layer, "backward", "ring_exchange", "cp", self.par.cp * kv, "K, V again")
            self._collective(f"{p}.ring_dkv", layer, "backward", "ring_exchange", "cp", self.par.cp * kv, "dK, dV")
        if self.m.attention == "flash":
            ctx = self.g.tensor(f"{p}.flash.out", s.act(ctx_width), "attn_ctx")
            m = self.m
            lse = self.g.tensor(f"{p}.flash.lse", m.micro_batch_size * s.heads * s.seq * LSE_BYTES_PER_ELEMENT,
                                "softmax_lse", differentiable=False)
            # Attention dropout inside the flash kernel regenerates its mask from the RNG state: no mask tensor.
            self.g.forward(f"{p}.flash", OpClass.ATTENTION, layer, (q, k, v), (ctx, lse), role="flash_attn",
                           flops=qk_flops + pv_flops, bwd_reads=(q, k, v, ctx, lse),
                           bwd_flops=FLASH_BWD_FLOPS_FACTOR * (qk_flops + pv_flops), random=self.m.dropout,
                           attention_core=True)
            return ctx
        scores = self.g.tensor(f"{p}.qk.out", s.scores() * s.elt, "attn_scores")
        self.g.forward(f"{p}.qk", OpClass.ATTENTION, layer, (q, k), (scores,), role="qk_bmm",
                       flops=qk_flops, bwd_reads=(q, k), bwd_flops=2 * qk_flops, attention_core=True)
        # Scale and causal/padding mask are fused into the softmax kernel, as in Megatron.
        probs = self.g.tensor(f"{p}.softmax.out", s.scores() * s.elt, "softmax_out")
        self.g.forward(f"{p}.softmax", OpClass.ELEMENTWISE, layer, (scores,), (probs,), role="softmax",
                       bwd_reads=(probs,), attention_core=True)
        probs = self.maybe_dropout(f"{p}.attn_drop", layer, probs, s.scores(), role="softmax_dropout",
                                   attention_core=True)
        ctx = self.g.tensor(f"{p}.pv.out", s.act(ctx_width), "attn_ctx")
        self.g.forward(f"{p}.pv", OpClass.ATTENTION, layer, (probs, v), (ctx,), role="pv_bmm",
                       flops=pv_flops, bwd_reads=(probs, v), bwd_flops=2 * pv_flops, attention_core=True)
        return ctx

    def qkv(self, p: str, layer: int, x: str, *, bias: bool) -> tuple[str, str, str]:
        """One fused QKV GEMM writing separate Q, K, V tensors (K, V have num_kv_heads heads); column-parallel
        under tp (this rank's a / tp query and kv / tp key-value heads)."""
        t = self.par.tp
        h, kv = self.m.q_width // t, self.shape.kv_dim // t
        d_out = h + 2 * kv
        d_in = self.m.hidden_size
        s = self.shape
        self._count(layer, d_in * d_out + (d_out if bias else 0))
        flops = 2.0 * s.tokens * d_in * d_out
        w_bytes = d_in * d_out * s.elt
        q = self.g.tensor(f"{p}.qkv.q", s.act(h), "q")
        k = self.g.tensor(f"{p}.qkv.k", s.act(kv), "k")
        v = self.g.tensor(f"{p}.qkv.v", s.act(kv), "v")
        saved, copies = self._saved_linear_input(x, layer)
        self.g.forward(f"{p}.qkv", OpClass.MATMUL, layer, (x,), (q, k, v, *copies), role="qkv", flops=flops,
                       extra_bytes=w_bytes, bwd_reads=(saved,), bwd_flops=2 * flops, bwd_extra_bytes=2 * w_bytes)
        return q, k, v

    # -- layers ------------------------------------------------------------------------------------

    def gpt2_layer(self, layer: int, x: str) -> str:
        """Pre-LN decoder layer: x + Drop(Attn(LN(x))), then + Drop(MLP(LN(.)))."""
        p, h, f = f"L{layer}", self.m.hidden_size, self.m.ffn_hidden_size
        n_act = self.shape.rep_tokens * h
        ln1 = self.norm(f"{p}.ln1", layer, x, rms=False, role="layernorm")
        self.tp_enter(f"{p}.attn_in", layer)
        q, k, v = self.qkv(p, layer, ln1, bias=True)
        ctx = self.attention(p, layer, q, k, v)
        attn = self.linear(f"{p}.proj", layer, ctx, h, h, bias=True, role="proj", tp="row")
        self.tp_exit(f"{p}.attn_out", layer)
        attn = self.maybe_dropout(f"{p}.proj_drop", layer, attn, n_act, role="dropout")
        mid = self.add(f"{p}.add1", layer, x, attn)
        ln2 = self.norm(f"{p}.ln2", layer, mid, rms=False, role="layernorm")
        self.tp_enter(f"{p}.mlp_in", layer)
        mlp = self.linear(f"{p}.fc1", layer, ln2, h, f, bias=True, role="fc1", tp="column")
        mlp = self.gelu(f"{p}.gelu", layer, mlp)
        mlp = self.linear(f"{p}.fc2", layer, mlp, f, h, bias=True, role="fc2", tp="row")
        self.tp_exit(f"{p}.mlp_out", layer)
        mlp = self.maybe_dropout(f"{p}.mlp_drop", layer, mlp, n_act, role="dropout")
        return self.add(f"{p}.add2", layer, mid, mlp)

    def bert_layer(self, layer: int, x: str) -> str:
        """Post-LN encoder layer: LN(x + Drop(Attn(x))), then LN(. + Drop(MLP(.)))."""
        p, h, f = f"L{layer}", self.m.hidden_size, self.m.ffn_hidden_size
        n_act = self.shape.rep_tokens * h
        self.tp_enter(f"{p}.attn_in", layer)
        q, k, v = self.qkv(p, layer, x, bias=True)
        ctx = self.attention(p, layer, q, k, v)
        attn = self.linear(f"{p}.proj", layer, ctx, h, h, bias=True, role="proj", tp="row")
        self.tp_exit(f"{p}.attn_out", layer)
        attn = self.maybe_dropout(f"{p}.proj_drop", layer, attn, n_act, role="dropout")
        r1 = self.add(f"{p}.add1", layer, x, attn)
        y1 = self.norm(f"{p}.ln1", layer, r1, rms=False, role="layernorm")
        self.tp_enter(f"{p}.mlp_in", layer)
        mlp = self.linear(f"{p}.fc1", layer, y1, h, f, bias=True, role="fc1", tp="column")
        mlp = self.gelu(f"{p}.gelu", layer, mlp)
        mlp = self.linear(f"{p}.fc2", layer, mlp, f, h, bias=True, role="fc2", tp="row")
        self.tp_exit(f"{p}.mlp_out", layer)
        mlp = self.maybe_dropout(f"{p}.mlp_drop", layer, mlp, n_act, role="dropout")
        r2 = self.add(f"{p}.add2", layer, y1, mlp)
        return self.norm(f"{p}.ln2", layer, r2, rms=False, role="layernorm")

    def llama_layer(self, layer: int, x: str) -> str:
        """Pre-RMSNorm decoder layer with rotary Q/K, optional GQA and a SwiGLU MLP; no dropout."""
        p, h, f = f"L{layer}", self.m.hidden_size, self.m.ffn_hidden_size
        n1 = self.norm(f"{p}.norm1", layer, x, rms=True, role="rmsnorm")
        if self.m.mla is not None:  # latent attention (slackswap.profile.mla: its own tp boundaries)
            ctx, ctx_width = mla_attention(self, p, layer, n1)
        else:
            self.tp_enter(f"{p}.attn_in", layer)
            q, k, v = self.qkv(p, layer, n1, bias=False)
            # Rotary embedding: elementwise on Q and K; its backward needs only the cos/sin tables.
            qr = self.g.tensor(f"{p}.rope.q", self.g.size(q), "q_rot")
            kr = self.g.tensor(f"{p}.rope.k", self.g.size(k), "k_rot")
            self.g.forward(f"{p}.rope", OpClass.ELEMENTWISE, layer, (q, k), (qr, kr), role="rope")
            ctx, ctx_width = self.attention(p, layer, qr, kr, v), self.m.q_width
        attn = self.linear(f"{p}.proj", layer, ctx, ctx_width, h, bias=False, role="proj", tp="row")
        self.tp_exit(f"{p}.attn_out", layer)
        mid = self.add(f"{p}.add1", layer, x, attn)
        n2 = self.norm(f"{p}.norm2", layer, mid, rms=True, role="rmsnorm")
        # Experts (slackswap.profile.moe; tp is 1) where the whole model has them.
        if self.m.moe is not None and self.m.moe.is_moe_layer(self.first_layer_index + layer):
            return self.add(f"{p}.add2", layer, mid, moe_mlp(self, p, layer, n2))
        self.tp_enter(f"{p}.mlp_in", layer)  # one gather serves gate and up (Megatron fuses them: linear_fc1)
        gate = self.linear(f"{p}.gate", layer, n2, h, f, bias=False, role="gate", tp="column")
        up = self.linear(f"{p}.up", layer, n2, h, f, bias=False, role="up", tp="column")
        act = self.g.tensor(f"{p}.swiglu.out", self.g.size(gate), "swiglu_out")
        self.g.forward(f"{p}.swiglu", OpClass.ELEMENTWISE, layer, (gate, up), (act,), role="swiglu",
                       bwd_reads=(gate, up))
        down = self.linear(f"{p}.down", layer, act, f, h, bias=False, role="down", tp="row")
        self.tp_exit(f"{p}.mlp_out", layer)
        return self.add(f"{p}.add2", layer, mid, down)

    # -- embeddings, head, loss --------------------------------------------------------------------

    def embedding(self) -> str:
        """Token (+ position, + token-type for BERT) lookup; its backward scatters into the weight grads."""
        m, s = self.m, self.shape
        h = m.hidden_size
        tables = {"bert": 3, "gpt2": 2, "llama": 1}[m.family]
        self._count(NO_LAYER, s.vocab_shard * h)  # vocab-parallel under tp; position tables stay whole
        if m.family in ("bert", "gpt2"):
            self._count(NO_LAYER, m.seq_len * h)  # learned positions, table sized to seq_len
        if m.family == "bert":
            self._count(NO_LAYER, 2 * h)  # two token types
        out = s.rep(h)
        x = self.g.tensor("embed.out", out, "embedding_out")
        # Reads one row per token from each table; backward writes the same rows of each table's grad.
        self.g.forward("embed", OpClass.ELEMENTWISE, NO_LAYER, (), (x,), role="embedding",
                       extra_bytes=tables * out, bwd_extra_bytes=tables * out)
        self.tp_exit("embed_out", NO_LAYER)
        if m.family == "bert":
            x = self.norm("embed_ln", NO_LAYER, x, rms=False, role="layernorm")
        if m.family != "llama":
            x = self.maybe_dropout("embed_drop", NO_LAYER, x, s.rep_tokens * h, role="dropout")
        return x

    def head_and_loss(self, x: str) -> None:
        """Final norm / BERT MLM transform, vocabulary projection, cross-entropy loss."""
        m, s = self.m, self.shape
        h = m.hidden_size
        if m.family == "gpt2":
            x = self.norm("final_ln", NO_LAYER, x, rms=False, role="layernorm")
        elif m.family == "llama":
            x = self.norm("final_norm", NO_LAYER, x, rms=True, role="rmsnorm")
        else:  # BERT masked-LM transform: dense, GeLU, LayerNorm (Devlin et al. 2019 / HF BertLMPredictionHead)
            x = self.linear("mlm_dense", NO_LAYER, x, h, h, bias=True, role="mlm_dense")
            x = self.gelu("mlm_gelu", NO_LAYER, x)
            x = self.norm("mlm_ln", NO_LAYER, x, rms=False, role="layernorm")
        # GPT-2 and BERT tie the LM head to the token embedding; BERT's decoder has its own bias.
        # Under tp the head is column-parallel over the (padded) vocabulary, the loss vocab-parallel.
        self.tp_enter("lm_head_in", NO_LAYER)
        logits = self.linear("lm_head", NO_LAYER, x, h, s.vocab_shard * self.par.tp, bias=m.family == "bert",
                             role="lm_head", tied=m.family in ("bert", "gpt2"), tp="column")
        probs = self.g.tensor("loss.probs", s.tokens * s.vocab_shard * LOSS_BYTES_PER_ELEMENT, "loss_probs",
                              differentiable=False)
        if self.par.tp > 1:  # max logit, target logit, sum of exponentials: one fp32 value per token each
            for what in ("max", "target", "sum_exp"):
                self._collective(f"loss.{what}", NO_LAYER, "forward", "all_reduce", "tp",
                                 s.tokens * LOSS_BYTES_PER_ELEMENT, f"vocab-parallel cross entropy: {what}")
        loss = self.g.tensor("loss.value", LOSS_BYTES_PER_ELEMENT, "loss", differentiable=False)
        # Fused cross entropy: upcasts the 16-bit logits to fp32, keeps the softmax for its backward
        # (grad = probs - onehot), which writes the logits gradient in the model dtype.
        self.g.forward("loss", OpClass.ELEMENTWISE, NO_LAYER, (logits,), (probs, loss), role="cross_entropy",
                       phase=Phase.LOSS, bwd_reads=(probs, loss))


def build_forward(model: ModelConfig, gb: GraphBuilder, parallel: ParallelConfig = NO_PARALLELISM,
                  fp8_linear_inputs: bool = False) -> FamilyBuilder:
    """Emit embedding, the transformer stack, head and loss of `model` (one rank's share under
    `parallel`, which must divide the model) into `gb`; `fp8_linear_inputs`: the layers' linears save
    1-byte copies of their inputs (`TrainingConfig.fp8_linear_inputs`)."""
    if model.family == "llama" and model.dropout:
        raise ConfigError("model.dropout", model.dropout, "the llama family has no dropout; set model.dropout=false")
    if model.family != "llama" and model.num_kv_heads != model.num_heads:
        # The analytic families' limit, not the model's: a traced model (model.torch) has any attention.
        raise ConfigError("model.num_kv_heads", model.num_kv_heads,
                          f"grouped-query attention is only modelled for the llama family, not {model.family!r}")
    parallel.check_model(model)
    fb = FamilyBuilder(model, gb, parallel, fp8_linear_inputs)
    layer_fn = {"bert": fb.bert_layer, "gpt2": fb.gpt2_layer, "llama": fb.llama_layer}[model.family]
    x = fb.embedding()
    for layer in range(model.num_layers):
        x = layer_fn(layer, x)
    fb.head_and_loss(x)
    return fb
