"""How the export compiles a layer so that the partition saves the plan's tensors: the joint graph is
made of the ATen ops eager ran, not of their decompositions, and the plan's swaps reach torch's
offload pass tensor by tensor.

Why: a plan names eager's saved tensors (`slackswap.runtime.capture_graph`: per ATen call, what its
autograd formula saves). Inductor's default decomposition table rewrites ops such as
`native_layer_norm`, `gelu`, `_softmax` and their backward ops into primitives before the
min-cut partitioner runs, so the compiled backward reads other values (layer norm's normalized input
and rstd / width, GELU's `erf + 1`) than the ones the plan decides, and its dropout draws inductor's
own random numbers. Three mechanisms of torch 2.13, scoped to the export's own compile (arguments of
`torch._inductor.compile_fx.compile_fx`, and the joint pass in a config patch inside
`PlanExport.installed`), undo that. The one process-wide trace they leave is inductor's own: the
fallback lowering registered for an op first lowered by falling back, which a default compile never
consults (its table decomposes those ops before lowering).
- `decompositions`: inductor's table without the ops of the captured step that make or read a saved
  tensor (`undecomposed_ops`; views left out, they never change which storage is saved). The joint
  graph then carries eager's ATen ops and their eager autograd formulas, which read exactly eager's
  saved tensors; inductor falls back to the ATen kernel for an op it has no lowering for
  (`torch._inductor.graph.GraphLowering.call_function`, `implicit_fallbacks`). The export registers
  those fallbacks itself, just before inductor lowers each graph, with the layout constraint
  inductor's implicit path would choose (`register_fallbacks`): inductor's implicit path asserts where
  the environment variable `CI` is set and the op has a decomposition somewhere (its guard against
  ops of its own lowering table missing a decomposition), which is exactly what the export does on
  purpose;
- `config_patches={"fallback_random": True}`: `native_dropout` stays one ATen call (no
  `replace_random` rewrite into `rand > p`) and runs ATen's CPU kernel, which draws eager's mask
  from the same generator (`torch/_inductor/lowering.py: native_dropout`);
- `OffloadMarks` (the last joint-graph pass, `joint_custom_post_pass`: after inductor's own
  `remove_noop_ops`, which would drop the copy below): a node the policy tagged
  `MUST_CPU_OFFLOAD`, or a node of a tensor the plan swaps, is `MUST_SAVE` plus `should_offload`,
  the only mark torch's offload pass reads. That pass never moves the output of a multi-output op
  (a `getitem`: `_activation_offloading.can_offload`), so such a tensor the plan swaps is handed
  to it as a contiguous copy (`aten.clone`, inserted after the getitem and read instead of it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch.utils.checkpoint import CheckpointPolicy

from slackswap.graph import Graph
from slackswap.runtime.op_numbering import overload_of

#: inductor config of the export's compile (`compile_fx(config_patches=...)`).
CONFIG_PATCHES = {"fallback_random": True}
_OFFLOAD = (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)
#: node.meta key: the plan swaps the tensor this node computes (set by the export's policy at trace time).
SWAP_MARK = "slackswap_swap"


def undecomposed_ops(graph: Graph) -> frozenset[torch._ops.OpOverload]:
    """The ATen overloads of the captured step that produce a saved tensor or read one (or a view of
    one), views left out: kept out of the decomposition table so the joint graph saves what eager saves."""
    roots = {t.name for t in graph.saved_tensors}
    touching = set()
    for name, t in graph.tensors.items():
        if graph.storage_root(name) in roots:
            touching.add(t.producer)
            touching.update(t.consumers)
    out = set()
    for op in graph.ops:
        func = overload_of(op.name) if op.name in touching else None
        if func is not None and not func.is_view:
            out.add(func)
    return frozenset(out)


def decomposition_table(keep: frozenset) -> dict:
    """inductor's decomposition table under `CONFIG_PATCHES` (with `fallback_random` it has no random
    decompositions), without the overloads in `keep`."""
    import torch._inductor.config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    with inductor_config.patch(CONFIG_PATCHES):
        table = select_decomp_table()
    return {op: fn for op, fn in table.items() if op not in keep}


def register_fallbacks(gm: torch.fx.GraphModule, undecomposed: frozenset, decompositions: dict,
                       is_backward: bool) -> None:
    """Register the ATen-kernel fallback lowering of each op of `gm` in `undecomposed` that inductor
    has none for, with the layout constraint `GraphLowering.call_function`'s implicit path gives it
    (a built-in op without a layout tag must have contiguous inputs in a backward graph; otherwise
    its tag's constraint), checked against the compile's own `decompositions` as inductor checks
    it, and `warn=False`, so that inductor's CI guard does not refuse an op the
    export keeps undecomposed on purpose. Ops outside `undecomposed`, and everything with
    `implicit_fallbacks` off, stay inductor's own decision."""
    import torch._inductor.config as inductor_config
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag, is_builtin

    if not inductor_config.implicit_fallbacks:
        return
    for node in gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or op not in undecomposed or op in lowering.lowerings:
            continue
        if get_layout_constraint_tag(op, with_default=False) is None and is_builtin(op) and is_backward:
            constraint = lowering.require_contiguous
        else:
            constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        lowering.make_fallback(op, layout_constraint=constraint, warn=False,
                               get_decomp_fn=lambda: decompositions)


@dataclass(frozen=True)
class FallbackRegisteringCompile:
    """An inductor `inner_compile` that registers the export's fallbacks (`register_fallbacks`) for
    the graph it is given, then compiles it with `inner_compile`."""

    inner_compile: Callable
    undecomposed: frozenset
    decompositions: dict

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: object) -> object:
        register_fallbacks(gm, self.undecomposed, self.decompositions,
                           is_backward=bool(kwargs.get("is_backward", False)))
        return self.inner_compile(gm, example_inputs, **kwargs)


@dataclass(frozen=True)
class InductorBackend:
    """A `torch.compile` backend: inductor with `inner_compile` (the default one, or a recording one),
    and, once `for_graph` gave them, the export's undecomposed ops, decomposition table and config."""

    inner_compile: Callable | None = None
    undecomposed: frozenset | None = None
    decompositions: dict | None = None
    config_patches: dict | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        inner_compile = self.inner_compile or compile_fx_inner
        if self.undecomposed:
            inner_compile = FallbackRegisteringCompile(inner_compile, self.undecomposed, self.decompositions)
        return compile_fx(gm, example_inputs, inner_compile=inner_compile,
                          decompositions=self.decompositions, config_patches=self.config_patches)

    def for_graph(self, graph: Graph) -> InductorBackend:
        """This backend with the export's undecomposed ops, decompositions and config for the captured
        step `graph`."""
        undecomposed = undecomposed_ops(graph)
        return replace(self, undecomposed=undecomposed, decompositions=decomposition_table(undecomposed),
                       config_patches=dict(CONFIG_PATCHES))


def export_backend(backend: object, graph: Graph) -> object:
    """The backend a compiled layer of the export uses: inductor ("inductor" or an `InductorBackend`)
    with the export's decompositions and config; any other backend as given."""
    if backend == "inductor":
        backend = InductorBackend()
    return backend.for_graph(graph) if isinstance(backend, InductorBackend) else backend


@contextmanager
def offload_enabled() -> Iterator[None]:
    """torch._functorch's activation-offload pass on, and the plan's swaps marked for it."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with functorch_config.patch(enable_activation_offloading=True), inductor_config.patch(
            joint_custom_post_pass=OffloadMarks()):
        yield


def _custom_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


class OffloadMarks(_custom_pass_base()):
    """Joint-graph pass: a node the policy tagged MUST_CPU_OFFLOAD, or one whose tensor the plan swaps
    (`SWAP_MARK`), is saved (MUST_SAVE) and marked `should_offload`, which torch 2.13's partitioner
    offload pass reads (it reads nothing else). A multi-output op's node stays MUST_SAVE only (its
    getitems carry the tensors); a swapped getitem, which that pass skips, is read through a copy
    the pass offloads."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            offload = node.meta.get("recompute") in _OFFLOAD
            if not (offload or node.meta.get(SWAP_MARK)):
                continue
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            if not isinstance(node.meta.get("val"), torch.Tensor):
                continue  # a multi-output op: its getitems are the tensors
            if node.target is not _getitem():
                node.meta["should_offload"] = True
            elif node.meta.get(SWAP_MARK):
                with graph.inserting_after(node):
                    copy = graph.call_function(torch.ops.aten.clone.default, (node,))
                node.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)
                copy.meta.update(node.meta)
                copy.meta["should_offload"] = True

    def uuid(self) -> str:
        return "slackswap.runtime.export_compile.OffloadMarks/2"


def _getitem() -> object:
    import operator

    return operator.getitem


__all__ = ["CONFIG_PATCHES", "SWAP_MARK", "FallbackRegisteringCompile", "InductorBackend", "OffloadMarks",
           "decomposition_table", "export_backend", "offload_enabled", "register_fallbacks",
           "undecomposed_ops"]
