"""Mixture-of-experts shape of a model (`model.moe`): experts, top-k routing, capacity and the load rule.

A token's router picks `top_k` of `num_experts` SwiGLU experts of width `expert_ffn_hidden_size`
(Shazeer et al. 2017; Mixtral, Jiang et al. 2024, arXiv 2401.04088; Qwen3-MoE). How many tokens an
expert receives depends on the routing, which the profile cannot know in advance, so the graph is
sized by a stated rule (`planned_tokens_per_expert`), not by the mean T k / E:

1. **Load percentile** (dropless routing, Megablocks / Megatron-Core without a capacity): with a
   router balanced by its auxiliary loss (Fedus et al. 2021, "Switch Transformers", arXiv 2101.03961,
   eq. 4), each of the N tokens an expert can receive picks it independently with probability k / E,
   so the tokens of one expert are Binomial(N, k / E); the plan uses its `load_percentile`-th
   percentile (99: an expert exceeds the plan in at most 1 step in 100 under this model). Every
   expert of a rank is planned at that percentile at once, which is conservative: the rank's total
   exceeds its own percentile. Real routers are more skewed than balanced Bernoulli choices; raise
   the percentile, or set a capacity, to plan for them.
2. **Capacity factor** (token dropping, GShard, Lepikhin et al. 2020, arXiv 2006.16668, section 2.2;
   Switch Transformers eq. 3): an expert takes at most C = ceil(capacity_factor * T k / E) tokens from
   each source rank of T tokens (Megatron-Core `moe_utils.get_capacity`), the rest are dropped. With a
   capacity factor > 0 the plan is min(ep * C, the percentile load).

N = ep * T: under expert parallelism an expert receives tokens from all ep ranks of its group.

DeepSeek-MoE structure (DeepSeek-V3 Technical Report, arXiv 2412.19437, section 2.1.2, eq. 12-16;
HF `DeepseekV3MoE`), both off by default so Mixtral and Qwen3-MoE are unchanged:

- `num_shared_experts`: experts every token passes through besides its k routed ones, run as one
  SwiGLU FFN of width num_shared_experts x expert_ffn_hidden_size on all T tokens (HF builds them as one
  `DeepseekV3MLP` of `moe_intermediate_size * n_shared_experts`); replicated on every ep rank.
- `first_dense_layers`: the first layers keep the dense SwiGLU MLP of `model.ffn_hidden_size`
  (config.json `first_k_dense_replace`).
- `score_function`: softmax (Mixtral, Qwen3) or sigmoid (DeepSeek-V3, eq. 15: s = sigmoid(u^T e)).
  Either keeps one fp32 [T, E] tensor for its backward (softmax and sigmoid both differentiate
  from their output), so the saved bytes are the same; the role names which one ran.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slackswap import validation as check
from slackswap.errors import ConfigError, reject_unknown_fields

#: Router score functions: both keep one fp32 [T, E] output for the backward.
SCORE_FUNCTIONS: tuple[str, ...] = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """The experts of every transformer layer's MLP (`model.moe`; absent for a dense model)."""

    #: Experts per layer (E).
    num_experts: int
    #: Experts each token is routed to (k).
    top_k: int
    #: Inner width of one SwiGLU expert (its gate/up output width).
    expert_ffn_hidden_size: int
    #: Expert capacity as a multiple of the mean T k / E tokens; 0 = dropless (no capacity).
    capacity_factor: float = 0.0
    #: The percentile of one expert's tokens the graph is sized for, in (0, 100].
    load_percentile: float = 99.0
    #: Shared experts every token also passes through (one SwiGLU of this many times the expert width).
    num_shared_experts: int = 0
    #: Leading layers with the dense MLP (`model.ffn_hidden_size`) instead of experts.
    first_dense_layers: int = 0
    #: The router's score function: "softmax" or "sigmoid" (module doc).
    score_function: str = "softmax"

    def __post_init__(self) -> None:
        check.integer("model.moe.num_experts", self.num_experts, 1)
        check.integer("model.moe.top_k", self.top_k, 1)
        if self.top_k > self.num_experts:
            raise ConfigError("model.moe.top_k", self.top_k, f"exceeds model.moe.num_experts={self.num_experts}")
        check.integer("model.moe.expert_ffn_hidden_size", self.expert_ffn_hidden_size, 1)
        check.non_negative("model.moe.capacity_factor", self.capacity_factor)
        check.positive("model.moe.load_percentile", self.load_percentile)
        if self.load_percentile > 100:
            raise ConfigError("model.moe.load_percentile", self.load_percentile, "must be in (0, 100]")
        check.integer("model.moe.num_shared_experts", self.num_shared_experts, 0)
        check.integer("model.moe.first_dense_layers", self.first_dense_layers, 0)
        if self.score_function not in SCORE_FUNCTIONS:
            raise ConfigError("model.moe.score_function", self.score_function, f"unknown; known: {SCORE_FUNCTIONS}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MoEConfig:
        if not isinstance(data, Mapping):
            raise ConfigError("model.moe", data, "must be a mapping of the MoE fields, or null for a dense model")
        data = dict(data)
        reject_unknown_fields("model.moe", data, cls.__dataclass_fields__)
        return cls(**data)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether transformer layer `layer` (0-based) has experts (the first `first_dense_layers` do not)."""
        return layer >= self.first_dense_layers

    def capacity_per_source(self, tokens: int) -> int:
        """C: the most tokens an expert takes from one rank of `tokens` tokens (0: no capacity)."""
        if not self.capacity_factor:
            return 0
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def percentile_load(self, tokens: int, ep: int = 1) -> int:
        """The `load_percentile`-th percentile of Binomial(ep * tokens, top_k / num_experts)."""
        n = ep * tokens
        p = self.top_k / self.num_experts
        if p >= 1.0 or self.load_percentile >= 100:
            return n  # every token reaches the expert (E = k), or the plan covers the worst case
        from scipy.stats import binom  # here, not at import: scipy.stats costs every command ~0.4 s

        return int(binom.ppf(self.load_percentile / 100.0, n, p))

    def planned_tokens_per_expert(self, tokens: int, ep: int = 1) -> int:
        """Tokens each expert's tensors are sized for on a rank of `tokens` tokens in an ep group (module doc)."""
        load = self.percentile_load(tokens, ep)
        cap = self.capacity_per_source(tokens)
        return min(load, ep * cap) if cap else load
