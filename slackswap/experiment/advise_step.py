"""The pieces of one advise configuration's step that the data-parallel search (`advise`) and the
layout search (`advise_layout`) both price: the activation floor, the forward compute, the optimizer
update, the recipe under a layout, and the row of a configuration without a plan. Apart so that the two
searches share them without importing each other."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from slackswap.experiment.advise_space import Layout, Row
from slackswap.graph import FORWARD_PHASES, Graph
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.memory.static import optimizer_step_moved_bytes
from slackswap.model_config import ModelConfig


def activation_floor_bytes(graph: Graph) -> int:
    """The least activation memory any plan needs: per op, the non-saved tensors resident at its
    start plus the saved tensors it produces or reads (they must be on the device then), the most over
    ops. The MILP's all-recompute floor (`slackswap.planners.milp.model`, `floor_bytes`)."""
    from slackswap.planners.milp.facts import fixed_bytes_per_op

    const = np.asarray(fixed_bytes_per_op(graph), dtype=np.int64)
    index = graph.op_index
    for t in graph.saved_tensors:
        size = graph.owned_bytes(t.name)
        for j in {index[t.producer]} | {index[c] for c in t.consumers}:
            const[j] += size
    return int(const.max())


def forward_compute_s(graph: Graph) -> float:
    """Compute time of the forward and loss ops (the plan changes backward, not these)."""
    return float(sum(op.duration_s for op in graph.ops if op.phase in FORWARD_PHASES))


def layer_param_counts(model: ModelConfig) -> dict[int, int]:
    """Parameters per group (each layer, and the embeddings + head + final norm), counted as the
    profile counts them."""
    from slackswap.profile.builder import GraphBuilder
    from slackswap.profile.layers import build_forward

    return dict(build_forward(model, GraphBuilder(None, model.dtype)).layer_params)


def optimizer_step_s(model: ModelConfig, hardware: Hardware, training: TrainingConfig) -> float:
    """The optimizer update as the profile times it when `model.include_optimizer` (one HBM-bound op
    per parameter group, over the rank's shard)."""
    from slackswap.graph import OpClass
    from slackswap.profile.timing import op_duration_s

    return sum(
        op_duration_s(0.0, optimizer_step_moved_bytes(n, training, model.dtype), OpClass.ELEMENTWISE, model.dtype,
                      hardware)
        for n in layer_param_counts(model).values()
    )


def recipe_for_layout(recipe: TrainingConfig, layout: Layout) -> TrainingConfig:
    """The recipe with the layout's ZeRO stage and shard count."""
    return replace(recipe, zero_stage=layout.zero_stage, zero_shards=layout.zero_shards)



def infeasible_row(base: Mapping[str, Any], reason: str, peak_activation: int | None = None) -> Row:
    """The row of a configuration that has no plan, with the reason."""
    return Row(status="infeasible", reason=reason, fits_device=False, tokens_per_s=None, mfu=None, step_s=None,
               micro_step_s=None, comm=None, comm_exposed_s=None, peak_bytes=None, headroom_bytes=None,
               peak_activation_bytes=peak_activation, peak_reserved_bytes=None, swapped=None, recomputed=None,
               recompute_s=None, stall_s=None, **base)
