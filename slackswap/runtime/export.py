"""Export a plan to PyTorch's own machinery: one selective-checkpoint policy per transformer layer.

Why: the eager runtime (`slackswap.runtime.eager`) runs a plan at its own positions but pays Python per ATen
call, and it turns `torch.compile` off. PyTorch already executes such decisions itself:
`torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, context_fn=...)` with a
selective-checkpoint (SAC) policy saves what the policy says (`CheckpointPolicy.MUST_SAVE`) and
recomputes the rest, in eager mode and under `torch.compile` (where the partitioner reads the policy
from each traced node). The export maps keep -> MUST_SAVE, recompute -> MUST_RECOMPUTE, swap ->
MUST_CPU_OFFLOAD, op by op, by the tensor's storage identity (the names plans use).

What PyTorch then decides itself, not the plan (docs/runtime.md, "The export"):
- where recomputation runs: eager, at the first backward unpack of any tensor of the layer, the whole
  layer up to its last needed tensor; compiled, wherever the partitioner puts the recomputed nodes;
- in torch 2.13 MUST_CPU_OFFLOAD is *not* an offload: eager SAC treats it as recompute and the
  partitioner ignores it (only nodes a pass marks `should_offload` are offloaded). The export
  therefore runs swaps itself in eager mode (`_SaveMode`: the copy is made when the op returns, the
  reload at the layer's recompute) and, compiled, turns the plan's swaps into MUST_SAVE plus
  `should_offload` in a joint-graph pass, so `torch._functorch`'s offload pass moves them (offload after
  the tensor's last forward use, reload where backward first needs it);
- compiled, inductor would decompose the ops the plan names and draw its own dropout masks: the
  export's compile keeps those ops whole and ATen's RNG (`slackswap.runtime.export_compile`), so the
  partition saves the plan's tensors, a dropout's mask in its compiled form (bool), which a plan made
  for the compiled export prices (`slackswap.runtime.export_graph`);
- only ops inside a layer are governed: a tensor outside every layer is saved by autograd as usual,
  a layer's input is held by checkpoint for the recompute, a random op's output is always saved (so
  the RNG stream of a recompute stays aligned), an op with several outputs gets one policy. Each such
  case is an `ExportDifference` naming the tensor, what the plan wanted, what PyTorch does, and why.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from slackswap.graph import Graph
from slackswap.plan import Decision, Plan
from slackswap.profile.torch.identity import ModuleStack
from slackswap.runtime.errors import RuntimeUsageError
from slackswap.runtime.export_compile import SWAP_MARK, InductorBackend, OffloadMarks, export_backend, offload_enabled
from slackswap.runtime.export_facts import (
    IN_PLACE,
    LAYER_OUTPUT,
    NOT_KEPT,
    OUTSIDE,
    RANDOM,
    SEVERAL_OUTPUTS,
    VERSION_READ,
    export_facts,
    layer_paths,
    module_path,
)
from slackswap.runtime.export_facts import region_of as _region_of
from slackswap.runtime.export_graph import (
    COMPILED_MASKS,
    composite_dropouts,
    graph_for_compile,
    made_for_compile,
)
from slackswap.runtime.export_heads import cached_differences, head_outputs, name_storages, weak_outputs
from slackswap.runtime.identity import check_identity
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


class _RegionPolicy:
    """The SAC policy of one region call: names each op's outputs as the plan does, returns a policy."""

    def __init__(self, export: PlanExport, region: int, compiled: bool):
        self.export, self.region, self.compiled = export, region, compiled
        self.path = export.regions[region]
        self.decisions = export.region_decisions[region]
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        #: Storage -> the decided identities of the op that created it (eager; in-place members join it).
        self.chain: dict[int, list[str]] = {}

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
        if random or read_old:
            policy = CheckpointPolicy.MUST_SAVE
        elif not decided:
            policy = CheckpointPolicy.PREFER_RECOMPUTE
        elif any(d == Decision.KEEP for _, d in decided):
            policy = CheckpointPolicy.MUST_SAVE
        elif any(d == Decision.SWAP for _, d in decided):
            policy = CheckpointPolicy.MUST_CPU_OFFLOAD
        else:
            policy = CheckpointPolicy.MUST_RECOMPUTE
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


def _fresh_function(fn: Callable) -> Callable:
    """A copy of `fn` with its own code object (dynamo caches and guards per code object; closures
    over another layer and another policy would otherwise reuse the first layer's graph)."""
    import types

    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{id(fn):x}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Entry:
    __slots__ = ("kind", "value", "device")

    def __init__(self, kind: str, value: object, device: torch.device | None = None):
        self.kind, self.value, self.device = kind, value, device


class _SaveMode(TorchDispatchMode):
    """Eager forward of a region: SAC's caching mode, with MUST_CPU_OFFLOAD really offloading."""

    def __init__(self, policy: _RegionPolicy, storage: dict, export: PlanExport):
        super().__init__()
        self.policy, self.storage, self.export = policy, storage, export
        self.counter: dict[object, int] = defaultdict(int)
        #: Storage -> (storage key of the op that created it, its policy), for in-place chains.
        self.heads: dict[int, tuple[tuple, CheckpointPolicy, object]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _IGNORED:
            return out
        idx = self.counter[func]
        self.counter[func] += 1
        from torch.utils.checkpoint import SelectiveCheckpointContext

        policy = self.policy(SelectiveCheckpointContext(is_recompute=False, op_output=out), func, *args, **kwargs)
        written = [args[i] for i in writes_into(func) if i < len(args) and isinstance(args[i], torch.Tensor)]
        head = self.heads.get(_storage(written[0])) if written else None
        if head is not None:
            key, head_policy, shape = head
            if head_policy not in _SAVE:  # the head returns the chain's final tensor at replay
                self._undo(key)
                self.storage[key] = _Entry("save", head_outputs(shape, key))
                self.export.record.saved_bytes += written[0].untyped_storage().nbytes()
                self.export.record.saved_storages[_storage(written[0])] = written[0].untyped_storage().nbytes()
                self.heads[_storage(written[0])] = (key, CheckpointPolicy.MUST_SAVE, shape)
            self.storage[(func, idx)] = _Entry("save", tree_map(_detach, out))
            return out
        for leaf, f in zip(tree_leaves(out), fresh_output_flags(func, out), strict=False):
            if f and isinstance(leaf, torch.Tensor):
                self.heads[_storage(leaf)] = ((func, idx), policy, weak_outputs(out))
        if policy in _SAVE:
            self.storage[(func, idx)] = _Entry("save", tree_map(_detach, out))
            self.export.record.saved_bytes += _fresh_bytes(func, out)
            for leaf, f in zip(tree_leaves(out), fresh_output_flags(func, out), strict=False):
                if f and isinstance(leaf, torch.Tensor):
                    self.export.record.saved_storages[_storage(leaf)] = leaf.untyped_storage().nbytes()
        elif policy in _OFFLOAD:
            leaves = iter(range(1 << 30))
            key = (self.policy.region, str(func), idx)
            self.storage[(func, idx)] = _Entry("offload", tree_map(
                lambda x: self.export.host.offload(x, (*key, next(leaves))), out))
            self.export.record.offloaded_bytes += _fresh_bytes(func, out)
        else:
            self.storage[(func, idx)] = _Entry("recompute", None)
        return out

    def _undo(self, key: tuple) -> None:
        entry = self.storage.get(key)
        if entry is not None and entry.kind == "offload":
            self.export.record.offloaded_bytes -= sum(
                x.host.untyped_storage().nbytes() for x in tree_leaves(entry.value) if isinstance(x, _Offloaded))


class _ReplayMode(TorchDispatchMode):
    """Eager recompute of a region: cached values for saved ops, reloads for offloaded ones."""

    def __init__(self, storage: dict, export: PlanExport):
        super().__init__()
        self.storage, self.export = storage, export
        self.counter: dict[object, int] = defaultdict(int)

    def __enter__(self):
        self.counter.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _IGNORED:
            return func(*args, **kwargs)
        idx = self.counter[func]
        self.counter[func] += 1
        entry = self.storage.pop((func, idx), None)
        if entry is None:
            raise RuntimeError(
                f"{func} call {idx} of the recompute did not run in the forward of this layer: the layer's code "
                "path changed between forward and backward (a data-dependent branch or global state)"
            )
        if entry.kind == "save":
            return entry.value
        if entry.kind == "offload":
            return tree_map(self.export.host.reload, entry.value)
        return func(*args, **kwargs)


def _detach(x: object) -> object:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _fresh_bytes(func, out) -> int:
    return sum(leaf.untyped_storage().nbytes() for leaf, f in zip(tree_leaves(out), fresh_output_flags(func, out),
                                                                  strict=False)
               if f and isinstance(leaf, torch.Tensor))


class HostCopies:
    """Eager export's offloads: device -> host when the op returns, back at the layer's recompute.

    On the CPU the host copy is a plain clone (there is no device); on CUDA a pinned buffer from a
    pool (`slackswap.runtime.copy_engines.HostPool`), one per offloading call of a layer (region, op,
    call index: the same on every step), reused across steps, and a blocking copy, no side stream
    (the eager runtime's copies overlap on their own streams; here the reload is PyTorch's, at the
    layer's recompute). Reuse is safe: the copies are blocking and a step's backward has reloaded
    them all before the next step's forward offloads again."""

    def __init__(self) -> None:
        from slackswap.runtime.copy_engines import HostPool

        self.copies = 0
        self.pool = HostPool(pinned=torch.cuda.is_available())

    def offload(self, x: object, key: object = None) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        self.copies += 1
        if x.device.type == "cpu":
            return _Offloaded(x.detach().clone(), x.device)
        nbytes = x.numel() * x.element_size()
        host = self.pool.get(key, nbytes).view(x.dtype).view(x.shape)
        host.copy_(x.detach(), non_blocking=False)
        return _Offloaded(host, x.device)

    def reload(self, x: object) -> object:
        if not isinstance(x, _Offloaded):
            return x
        return x.host if x.device.type == "cpu" else x.host.to(x.device, non_blocking=False)


class _Offloaded:
    """A host copy and the device it came from (a pytree leaf, unlike a tuple)."""

    __slots__ = ("device", "host")

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host, self.device = host, device


class PlanExport:
    """A plan as one SAC policy per layer of `model` (the children of its first ModuleList).

        export = PlanExport(plan, graph, model)
        with export.installed(model):                 # eager: per-layer checkpoint with the policy
            loss_fn(model(batch)).backward()
        with export.installed(model, compile=True):   # each layer torch.compile'd, policy in the partition
            ...
    """

    def __init__(self, plan: Plan, graph: Graph, model: torch.nn.Module):
        check_identity(graph, model)
        self.regions = layer_paths(model)
        #: The graph the plan was made on: compiled (`made_for_compile`), each dropout's mask at its compiled
        #: bytes (`slackswap.runtime.export_graph`); else the captured one. Saved bytes are checked against it.
        compiled = graph_for_compile(graph, self.regions)
        self.plan, self.graph = plan, compiled if made_for_compile(plan) else graph
        #: Whether the other executor stores some tensor at other bytes than this plan was priced at
        #: (a composite dropout's noise inside a layer): `installed` then refuses that executor.
        self._executor_matters = COMPILED_MASKS in compiled.meta
        self.region_decisions: list[dict[str, Decision]] = [{} for _ in self.regions]
        self.outside: dict[str, Decision] = {}
        for name, decision in plan.decisions.items():
            region = _region_of(module_path(name), self.regions)
            if region is None:
                self.outside[name] = Decision(decision)
            else:
                self.region_decisions[region][name] = Decision(decision)
        self.modules = ModuleStack(model)
        self.host = HostCopies()
        self.record = StepRecord()
        #: Storage -> identities of the op that made it, this step (eager), to name a layer's outputs.
        self._last_names: dict[int, list[str]] = {}
        self._compiled_fns: dict[tuple, tuple[int, Callable]] = {}
        self._facts = None
        self._eager_calls: dict[int, dict[tuple[str, str], list[tuple[int, int]]]] = {}
        self._eager_dropouts: dict[int, dict[str, list[tuple[str, str]]]] = {}
        #: Compiled: region -> the region whose compiled function (and partition) it shares.
        self.group_of: dict[int, int] = {}

    # ------------------------------------------------------------------ policies
    def policy(self, region: int, compiled: bool = False) -> Callable:
        """A fresh policy function for one call of region `region` (counters start at zero)."""
        return _RegionPolicy(self, region, compiled)

    def context_fn(self, region: int, compiled: bool = False) -> Callable[[], tuple]:
        """`checkpoint(..., context_fn=export.context_fn(i))`: eager, the export's own SAC modes (offloads
        included); compiled, PyTorch's `create_selective_checkpoint_contexts` with the same policy."""
        if compiled:
            return lambda: create_selective_checkpoint_contexts(self.policy(region, compiled=True))

        def contexts() -> tuple[TorchDispatchMode, TorchDispatchMode]:
            storage: dict = {}
            return _SaveMode(self.policy(region), storage, self), _ReplayMode(storage, self)

        return contexts

    def eager_calls(self, region: int) -> dict[tuple[str, str], list[tuple[int, int]]]:
        """(module path, ATen packet) -> [(eager call number, bytes of its first output)] of the graph's
        tensors in `region`, in call order: what a compiled call's identity is matched against."""
        if region not in self._eager_calls:
            first: dict[tuple[str, str, int], tuple[int, int]] = {}
            for name, t in self.graph.tensors.items():
                if _region_of(module_path(name), self.regions) != region or "#" not in name:
                    continue
                head, _, tail = name.rpartition("#")
                path, _, packet = head.rpartition("/")
                k, _, i = tail.partition(":")
                key = (path, packet, int(k))
                if key not in first or int(i) < first[key][0]:
                    first[key] = (int(i), t.size_bytes)
            table: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
            for (path, packet, k), (_, size) in sorted(first.items(), key=lambda e: e[0][2]):
                table[(path, packet)].append((k, size))
            self._eager_calls[region] = dict(table)
        return self._eager_calls[region]

    def eager_dropouts(self, region: int) -> dict[str, list[tuple[str, str]]]:
        """Module path -> [(output, noise)] of CPU eager's composite dropouts in `region`, in call order: an
        `empty_like` (its in-place `bernoulli_` / `div_` joined to it) whose output a forward `mul` reads."""
        if region not in self._eager_dropouts:
            table: dict[str, list[tuple[str, str]]] = defaultdict(list)
            for out, noise in composite_dropouts(self.graph, region):
                table[module_path(noise)].append((out, noise))
            self._eager_dropouts[region] = dict(table)
        return self._eager_dropouts[region]

    # ------------------------------------------------------------------ installation
    @contextmanager
    def installed(self, model: torch.nn.Module, compile: bool = False, backend: object = "inductor") -> Iterator[None]:
        """Every layer's forward runs under `checkpoint` with its region's policy (compiled: the
        checkpointed forward is `torch.compile`d per layer, with the offload pass enabled; inductor, given
        as "inductor" or an `InductorBackend`, compiles with the export's decompositions and config,
        `slackswap.runtime.export_compile`)."""
        if self._executor_matters and compile != made_for_compile(self.plan):
            made, asked = ("compile", "eager") if made_for_compile(self.plan) else ("eager", "compile")
            raise RuntimeUsageError(
                f"plan {self.plan.planner!r} was made for the {made} export and is installed {asked}: the {asked} "
                "step stores the layers' dropout masks at other bytes than the plan was priced at "
                f"(slackswap.runtime.export_graph). Install with compile={made == 'compile'}, or plan again with "
                f"plan_for_export(..., compile={asked == 'compile'})")
        layers = [model.get_submodule(p) for p in self.regions]
        originals = [layer.__dict__.get("forward") for layer in layers]
        reset = model.register_forward_pre_hook(lambda *_: self._reset())
        try:
            for i, layer in enumerate(layers):
                layer.forward = self._forward(layer, i, compile, backend)
            if compile:  # module paths from dynamo's nn_module_stack: global hooks would break the graph
                with offload_enabled():
                    yield
            else:
                with self.modules:
                    yield
        finally:
            reset.remove()
            for layer, original in zip(layers, originals, strict=True):
                layer.__dict__.pop("forward", None)
                if original is not None:
                    layer.forward = original

    @contextmanager
    def counting_saved(self, model: torch.nn.Module) -> Iterator[SavedCount]:
        """Around `installed(model)` (eager): counts every storage autograd saves outside the layers'
        checkpoint caches (tensors outside every layer) and every tensor a layer is called with (its
        checkpoint holds them for the recompute, some through `save_for_backward`, those nested in a tuple
        or passed by keyword by reference), so `saved_activation_bytes` is the step's whole saved set.
        Outside: inside `installed`, the checkpoints' own hooks are the innermost and see the layers'
        tensors."""
        count = SavedCount()
        fixed = {_storage(t) for t in (*model.parameters(), *model.buffers())}

        def pre(_module, args, kwargs):
            count.autograd.clear()
            count.excluded = fixed | {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _storage(t)
            if key not in count.excluded:
                count.autograd[key] = t.untyped_storage().nbytes()
            return t

        def layer_inputs(_module, args, kwargs):  # checkpoint holds them all for the recompute
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and _storage(t) not in count.excluded:
                    count.autograd[_storage(t)] = t.untyped_storage().nbytes()

        handles = [model.register_forward_pre_hook(pre, with_kwargs=True)]
        handles += [model.get_submodule(p).register_forward_pre_hook(layer_inputs, with_kwargs=True)
                    for p in self.regions]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield count
        finally:
            for handle in handles:
                handle.remove()

    def saved_activation_bytes(self, count: SavedCount) -> int:
        """After an eager step inside `counting_saved`: the device bytes of every distinct storage the step
        saved for backward (the checkpoint caches and autograd's), offloaded host copies left out."""
        return sum({**count.autograd, **self.record.saved_storages}.values())

    def _note_outputs(self, out: object) -> None:
        """The layer's returned tensors that a later layer or an op outside reads (`LAYER_OUTPUT` in the
        facts) stay alive as its input: any policy on them is moot. A returned tensor nobody reads
        (Falcon's attention probabilities) is held by the caller only until its hold in the graph ends
        (`Tensor.held_until`, which the plan prices) and its policy is executed as planned."""
        outputs = {n for n, why in self.facts().fixed_keep.items() if why == LAYER_OUTPUT}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for n in (x for x in self._last_names.get(_storage(leaf), ()) if x in outputs):
                    self.record.region_outputs.add(n)
                    self.record.applied[n] = CheckpointPolicy.MUST_SAVE

    def _reset(self) -> None:
        self.record = StepRecord()
        self._last_names = {}
        self.modules._calls.clear()

    def _forward(self, layer: torch.nn.Module, region: int, compile: bool, backend: object) -> Callable:
        if compile:
            return self._compiled(layer, region, backend)
        plain = type(layer).forward
        context_fn = self.context_fn(region)

        def run(*args, **kwargs):
            out = checkpoint(partial(plain, layer), *args, use_reentrant=False, context_fn=context_fn, **kwargs)
            self._note_outputs(out)
            return out

        return run

    def _compiled(self, layer: torch.nn.Module, region: int, backend: object) -> Callable:
        """Layers whose decisions read the same below their own path share one compiled function (the
        layer is an argument: its parameters are graph inputs), traced with the first such layer's
        policy; other layers get their own. Dynamo keys compiled code by code object, so each group's
        function is a fresh one (`_fresh_function`). Kept: a later installation reuses the code."""
        path = self.regions[region]
        signature = (type(layer), id(backend), tuple(sorted(
            (n[len(path):], str(d)) for n, d in self.region_decisions[region].items())))
        if signature not in self._compiled_fns:
            context_fn = self.context_fn(region, compiled=True)

            def run(layer, *args, **kwargs):
                return checkpoint(partial(type(layer).forward, layer), *args, use_reentrant=False,
                                  context_fn=context_fn, **kwargs)

            compiled = torch.compile(_fresh_function(run), backend=export_backend(backend, self.graph))
            self._compiled_fns[signature] = (region, compiled)
        self.group_of[region], compiled = self._compiled_fns[signature]
        return partial(compiled, layer)

    def translate(self, name: str, region: int) -> str:
        """A tensor of `region` as its compile group's representative layer names it."""
        rep = self.group_of.get(region, region)
        return self.regions[rep] + name[len(self.regions[region]):]

    # ------------------------------------------------------------------ differences
    def static_differences(self) -> list[ExportDifference]:
        """Decisions no region governs: a saved tensor outside every layer is saved by autograd as usual, a
        checkpoint candidate there is not saved at all, unless a layer reads it (then the layer's
        checkpoint holds it: a difference where the plan does not keep it)."""
        saved = {t.name for t in self.graph.saved_tensors}
        held = self.facts().held_inputs
        out = [ExportDifference(n, str(d), "saved by autograd", OUTSIDE) if n in saved else
               ExportDifference(n, str(d), "not saved", NOT_KEPT) for n, d in sorted(self.outside.items())
               if (d != Decision.KEEP or n not in saved) and n not in held]
        return out + [ExportDifference(n, str(self.plan.decisions.get(n, "none")), "held", why)
                      for n, why in sorted(held.items()) if self.plan.decisions.get(n) != Decision.KEEP]

    def step_differences(self) -> list[ExportDifference]:
        """After an eager step: every decided tensor of a region whose policy differs, with the reason."""
        out = self.static_differences()
        for decisions in self.region_decisions:
            for name, decision in sorted(decisions.items()):
                applied = self.record.applied.get(name)
                if applied is None:
                    out.append(ExportDifference(name, str(decision), "saved by autograd",
                                                "the layer's forward under checkpoint made no such tensor"))
                elif DOES[applied] != WANTS[decision]:
                    out.append(ExportDifference(name, str(decision), DOES[applied], self._why(name, applied)))
        return out + [ExportDifference(*d) for d in cached_differences(
            self.record.saved_storages, self.record.names_of, self.plan.decisions, {d.tensor for d in out})]

    def effective_decisions(self) -> dict[str, Decision]:
        """After an eager step: the decision PyTorch executed for every saved tensor (a tensor outside
        every layer, or one the layer's forward did not make, is saved by autograd: keep); a checkpoint
        candidate outside every layer is not kept, so it has none, unless a layer reads it (its
        checkpoint holds it: keep). Input of
        `slackswap.pytorch_execution.pytorch_plan`, which the simulator runs."""
        does = {"saved": Decision.KEEP, "offloaded": Decision.SWAP, "recomputed": Decision.RECOMPUTE}
        out = {}
        saved = {t.name for t in self.graph.saved_tensors}
        held = {t for t in self.facts().held_inputs if t in self.graph.candidate_names}
        out.update(dict.fromkeys(held, Decision.KEEP))  # held by a layer's checkpoint: kept
        for name in self.plan.decisions:
            if name in held or (name in self.outside and name not in saved):
                continue
            applied = self.record.applied.get(name)
            out[name] = Decision.KEEP if applied is None else does[DOES[applied]]
        return out

    def _why(self, name: str, applied: CheckpointPolicy) -> str:
        if name in self.record.in_place:
            return IN_PLACE
        if name in self.record.region_outputs:
            return LAYER_OUTPUT
        if name in self.record.random:
            return RANDOM
        if name in self.record.version_read:
            return VERSION_READ
        return SEVERAL_OUTPUTS

    def facts(self):
        """What PyTorch decides itself for this graph and these layers, before any step
        (`slackswap.runtime.export_facts.export_facts`): the tensors it keeps, the decisions it ties."""
        if self._facts is None:
            self._facts = export_facts(self.graph, self.regions)
        return self._facts


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


__all__ = ["DOES", "POLICY_OF", "ExportDifference", "InductorBackend", "OffloadMarks", "Partitions", "PlanExport",
           "SavedCount", "SavedValue", "differences_by_reason", "layer_paths", "partition_differences",
           "recording_backend", "saved_bytes"]
