"""Multi-head latent attention (MLA) shape of a model (`model.mla`): the ranks and head widths.

MLA (DeepSeek-V2, arXiv 2405.04434, section 2.1.2-2.1.3; DeepSeek-V3 Technical Report, arXiv
2412.19437, section 2.1.1, equations 1-11) replaces the Q, K, V projections of multi-head attention
with low-rank ones. On a token's input h_t:

    c_t^KV = W^DKV h_t                         (eq. 1: the kv latent, kv_lora_rank wide)
    k_t^C  = W^UK c_t^KV,  v_t^C = W^UV c_t^KV   (eq. 2, 5: per head qk_nope_head_dim / v_head_dim)
    k_t^R  = RoPE(W^KR h_t)                     (eq. 3: one rotary key of qk_rope_head_dim, shared by heads)
    c_t^Q  = W^DQ h_t                           (eq. 6: the query latent, q_lora_rank wide)
    q_t^C  = W^UQ c_t^Q,  q_t^R = RoPE(W^QR c_t^Q) (eq. 7, 8)
    o_t    = softmax(q [k^C; k^R] / sqrt(d_h + d_h^R)) v^C,  u_t = W^O o_t   (eq. 9-11)

The released implementation (config.json of deepseek-ai/DeepSeek-V3; HF transformers'
`DeepseekV3Attention`) fuses W^DKV and W^KR into one GEMM (`kv_a_proj_with_mqa`, kv_lora_rank +
qk_rope_head_dim wide), W^UK and W^UV into one (`kv_b_proj`), W^UQ and W^QR into one (`q_b_proj`),
and RMS-normalises both latents (`q_a_layernorm`, `kv_a_layernorm`; the report's section 2.1.1
footnote). The profile builds that form (`slackswap.profile.mla`). `q_lora_rank: 0` is DeepSeek-V2-Lite's
uncompressed query (one `q_proj` GEMM, no query latent).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slackswap import validation as check
from slackswap.errors import ConfigError, reject_unknown_fields


@dataclass(frozen=True)
class MLAConfig:
    """The low-rank attention of every layer (`model.mla`; absent for multi-head / grouped-query attention)."""

    #: Rank of the query latent c^Q (d_c' in the papers); 0: no query compression (one q_proj GEMM).
    q_lora_rank: int
    #: Rank of the key-value latent c^KV (d_c).
    kv_lora_rank: int
    #: Per-head width of the non-rotary query and key parts (d_h).
    qk_nope_head_dim: int
    #: Width of the rotary query part per head and of the one shared rotary key (d_h^R).
    qk_rope_head_dim: int
    #: Per-head width of the value (and of the attention output before W^O).
    v_head_dim: int

    def __post_init__(self) -> None:
        check.integer("model.mla.q_lora_rank", self.q_lora_rank, 0)
        check.integer("model.mla.kv_lora_rank", self.kv_lora_rank, 1)
        check.integer("model.mla.qk_nope_head_dim", self.qk_nope_head_dim, 1)
        check.integer("model.mla.qk_rope_head_dim", self.qk_rope_head_dim, 2)
        if self.qk_rope_head_dim % 2:
            raise ConfigError("model.mla.qk_rope_head_dim", self.qk_rope_head_dim,
                              "must be even (rotary embedding turns pairs of dimensions)")
        check.integer("model.mla.v_head_dim", self.v_head_dim, 1)

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key in the attention core: d_h + d_h^R."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MLAConfig:
        if not isinstance(data, Mapping):
            raise ConfigError("model.mla", data,
                              "must be a mapping of the MLA fields, or null for multi-head attention")
        data = dict(data)
        reject_unknown_fields("model.mla", data, cls.__dataclass_fields__)
        return cls(**data)
