"""Profile stage: the op graph of one training step of a transformer on a given GPU, built analytically.

`build_graph(model, hardware)` emits forward (embedding, layers, head), loss, backward and, when
`model.include_optimizer`, one Adam op per layer; every op is timed with the roofline model of
`slackswap.profile.timing`. Conventions and assumptions are in docs/profile.md.
"""

from __future__ import annotations

from dataclasses import asdict

from slackswap.graph import NO_LAYER, Graph
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.profile.builder import GraphBuilder
from slackswap.profile.layers import build_forward

__all__ = ["build_graph", "state_bytes_per_param"]


def state_bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(weight, weight-grad, optimizer-state) bytes per parameter for Adam training in `dtype`.

    16-bit: mixed-precision Adam as in ZeRO (Rajbhandari et al. 2020, section 3.1): 16-bit weights and
    gradients, fp32 master weights, momentum and variance (2 + 2 + 12 = 16 bytes per parameter).
    fp32: fp32 weights and gradients, fp32 momentum and variance (4 + 4 + 8).
    """
    return (4, 4, 8) if dtype == "fp32" else (2, 2, 12)


def _adam_moved_bytes(n_params: int, dtype: str) -> int:
    """Adam streams: read grads, read+write master weights and both moments, write the compute weights."""
    w, g, state = state_bytes_per_param(dtype)
    if dtype == "fp32":  # the fp32 weights are the master copy
        return n_params * (g + 2 * state + 2 * w)
    return n_params * (g + 2 * state + w)


def build_graph(model: ModelConfig, hardware: Hardware) -> Graph:
    """The op graph of one training step of `model` on `hardware` (ops in keep-all execution order)."""
    hardware.peak_for(model.dtype)  # reject a dtype the GPU has no peak for before building anything
    gb = GraphBuilder(hardware, model.dtype)
    fb = build_forward(model, gb)
    gb.backward()
    if model.include_optimizer:
        for layer in sorted(fb.layer_params, key=lambda n: (n == NO_LAYER, n)):
            name = "adam" if layer == NO_LAYER else f"L{layer}.adam"
            gb.optimizer(name, layer, _adam_moved_bytes(fb.layer_params[layer], model.dtype))
    w, g, state = state_bytes_per_param(model.dtype)
    return gb.finish(
        f"{model.name}@{hardware.name}",
        model.num_layers,
        weight_bytes=w * fb.params,
        weight_grad_bytes=g * fb.params,
        optimizer_state_bytes=state * fb.params,
        meta={"model": asdict(model), "hardware": hardware.name, "num_params": fb.params},
    )
