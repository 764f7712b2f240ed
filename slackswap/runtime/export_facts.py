"""What PyTorch's checkpointing decides itself, from the graph and the model's layers alone: the space
of plans the export executes decision for decision.

Why: `slackswap.runtime.export.PlanExport` runs any plan, but some decisions are PyTorch's, not the
plan's (docs/runtime.md, "The export"). Known before any step runs, they are facts of the captured
graph and of the checkpoint regions (the model's layers, `slackswap.profile.torch.layer_stacks`):
- a tensor outside every layer is saved by autograd (no region's policy governs it);
- a layer's output is held as the next layer's input (or by an op outside), whatever the policy;
- an op that an in-place call writes into afterwards (CPU dropout's `empty_like` / `bernoulli_` /
  `div_`, one graph op: `slackswap.runtime.op_numbering`) is saved: a replay cannot redo the writes
  into the tensor the caller holds;
- a random op's outputs are saved, so a recompute's RNG stream stays aligned;
- an op with several saved outputs gets one policy: they are saved, offloaded or recomputed together;
- a checkpoint candidate (a tensor autograd does not save) outside every layer is never kept, unless
  a layer reads it: a layer's inputs are held by its checkpoint for the recompute.
The first four fix a tensor to keep (`ExportFacts.fixed_keep`, each with its reason, the words
`ExportDifference.reason` uses); the fifth ties decisions (`ExportFacts.tied`); the last leaves a
candidate undecided (`ExportFacts.not_kept`) or keeps it (`ExportFacts.held_inputs`).
`slackswap.experiment.export_plan.plan_for_export` plans with those tensors kept and the tied ones
alike (`slackswap.planners.support.fixed_keep`), so the export's `step_differences()` is empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from slackswap.errors import ConfigError
from slackswap.graph import FORWARD_PHASES, Graph
from slackswap.profile.torch.layer_stacks import find_layer_stacks
from slackswap.runtime.op_numbering import call_number, overload_of, writes_into

OUTSIDE = "produced outside every layer (no checkpoint region governs it)"
LAYER_OUTPUT = ("an output of its layer: the next layer's checkpoint (or an op outside) holds it as an input, "
                "whatever the policy")
IN_PLACE = ("an in-place op wrote into it after its op (CPU dropout's bernoulli_ and div_): a replay cannot redo "
            "the writes into the tensor the caller holds, so the chain is saved")
RANDOM = "a random op's output: saved so a recompute draws the same numbers"
VERSION_READ = ("it read a tensor of its layer that a later in-place op overwrites (Mixtral's router: topk, then "
                "sum, then div_ into topk's values): the checkpoint's cache holds that tensor's last version only, so "
                "a recompute would read the overwritten one; saved so the recompute never runs it")
SEVERAL_OUTPUTS = "its op also makes a tensor the plan decides otherwise: one policy per op"
LAYER_INPUT = ("an input of a layer autograd does not save: the layer's checkpoint holds it for the recompute "
               "until the layer's backward, whatever the plan")
NOT_KEPT = ("a checkpoint candidate outside every layer: autograd does not save it and no checkpoint region "
            "governs it, so it is freed after its last forward reader")


def layer_paths(model: torch.nn.Module) -> list[str]:
    """Module paths of the model's layers (`layer_stacks.find_layer_stacks`, the capture's and the
    tracer's rule): the checkpoint regions, region i being layer i of the graph."""
    return list(find_layer_stacks(model).paths)


def module_path(identity: str) -> str:
    """'layers.3.attn@1/addmm#0:0' -> 'layers.3.attn' (module path without the call suffix)."""
    return identity.rsplit("/", 1)[0].split("@", 1)[0]


def region_of(path: str, regions: list[str]) -> int | None:
    for i, r in enumerate(regions):
        if path == r or path.startswith(r + "."):
            return i
    return None


@dataclass(frozen=True)
class ExportFacts:
    """The saved tensors whose decision PyTorch fixes to keep (name -> reason), and the groups of saved
    tensors it decides alike (several saved outputs of one op inside a layer)."""

    fixed_keep: Mapping[str, str]
    tied: tuple[tuple[str, ...], ...]
    #: Checkpoint candidates outside every layer: autograd does not save them and no region's policy
    #: governs them, so a plan's decision to keep or swap one is not executed.
    not_kept: frozenset[str] = frozenset()
    #: Tensors autograd does not save that a layer reads from outside it (an attention mask made once
    #: for all layers): the layer's checkpoint holds them for its recompute, so they are kept.
    held_inputs: Mapping[str, str] = field(default_factory=dict)
    #: Per op inside a layer with a saved output or several candidate outputs: every output a plan can
    #: decide (saved tensors and checkpoint candidates). Selective checkpointing caches an op's outputs
    #: whole, so a kept member keeps them all (LayerNorm's and BatchNorm's outputs beside their saved
    #: statistics, topk's values beside its indices): `plan_for_export` decides them alike and prices it.
    cached_together: tuple[tuple[str, ...], ...] = ()
    #: Every output (saved or not) of an op inside a layer that read a version of a tensor a later
    #: in-place op overwrote (`VERSION_READ`): the export's policy saves these ops whatever the plan says.
    version_readers: frozenset[str] = frozenset()


def export_facts(graph: Graph, regions: list[str]) -> ExportFacts:
    """`ExportFacts` of a graph captured by `slackswap.runtime.capture_graph` (ops named `op{k}:{overload}`)
    for the checkpoint regions `regions` (`layer_paths(model)`)."""
    if graph.meta.get("source") != "slackswap.runtime.capture":
        raise ConfigError("graph", graph.name, "the export's facts are read from a graph captured by "
                          "slackswap.runtime.capture_graph (ops named op{k}:{overload}, one per ATen call); "
                          "translate a traced plan with slackswap.runtime.translate.plan_on_captured first")
    ops, tensors = graph.op_by_name, graph.tensors
    saved = {t.name for t in graph.saved_tensors}
    fixed: dict[str, str] = {}
    held: dict[str, str] = {}

    def fix(op_name: str, reason: str) -> None:
        for t in ops[op_name].outputs:
            if t in saved:
                fixed.setdefault(t, reason)
            elif reason in (IN_PLACE, RANDOM) and t in graph.candidate_names:
                held.setdefault(t, reason)  # cached whole with its op (Falcon's scores /= ...): held

    for name in sorted(saved):
        if region_of(module_path(name), regions) is None:
            fixed[name] = OUTSIDE
    forward = [op for op in graph.ops if op.phase in FORWARD_PHASES]
    maker = None  # the latest forward op that created a storage
    for i, op in enumerate(forward):
        region = op.layer if 0 <= op.layer < len(regions) else None  # capture's layer: the region index
        func = overload_of(op.name)
        maker = op if op.outputs else maker
        # A gap in the call numbers after this op is an in-place call joined to the latest op that created a
        # storage (op_numbering), which is this op or one before it when only views came in between:
        # `scores = q @ k.T; scores /= 4.0` is bmm, _unsafe_view, then div_ joined to the bmm.
        joined = i + 1 < len(forward) and call_number(forward[i + 1].name) > call_number(op.name) + 1
        if joined and maker is not None and 0 <= maker.layer < len(regions):
            fix(maker.name, IN_PLACE)
        if region is not None and func is not None and writes_into(func) and op.inputs:
            written = tensors[op.inputs[0]]  # an in-place op of its own: it writes its first argument
            if region_of(module_path(written.name), regions) is not None:
                fix(written.producer, IN_PLACE)
        if region is not None and func is not None and torch.Tag.nondeterministic_seeded in func.tags:
            fix(op.name, RANDOM)
        for t in op.inputs:  # a tensor of another region read here: that region's output
            source = region_of(module_path(t), regions)
            if source is not None and source != op.layer:
                fix(tensors[t].producer, LAYER_OUTPUT)
            if region is not None and source != region and t not in saved:
                held[t] = LAYER_INPUT
    readers = _version_readers(graph, forward, regions)
    for name in readers:
        if name in saved:
            fixed.setdefault(name, VERSION_READ)
    tied = []
    for op in forward:
        group = tuple(t for t in op.outputs if t in saved and t not in fixed)
        if len(group) > 1 and region_of(module_path(group[0]), regions) is not None:
            tied.append(group)
    outside = frozenset(t for t in graph.candidate_names if region_of(module_path(t), regions) is None
                        and t not in held)
    together = []
    candidates = graph.candidate_names
    for op in forward:
        if not 0 <= op.layer < len(regions):
            continue
        members = tuple(t for t in op.outputs if t in saved or t in candidates)
        if any(t in candidates for t in members) and (len(members) > 1):
            together.append(members)
    return ExportFacts(fixed, tuple(tied), outside, held, tuple(together), readers)


def _version_readers(graph: Graph, forward: list, regions: list[str]) -> frozenset[str]:
    """The outputs of every op inside a layer that read (through any view) a tensor of its layer between the
    op that made the tensor and a later in-place op (one of its own, not joined to the maker) that writes
    into it. Views are left out: at the replay they alias the cached tensor, whose last version the ops
    after the write read anyway."""
    index = {op.name: i for i, op in enumerate(forward)}
    tensors = graph.tensors
    out: set[str] = set()
    for i, op in enumerate(forward):
        func = overload_of(op.name)
        if op.layer < 0 or op.layer >= len(regions) or func is None or not writes_into(func) or not op.inputs:
            continue
        root = graph.storage_root(op.inputs[0])
        if region_of(module_path(root), regions) is None or tensors[root].producer not in index:
            continue
        for reader in forward[index[tensors[root].producer] + 1:i]:
            f = overload_of(reader.name)
            if f is None or f.is_view or writes_into(f):
                continue
            if any(graph.storage_root(t) == root for t in reader.inputs):
                out.update(reader.outputs)
    return frozenset(out)


__all__ = ["IN_PLACE", "LAYER_INPUT", "LAYER_OUTPUT", "NOT_KEPT", "OUTSIDE", "RANDOM", "SEVERAL_OUTPUTS",
           "VERSION_READ", "ExportFacts", "export_facts", "layer_paths", "module_path", "region_of"]
