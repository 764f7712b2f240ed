"""Profile stage: the op graph of one training step of a transformer on a given GPU, built analytically.

`build_graph(model, hardware)` emits forward (embedding, layers, head), loss, backward and, when
`model.include_optimizer`, one optimizer-step op per layer (its bytes follow the training recipe,
`slackswap.memory.static.optimizer_step_moved_bytes`); every op is timed with the roofline model of
`slackswap.profile.timing`. Conventions and assumptions are in docs/profile.md.

`build_graph(model, hardware, training, parallel)` builds one rank's graph under a parallel layout
(`slackswap.parallel`); its collectives are in `graph.meta["parallel"]` (`layout_collectives`).
"""

from __future__ import annotations

from dataclasses import asdict
from functools import lru_cache

from slackswap.errors import ConfigError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.model_config import ModelConfig
from slackswap.parallel import NO_PARALLELISM, ParallelConfig
from slackswap.profile.builder import GraphBuilder, add_optimizer_steps
from slackswap.profile.collectives import Collective, from_json, to_json
from slackswap.profile.layers import build_forward

__all__ = ["build_graph", "default_training", "layout_collectives", "parameter_counts", "state_bytes_per_param"]


def state_bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(weight, weight-grad, optimizer-state) bytes per parameter for Adam training in `dtype`.

    16-bit: mixed-precision Adam as in ZeRO (Rajbhandari et al. 2020, section 3.1): 16-bit weights and
    gradients, fp32 master weights, momentum and variance (2 + 2 + 12 = 16 bytes per parameter).
    fp32: fp32 weights and gradients, fp32 momentum and variance (4 + 4 + 8).
    """
    return (4, 4, 8) if dtype == "fp32" else (2, 2, 12)


@lru_cache(maxsize=64)
def parameter_counts(model: ModelConfig, parallel: ParallelConfig = NO_PARALLELISM) -> tuple[int, int]:
    """(parameters, largest parameter group) of the model's shape, counted exactly as `build_graph` does
    (one rank's share under `parallel`: tp splits the GEMMs and the vocabulary, not the norms).

    The static-memory model needs them whatever the graph's source (a traced graph shares the
    analytic preset's shape). The largest group (a layer, or embeddings + head + final norm) is the
    gather unit of ZeRO-3 / FSDP.
    """
    gb = GraphBuilder(None, model.dtype)  # the hardware only times ops in `finish`, never called here
    fb = build_forward(model, gb, _stack_layout(parallel))
    return fb.params, max(fb.layer_params.values())


def default_training(dtype: str) -> TrainingConfig:
    """The recipe assumed when none is given: mixed-precision AdamW, or fp32 AdamW for an fp32 model."""
    return TrainingConfig(precision="fp32" if dtype == "fp32" else "mixed")


def _stack_layout(parallel: ParallelConfig | None) -> ParallelConfig:
    """The layout, once checked that this profile builds its graph: a pipeline's are one per stage."""
    parallel = NO_PARALLELISM if parallel is None else parallel
    if parallel.pp != 1:
        raise ConfigError("parallel.pp", parallel.pp, "a pipeline's graphs are one per stage: "
                          "slackswap.profile.stages.build_stage_graph")
    return parallel


def layout_collectives(graph: Graph) -> list[Collective]:
    """The collectives the graph's parallel layout adds inside the step ([] for one full replica)."""
    return from_json((graph.meta.get("parallel") or {}).get("collectives", ()))


def build_graph(model: ModelConfig, hardware: Hardware, training: TrainingConfig | None = None,
                parallel: ParallelConfig | None = None) -> Graph:
    """The op graph of one training step of `model` on `hardware` (ops in keep-all execution order).

    `training` decides what the optimizer-step ops stream (AdamW or SGD, precision, the 1/N shard a
    rank updates under ZeRO); None: `default_training(model.dtype)` (28 bytes per parameter).
    `parallel`: the layout whose one rank's graph to build (None: one full replica; docs/profile.md,
    "Per-rank graphs").
    """
    parallel = _stack_layout(parallel)
    hardware.peak_for(model.dtype)  # reject a dtype the GPU has no peak for before building anything
    training = default_training(model.dtype) if training is None else training
    training.check_model_dtype(model.dtype)
    gb = GraphBuilder(hardware, model.dtype, model.attention_kernel)
    fb = build_forward(model, gb, parallel, training.fp8_linear_inputs)
    gb.backward()
    if model.include_optimizer:
        add_optimizer_steps(gb, fb.layer_params, training, model.dtype)
    w, g, state = state_bytes_per_param(model.dtype)
    meta_layout = {}
    if parallel != NO_PARALLELISM:  # one full replica's graph stays what it always was, meta included
        meta_layout = {"parallel": {"layout": parallel.as_dict(), "collectives": to_json(fb.collectives)}}
    return gb.finish(
        f"{model.name}@{hardware.name}",
        model.num_layers,
        weight_bytes=w * fb.params,
        weight_grad_bytes=g * fb.params,
        optimizer_state_bytes=state * fb.params,
        meta={
            "model": asdict(model),
            "hardware": hardware.name,
            "num_params": fb.params,
            # The largest parameter group (a layer, or embeddings + head): ZeRO-3 / FSDP's gather unit.
            "max_unit_params": max(fb.layer_params.values()),
        } | meta_layout,
    )
