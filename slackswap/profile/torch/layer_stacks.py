"""Which modules of a model are its layers: one rule for the tracer, the runtime's capture and the export.

A graph's ops carry a layer index (planners place transfers a layer ahead, the export wraps each
layer in a checkpoint, the breakdown prints a row per layer). Before this module the tracer took the
`nn.ModuleList` with the most children, the capture and the export the first one: they disagreed on
a mixture of experts with more experts than layers (the experts' list won the tracer), and neither
fit an encoder-decoder, whose encoder and decoder are two lists of layers.

The rule (`find_layer_stacks`):
- the layer stacks are the model's outermost `nn.ModuleList`s, those not inside another one (T5's
  `encoder.block` and `decoder.block`; not the `layer` list inside each T5 block, nor a layer's
  experts), in `named_modules()` order;
- a model with no `nn.ModuleList` takes its outermost `nn.Sequential`s whose children, two or more,
  are all of one class (a stack of repeated blocks; `Sequential(Linear, GELU, Linear)` is none);
- the layers are the stacks' children, numbered on from one stack to the next: T5's encoder blocks
  are layers 0..n-1 and its decoder blocks n..2n-1, the order they run in forward.
A module path belongs to the layer whose path it equals or lies under, after dropping the call suffix
(`@1`) the identities append (`slackswap.profile.torch.identity`); anything else is `NO_LAYER`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slackswap.graph import NO_LAYER

_CALL_SUFFIX = re.compile(r"@\d+$")


@dataclass(frozen=True)
class LayerStacks:
    #: Module paths of the layer lists ('' for the model itself), in forward order.
    stacks: tuple[str, ...]
    #: Module path of each layer, by layer index.
    paths: tuple[str, ...]

    @property
    def num_layers(self) -> int:
        return len(self.paths)

    def layer_of(self, path: str) -> int:
        """The layer a module path (an identity's module part, call suffix allowed) lies in, else NO_LAYER."""
        path = _CALL_SUFFIX.sub("", path)
        for i, layer in enumerate(self.paths):
            if path == layer or path.startswith(layer + "."):
                return i
        return NO_LAYER

    def modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The layer modules of `model`, by layer index."""
        return [model.get_submodule(p) for p in self.paths]


def _child(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def layer_stacks_at(model: torch.nn.Module, stacks: Sequence[str]) -> LayerStacks:
    """The layers of the given stacks (module paths of containers), numbered in that order."""
    paths = [_child(s, name) for s in stacks for name, _ in model.get_submodule(s).named_children()]
    return LayerStacks(tuple(stacks), tuple(paths))


def _outermost(found: list[str]) -> list[str]:
    kept: list[str] = []
    for path in found:
        if not any(path == k or path.startswith(k + ".") or k == "" for k in kept):
            kept.append(path)
    return kept


def _repeated_blocks(module: torch.nn.Module) -> bool:
    children = list(module.children())
    return len(children) >= 2 and len({type(c) for c in children}) == 1


def find_layer_stacks(model: torch.nn.Module) -> LayerStacks:
    """The model's layers by the module docstring's rule."""
    modules = list(model.named_modules())
    stacks = _outermost([n for n, m in modules if isinstance(m, torch.nn.ModuleList)])
    if not stacks:
        stacks = _outermost([n for n, m in modules if isinstance(m, torch.nn.Sequential) and _repeated_blocks(m)])
    return layer_stacks_at(model, stacks)


def leaf_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every module of `model` without children: the modules whose calls a recomputing
    plan's hook-only step checks (`slackswap.runtime.eager.module_calls`) and the capture counts
    (`slackswap.graph.LEAF_MODULE_CALLS_KEY`)."""
    return [(name, m) for name, m in model.named_modules() if next(m.children(), None) is None]
