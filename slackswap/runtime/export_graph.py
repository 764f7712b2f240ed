"""The graph a plan for the export is made on: the captured step with each tensor at the bytes the
executor that runs the export stores, eager or compiled.

Why: the two executors save the same tensors (the same names) but not the same bytes for one of
them. CPU eager runs a dropout as ATen's composite (`empty_like` / `bernoulli_` / `div_` / `mul`), so
its saved mask is the noise tensor in the input's dtype (fp32: 4 B per element), which the captured
graph records. Under `torch.compile` a dropout is one `native_dropout` (aten.dropout's Python kernel
in torch._decomp routes every traced dropout to it) and its saved mask is that op's second output;
the export names that mask as eager's noise (`slackswap.runtime.export.policy._RegionPolicy._dropout_names`).
A plan priced on the captured graph therefore overstates the compiled step's kept bytes by the
difference, and the simulator's figures for it describe eager, not the compiled step.
`graph_for_compile` gives each such noise, inside a checkpointed layer (only those are compiled: the
export compiles layer by layer, a dropout outside every layer runs eagerly), the bytes of
`native_dropout`'s mask, read from torch itself: the op's meta kernel, the one the compile traces the
joint graph with, run on a meta tensor of the noise's dtype and element count (bool: 1 B per element
in torch 2.13). Nothing else changes (the ops, their timings, every other tensor), so the export's
facts and a plan's names are the same on both graphs.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import torch

from slackswap.errors import ConfigError
from slackswap.graph import Graph, Tensor
from slackswap.plan import Plan
from slackswap.runtime.export_facts import module_path, region_of
from slackswap.runtime.op_numbering import overload_of

#: graph.meta key set by `graph_for_compile`: {noise tensor: its eager bytes}.
COMPILED_MASKS = "compiled_dropout_masks"
#: plan.notes key set by `slackswap.experiment.export_plan.plan_for_export`: "eager" or "compile".
EXPORT_EXECUTOR = "export_executor"


def composite_dropouts(graph: Graph, layer: int | None = None) -> list[tuple[str, str]]:
    """[(output, noise)] of CPU eager's composite dropouts, in call order (of `layer` only, if given): an
    `empty_like` (its in-place `bernoulli_` / `div_` joined to it) whose output a forward `mul` reads."""
    ops, tensors = graph.op_by_name, graph.tensors
    out = []
    for op in graph.forward_ops:
        if (layer is not None and op.layer != layer) or overload_of(op.name) is not torch.ops.aten.empty_like.default:
            continue
        noise = op.outputs[0]
        readers = [ops[c] for c in tensors[noise].consumers
                   if ops[c].phase == op.phase and overload_of(c) is torch.ops.aten.mul.Tensor]
        if readers:
            out.append((readers[0].outputs[0], noise))
    return out


def compiled_mask_bytes(noise: Tensor) -> int:
    """The bytes of the mask `native_dropout` saves for a dropout whose eager noise is `noise` (the
    captured tensor's role is its dtype): the op's meta kernel on a meta tensor of that dtype and element
    count. The drop probability does not change the mask's dtype or shape; 0.5 stands for any in (0, 1)
    (a dropout of p = 0 makes no noise in eager)."""
    dtype = getattr(torch, noise.role, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError("graph", noise.name, f"role {noise.role!r} is not a torch dtype: the noise's dtype is "
                          "read from the captured tensor's role (slackswap.runtime.capture_graph)")
    size = torch.empty((), dtype=dtype).element_size()
    if noise.size_bytes % size:
        raise ConfigError("graph", noise.name, f"{noise.size_bytes} B is not a whole number of {dtype} elements")
    _, mask = torch.ops.aten.native_dropout.default(
        torch.empty(noise.size_bytes // size, dtype=dtype, device="meta"), 0.5, True)
    return mask.numel() * mask.element_size()


def graph_for_compile(graph: Graph, regions: list[str]) -> Graph:
    """`graph` as the compiled export stores it: each composite dropout's noise inside a layer of
    `regions` (`layer_paths(model)`) at its `compiled_mask_bytes` (module docstring). Idempotent; the
    graph itself where it has no such dropout (CUDA eager already runs `native_dropout`)."""
    if COMPILED_MASKS in graph.meta:
        return graph
    tensors = dict(graph.tensors)
    eager_bytes = {}
    for _, noise in composite_dropouts(graph):
        if region_of(module_path(noise), regions) is None:
            continue  # outside every layer: not compiled, eager's noise
        t = graph.tensors[noise]
        if t.base:
            raise ConfigError("graph", noise, "a dropout's noise is a view: the compiled mask's storage is its own")
        tensors[noise] = replace(t, size_bytes=compiled_mask_bytes(t))
        eager_bytes[noise] = t.size_bytes
    if not eager_bytes:
        return graph
    meta = {**dict(graph.meta), COMPILED_MASKS: eager_bytes}
    return replace(graph, name=f"{graph.name}+compiled", tensors=MappingProxyType(tensors), meta=meta)


def export_graph(graph: Graph, regions: list[str], compile: bool) -> Graph:
    """The graph a plan for the export is made on and checked against: compiled, `graph_for_compile`;
    eager, the captured graph (what CPU eager stores)."""
    return graph_for_compile(graph, regions) if compile else graph


def priced_for(plan: Plan, compile: bool) -> Plan:
    """`plan`'s decisions with its notes naming the executor it is priced for (`EXPORT_EXECUTOR`):
    `plan_for_export` marks its plans so, and the same decisions priced for the other executor
    (an eager step that reads which decisions PyTorch executes, the residue a compiled step of a
    plan made for eager leaves) are this plan marked otherwise."""
    return replace(plan, notes={**dict(plan.notes), EXPORT_EXECUTOR: "compile" if compile else "eager"})


def made_for_compile(plan: Plan) -> bool:
    """The plan was made for the compiled export (`plan_for_export(..., compile=True)`)."""
    return plan.notes.get(EXPORT_EXECUTOR) == "compile"


__all__ = ["COMPILED_MASKS", "EXPORT_EXECUTOR", "composite_dropouts", "compiled_mask_bytes",
           "export_graph", "graph_for_compile", "made_for_compile", "priced_for"]
