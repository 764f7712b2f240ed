"""The export's decision per ATen call: the plan's decision of each tensor as a selective-checkpoint
policy (`policy_for`, a pure function of the decisions, asked by `_RegionPolicy` per call), and the
records of what it decided (`ExportDifference`, `StepRecord`)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

from slackswap.plan import Decision
from slackswap.runtime.export_compile import SWAP_MARK
from slackswap.runtime.export_facts import LAYER_OUTPUT
from slackswap.runtime.export_heads import name_storages
from slackswap.runtime.op_numbering import fresh_output_flags, writes_into

POLICY_OF = {
    Decision.KEEP: CheckpointPolicy.MUST_SAVE,
    Decision.RECOMPUTE: CheckpointPolicy.MUST_RECOMPUTE,
    Decision.SWAP: CheckpointPolicy.MUST_CPU_OFFLOAD,
}
#: What PyTorch does with a tensor under each policy, in the words of `ExportDifference.exported`.
DOES = {
    CheckpointPolicy.MUST_SAVE: "saved",
    CheckpointPolicy.PREFER_SAVE: "saved",
    CheckpointPolicy.MUST_RECOMPUTE: "recomputed",
    CheckpointPolicy.PREFER_RECOMPUTE: "recomputed",
    CheckpointPolicy.MUST_CPU_OFFLOAD: "offloaded",
    CheckpointPolicy.PREFER_CPU_OFFLOAD: "offloaded",
}
WANTS = {Decision.KEEP: "saved", Decision.RECOMPUTE: "recomputed", Decision.SWAP: "offloaded"}
#: Ops SAC never asks the policy about (torch.utils.checkpoint.SAC_IGNORED_OPS, the stable part).
_IGNORED = {torch.ops.aten.detach.default, torch.ops.prim.device.default}
_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
_OFFLOAD = (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)


@dataclass(frozen=True)
class ExportDifference:
    """A plan decision PyTorch's machinery executes otherwise."""

    tensor: str
    decision: str
    #: "saved", "recomputed", "offloaded", or "saved by autograd" (outside every layer).
    exported: str
    reason: str


_SOURCE_ROOT = re.compile(r"^.*?(?:__self__|L\['[^']+'\]|self)((?:\.[A-Za-z_][A-Za-z_0-9]*|\[\d+\])*)$")


def compiled_module_path(region_path: str) -> str:
    """Under torch.compile: the innermost module of the op being traced (dynamo's nn_module_stack),
    as a path below the region (dynamo names modules by their source, e.g. L['layer'].attn.qkv)."""
    import torch.fx.traceback as fx_traceback

    stack = (fx_traceback.current_meta or {}).get("nn_module_stack") or {}
    if not stack:
        return region_path
    source = list(stack.values())[-1][0]
    m = _SOURCE_ROOT.match(source)
    rest = m.group(1) if m else ""
    rest = re.sub(r"\[(\d+)\]", r".\1", rest)
    # Entries up to the region itself repeat the region's own path (whole-model compile): drop them.
    tail = rest.lstrip(".")
    if tail == region_path or tail.startswith(region_path + "."):
        return tail
    return f"{region_path}.{tail}" if tail else region_path


@dataclass
class StepRecord:
    """What one exported step did, per region: the policy applied to each identity it named."""

    applied: dict[str, CheckpointPolicy] = field(default_factory=dict)
    #: Identities saved because an in-place op wrote into them after their op (eager).
    in_place: set[str] = field(default_factory=set)
    #: Identities a layer returned (held by autograd as the next layer's input, whatever the policy).
    region_outputs: set[str] = field(default_factory=set)
    #: Identities saved because their op is random (a recompute must draw the same numbers).
    random: set[str] = field(default_factory=set)
    #: Identities saved because their op read a version a later in-place op overwrote (`VERSION_READ`).
    version_read: set[str] = field(default_factory=set)
    offloaded_bytes: int = 0
    saved_bytes: int = 0
    #: Storage -> bytes of every tensor the layers' checkpoint caches save (eager): `saved_bytes` by storage.
    saved_storages: dict[int, int] = field(default_factory=dict)
    #: Storage -> (identity of the op output that made it, weak reference) (eager): names what caches hold.
    names_of: dict[int, tuple] = field(default_factory=dict)


@dataclass
class SavedCount:
    """What autograd saves outside the layers' checkpoint caches in one step (`PlanExport.counting_saved`):
    storage -> bytes, the model's parameters, buffers and inputs left out (they are not activations)."""

    autograd: dict[int, int] = field(default_factory=dict)
    excluded: set[int] = field(default_factory=set)


def policy_for(decisions: tuple[Decision, ...], *, random: bool = False, reads_old_version: bool = False,
               held_by_reader: bool = False) -> CheckpointPolicy:
    """The policy of one ATen call, from the plan's decisions of its outputs and three facts about it:
    a pure function (like a JAX checkpoint policy), so the whole decision rule reads in one place.

    Saved whatever the plan says: a random op (its replay would draw other numbers), an op whose output
    a later reader reads at an older version (an in-place write follows), and a layer output another
    layer reads (it stays alive as that reader's input; offloading or recomputing it only adds a copy).
    Otherwise the most conservative of its outputs' decisions: keep over swap over recompute; an op
    with no decided output (not a saved tensor of the plan) is left to PyTorch to recompute.
    """
    if random or reads_old_version or held_by_reader:
        return CheckpointPolicy.MUST_SAVE
    if not decisions:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if Decision.KEEP in decisions:
        return CheckpointPolicy.MUST_SAVE
    if Decision.SWAP in decisions:
        return CheckpointPolicy.MUST_CPU_OFFLOAD
    return CheckpointPolicy.MUST_RECOMPUTE


class _RegionPolicy:
    """The SAC policy of one region call: names each op's outputs as the plan does, returns a policy."""

    def __init__(self, export: object, region: int, compiled: bool):  # a `PlanExport` (`install`)
        self.export, self.region, self.compiled = export, region, compiled
        self.path = export.regions[region]
        self.decisions = export.region_decisions[region]
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        #: Storage -> the decided identities of the op that created it (eager; in-place members join it).
        self.chain: dict[int, list[str]] = {}
        #: Eager: whether an op wrote into a tensor the region did not make (module state, an input).
        self.writes_outside = False

    def _path(self) -> str:
        if self.compiled:
            return compiled_module_path(self.path)
        return self.export.modules.current(self.path)

    def _compiled_count(self, path: str, packet: str, leaves: list, fresh: list[bool]) -> int | None:
        """Compiled: the eager call number of this call. The calls traced under compile are not eager's
        one for one (a dropout of p = 0 traces as a clone, which eager never calls), so the k-th call of a
        (module path, ATen packet) is matched with the k-th eager call there whose first output has the
        same bytes; None when eager has none (the call has no plan identity)."""
        sizes = [leaf.numel() * leaf.element_size() for leaf, f in zip(leaves, fresh, strict=False)
                 if f and isinstance(leaf, torch.Tensor)]
        key = (path, packet, sizes[0] if sizes else None)
        c = self.counts[key]
        self.counts[key] = c + 1
        eager = [k for k, size in self.export.eager_calls(self.region).get((path, packet), ()) if size == key[2]]
        return eager[c] if c < len(eager) else None

    def _dropout_names(self, path: str) -> list[tuple[str, int]]:
        """Compiled, a `native_dropout` where eager ran CPU's composite dropout (`empty_like` / `bernoulli_` /
        `div_` / `mul`: aten.dropout's Python kernel in torch._decomp routes every traced dropout to
        native_dropout): its output is eager's `mul` output, its mask eager's noise in another form (bool).
        The k-th native_dropout of a module is the k-th eager dropout there; [] when eager has none."""
        key = (path, "native_dropout")
        c = self.counts[key]
        self.counts[key] = c + 1
        dropouts = self.export.eager_dropouts(self.region).get(path, [])
        return [(dropouts[c][0], 0), (dropouts[c][1], 1)] if c < len(dropouts) else []

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        path, packet = self._path(), func.overloadpacket.__name__
        out = ctx.op_output
        if self.compiled:
            k = self._compiled_count(path, packet, list(tree_leaves(out)), fresh_output_flags(func, out))
        else:
            k = self.counts[(path, packet)]
            self.counts[(path, packet)] = k + 1
        random = torch.Tag.nondeterministic_seeded in func.tags
        written = [args[i] for i in writes_into(func) if i < len(args) and isinstance(args[i], torch.Tensor)]
        if written and not self.compiled:
            key = _storage(written[0])
            if key in self.chain:
                # An in-place write into a tensor this region made (CPU dropout: empty_like, bernoulli_,
                # div_). C++ callers keep using the first tensor, so a replay cannot swap in a cached
                # result of a later member: the whole chain is saved (`_SaveMode` re-points its head).
                for n in self.chain[key]:
                    self.export.record.applied[n] = CheckpointPolicy.MUST_SAVE
                    self.export.record.in_place.add(n)
                return CheckpointPolicy.MUST_SAVE
            self.writes_outside = True
            if not any(_storage(t) in self.chain or t.requires_grad for t in written):
                return CheckpointPolicy.MUST_SAVE  # module state (num_batches_tracked += 1): never twice
        leaves = list(tree_leaves(out))
        fresh = fresh_output_flags(func, out)
        #: (identity, index of its output leaf)
        named = [] if k is None else [
            (f"{path}/{packet}#{k}:{i}", i) for i, (leaf, f) in enumerate(zip(leaves, fresh, strict=False))
            if f and isinstance(leaf, torch.Tensor)]
        if self.compiled and packet == "native_dropout" and k is None:
            named = self._dropout_names(path)
        names = [n for n, _ in named]
        decided = [(n, self.decisions[n]) for n in names if n in self.decisions]
        read_old = not self.compiled and any(n in self.export.facts().version_readers for n in names)
        # A layer output another layer or an op outside reads stays alive as that reader's input: an
        # offload or a recompute of it would only add a copy (`_note_outputs` records it as saved).
        held = not self.compiled and any(self.export.facts().fixed_keep.get(n) == LAYER_OUTPUT for n in names)
        policy = policy_for(tuple(d for _, d in decided), random=random, reads_old_version=read_old,
                            held_by_reader=held)
        for n, _ in decided:
            self.export.record.applied[n] = policy
            if random:
                self.export.record.random.add(n)
            elif read_old:
                self.export.record.version_read.add(n)
        if self.compiled:
            self._tag_nodes(named, leaves)
        else:
            name_storages(self.export.record.names_of, named, leaves)
            for leaf, f in zip(leaves, fresh, strict=False):
                if f and isinstance(leaf, torch.Tensor):
                    self.chain[_storage(leaf)] = [n for n, _ in decided]
                    self.export._last_names[_storage(leaf)] = [n for n, _ in decided]
        return policy

    def _tag_nodes(self, named: list[tuple[str, int]], leaves: list) -> None:
        """Compiled: name the traced node of each output (node.meta['slackswap_tensor']), so the
        partition's saved values read back as plan tensors. The output is a FunctionalTensor over a
        FakeTensor; the proxy mode's tracker gives the node that computes it."""
        from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

        mode = get_proxy_mode()
        if mode is None:
            return
        for name, i in named:
            leaf = leaves[i]
            inner = torch._from_functional_tensor(leaf.elem) if hasattr(leaf, "elem") else leaf
            slot = get_proxy_slot(inner, mode.tracer, None)
            if slot is None:
                continue
            node = slot.proxy.node
            node.meta["slackswap_tensor"] = name
            if self.decisions.get(name) == Decision.SWAP:
                node.meta[SWAP_MARK] = True
            # Every node this op's decomposition added (back to nodes of earlier ops) is the op's.
            op = name.rsplit(":", 1)[0]
            todo = [node]
            while todo:
                n = todo.pop()
                if "slackswap_op" in n.meta or n.op != "call_function":
                    continue
                n.meta["slackswap_op"] = op
                todo.extend(n.all_input_nodes)



def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata

