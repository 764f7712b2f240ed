"""What the compiled partition saves, read from the backend (`recording_backend`), compared with the
plan (`partition_differences`, `saved_bytes`): each difference named with its reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slackswap.plan import Decision
from slackswap.runtime.export.install import PlanExport
from slackswap.runtime.export.policy import ExportDifference
from slackswap.runtime.export_compile import InductorBackend
from slackswap.runtime.export_facts import (
    LAYER_OUTPUT,
    module_path,
)
from slackswap.runtime.export_facts import region_of as _region_of


@dataclass(frozen=True)
class SavedValue:
    """One value the compiled partition saves for backward."""

    node: str
    #: The plan tensor the node computes (named by the export's policy at trace time), or None.
    tensor: str | None
    size_bytes: int
    offloaded: bool
    #: For a value inside an op's decomposition: the op ('layers.0.ln1/native_layer_norm#0'), or None.
    op: str | None = None
    #: A graph input of the compiled layer: a parameter or the layer's input (not an activation it made).
    is_input: bool = False
    #: For a value no policy call made (the partitioner moved part of the backward's decomposition into the
    #: forward, e.g. layer norm's rstd / width): the one plan tensor it is computed from, or None.
    derived_from: str | None = None

    @property
    def plan_tensor(self) -> str | None:
        """The plan tensor this value saves: its own name, or the one tensor it is computed from."""
        return self.tensor or self.derived_from


def _derived_from(node: torch.fx.Node) -> str | None:
    """The one plan tensor an untagged node is computed from (through untagged nodes only), or None."""
    if "slackswap_tensor" in node.meta or "slackswap_op" in node.meta or node.op != "call_function":
        return None
    found: set[str] = set()
    todo, seen = list(node.all_input_nodes), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if "slackswap_tensor" in n.meta:
            found.add(n.meta["slackswap_tensor"])
        elif n.op == "call_function" and "slackswap_op" not in n.meta:
            todo.extend(n.all_input_nodes)
        elif n.op != "get_attr":
            return None  # a graph input or a value inside an op's decomposition: not one tensor's function
    return found.pop() if len(found) == 1 else None


class Partitions(list):
    """The compiled backwards' saved values, one list per compiled layer function (`recording_backend`),
    and `traced`: every plan tensor some node of a compiled forward computes (its identity exists under
    compile), so a planned tensor the partition lacks reads as not read or as renamed."""

    def __init__(self) -> None:
        super().__init__()
        self.traced: set[str] = set()


def recording_backend() -> tuple[Callable, Partitions]:
    """An inductor backend that also records each compiled backward's saved inputs (the partition)."""
    from torch._inductor.compile_fx import compile_fx_inner

    partitions = Partitions()
    forward_names: dict[object, dict[str, tuple[str | None, str | None, str | None]]] = {}

    def inner(gm, example_inputs, *args, **kwargs):
        names = forward_names.setdefault(kwargs.get("graph_id"), {})
        if not kwargs.get("is_backward"):
            for node in gm.graph.nodes:
                source = node.args[0] if node.name.startswith("cpu_offload_") and node.args else node
                meta = getattr(source, "meta", {})
                derived = _derived_from(source) if isinstance(source, torch.fx.Node) else None
                names[node.name] = (meta.get("slackswap_tensor"), meta.get("slackswap_op"), derived)
                if meta.get("slackswap_tensor"):
                    partitions.traced.add(meta["slackswap_tensor"])
        else:
            saved = []
            for node in gm.graph.find_nodes(op="placeholder"):
                if node.name.startswith("tangents"):
                    continue
                val = node.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    continue
                size = val.numel() * val.element_size()
                tensor, op, derived = names.get(node.name, (None, None, None))
                tensor = node.meta.get("slackswap_tensor") or tensor
                op = node.meta.get("slackswap_op") or op
                saved.append(SavedValue(node.name, tensor, size, node.name.startswith("cpu_offload_"), op,
                                        node.name.startswith("primals"), None if tensor else derived))
            partitions.append(saved)
        return compile_fx_inner(gm, example_inputs, *args, **kwargs)

    return InductorBackend(inner), partitions


NOT_READ = ("the compiled backward does not read it: its decomposition reads other values (layer norm's "
            "normalized input instead of its input and mean)")
RENAMED = ("no node of the compiled forward carries this identity: the ATen calls traced under compile differ "
           "from eager's (inductor's dropout draws its own mask instead of CPU eager's empty_like / bernoulli_ / "
           "div_), so no compiled call matches this one")
DERIVED = ("saved in another form, on the device: the partitioner moved a piece of the backward that reads it into "
           "the forward and saves its result, which no policy tagged for offloading")
HELD_OUTPUT = "the compiled layer's output: autograd holds it as the next layer's input, outside the partition"
UNPLANNED = "the plan does not name it: the compiled backward reads a value of the op's decomposition"
MASK_FORM = ("saved in another form: under compile a dropout is one native_dropout (aten.dropout's Python kernel in "
             "torch._decomp), whose mask is bool, 1 B per element, where CPU eager's is the fp32 noise of empty_like / "
             "bernoulli_ / div_, 4 B per element, which a plan made for eager prices (plan_for_export(..., "
             "compile=True) prices the mask as compiled)")
OTHER_BYTES = "saved with other bytes than eager's tensor (another dtype or shape under compile)"


def differences_by_reason(differences: list[ExportDifference]) -> dict[str, int]:
    """How many differences each reason names, by the reason's first clause (before its first colon)."""
    return dict(Counter(d.reason.split(":")[0] for d in differences))


def partition_differences(export: PlanExport, partitions: list[list[SavedValue]]) -> list[ExportDifference]:
    """The compiled partitions' saved values against the plan, every difference named.

    Planned on the device: keep; planned on the host: swap; planned absent: recompute. A saved value
    that is a graph input (parameter or the layer's input) is not an activation the layer made and is
    left out; a value computed from exactly one plan tensor (`SavedValue.derived_from`) saves that
    tensor. What remains, by kind: a plan tensor saved otherwise than planned; a planned tensor the
    partition does not save (the layer's output, held outside it; a value the decomposed backward does
    not read; an identity no call has under compile); a plan tensor saved with other bytes (a dropout's
    mask, bool under compile); a value the plan does not name."""
    saved = [v for part in partitions for v in part if not v.is_input]
    got: dict[str, SavedValue] = {}
    for v in saved:
        if v.plan_tensor is not None:
            got.setdefault(v.plan_tensor, v)
    traced = getattr(partitions, "traced", None)
    outputs = {n for n, why in export.facts().fixed_keep.items() if why == LAYER_OUTPUT}
    out: list[ExportDifference] = []
    for region, decisions in enumerate(export.region_decisions):
        for name, decision in sorted(decisions.items()):
            v = got.get(export.translate(name, region))
            if v is None:
                if decision == Decision.RECOMPUTE:
                    continue
                if name in outputs:
                    out.append(ExportDifference(name, str(decision), "held", HELD_OUTPUT))
                elif traced is not None and export.translate(name, region) not in traced:
                    out.append(ExportDifference(name, str(decision), "not saved", RENAMED))
                else:
                    out.append(ExportDifference(name, str(decision), "not saved", NOT_READ))
            elif decision == Decision.RECOMPUTE:
                out.append(ExportDifference(name, str(decision), "offloaded" if v.offloaded else "saved",
                                            "the partitioner saves it: a random op's output or an output of "
                                            "an op that also makes a kept tensor"))
            elif (decision == Decision.SWAP) != v.offloaded:
                why = ("one policy per op" if decision != Decision.SWAP else DERIVED if v.tensor is None else
                       "torch's offload pass skips views, non-contiguous tensors and model outputs")
                out.append(ExportDifference(name, str(decision), "offloaded" if v.offloaded else "saved", why))
            elif v.size_bytes != export.graph.tensors[name].size_bytes and v.tensor is not None:
                noises = {n for ds in export.eager_dropouts(region).values() for _, n in ds}
                out.append(ExportDifference(name, str(decision), "offloaded" if v.offloaded else "saved",
                                            MASK_FORM if name in noises else OTHER_BYTES))
    for v in saved:
        if v.plan_tensor is None or v.plan_tensor not in export.plan.decisions:
            what = v.plan_tensor or (f"a value inside {v.op}" if v.op else f"compiled value {v.node}")
            out.append(ExportDifference(what, "none", "offloaded" if v.offloaded else "saved", UNPLANNED))
    return out


def saved_bytes(partitions: list[list[SavedValue]], export: PlanExport | None = None,
                which: Callable[[SavedValue], bool] | None = None) -> tuple[int, int]:
    """(device bytes, host bytes) the compiled partitions save per step, graph inputs left out (and, with
    `which`, the values it rejects). With `export`, a partition shared by a group of layers counts once
    per layer of the group."""
    device = host = 0
    for part in partitions:
        values = [v for v in part if not v.is_input]
        times = 1
        if export is not None:
            named = next((v.tensor for v in values if v.tensor), None)
            rep = _region_of(module_path(named), export.regions) if named else None
            times = sum(1 for g in export.group_of.values() if g == rep) if rep is not None else 1
        values = [v for v in values if which is None or which(v)]
        device += times * sum(v.size_bytes for v in values if not v.offloaded)
        host += times * sum(v.size_bytes for v in values if v.offloaded)
    return device, host

