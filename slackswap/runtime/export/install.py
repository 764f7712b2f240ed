"""`PlanExport`: a plan installed on a model as one checkpointed (eager or compiled) forward per layer,
with the counts and differences of each step."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from slackswap.graph import Graph
from slackswap.plan import Decision, Plan
from slackswap.profile.torch.identity import ModuleStack
from slackswap.runtime.errors import RuntimeUsageError
from slackswap.runtime.export.mechanism import CHECKPOINT, layer_mechanisms
from slackswap.runtime.export.modes import HostCopies, _ReplayMode, _SaveMode, _TableSaveMode
from slackswap.runtime.export.policy import (
    DOES,
    WANTS,
    ExportDifference,
    SavedCount,
    StepRecord,
    _RegionPolicy,
    _storage,
)
from slackswap.runtime.export.replayed_state import ReplayedState
from slackswap.runtime.export.steady import TableSteps
from slackswap.runtime.export_compile import export_backend, offload_enabled
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
from slackswap.runtime.export_heads import cached_differences
from slackswap.runtime.identity import check_identity


def _fresh_function(fn: Callable) -> Callable:
    """A copy of `fn` with its own code object (dynamo caches and guards per code object; closures
    over another layer and another policy would otherwise reuse the first layer's graph)."""
    import types

    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{id(fn):x}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)



def refuse_cache(path: str, args: tuple, kwargs: dict) -> None:
    """Refuse a layer called with a Hugging Face key/value cache (a `transformers` `Cache`: what a model
    whose config keeps `use_cache=True`, the default, passes its layers in training too). Why: the
    eager export re-runs the layer's forward to recompute, and that forward updates the cache again
    (Llama's and GPT-2's layers append their keys and values a second time, Whisper's cross-attention
    finds them cached and skips its projections), so the recompute fails mid-backward on a shape or
    on PyTorch's count of saved tensors. The runtime replays recorded calls and is not affected.
    Checked on audited steps (the first, and each with other inputs)."""
    for key, value in [*enumerate(args), *kwargs.items()]:
        if any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(value).__mro__):
            raise RuntimeUsageError(
                f"layer {path!r} is called with a key/value cache (argument {key!r}, {type(value).__name__}): the "
                "export's recompute of the layer would update it a second time. Train with use_cache=False on every "
                "config the model holds (an encoder-decoder's decoder keeps a copy of its own, so T5's "
                "model.config.use_cache = False leaves the decoder's on: set it on each module's config, or build the "
                "model from a config with use_cache=False)")


class PlanExport(TableSteps):
    """A plan as one SAC policy per layer of `model` (`slackswap.profile.torch.layer_stacks`).

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
        #: Per installation: the layers whose forward a recompute must start from its own start (draws, numbers).
        self.replayed = ReplayedState([])
        self.record = StepRecord()
        #: Storage -> identities of the op that made it, this step (eager), to name a layer's outputs.
        self._last_names: dict[int, list[str]] = {}
        self._compiled_fns: dict[tuple, tuple[int, Callable]] = {}
        self._facts = None
        self._mechanisms: list[str] | None = None
        self._eager_calls: dict[int, dict[tuple[str, str], list[tuple[int, int]]]] = {}
        self._eager_dropouts: dict[int, dict[str, list[tuple[str, str]]]] = {}
        #: Compiled: region -> the region whose compiled function (and partition) it shares.
        self.group_of: dict[int, int] = {}
        self._init_steps()

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
            current = self._current  # (call number, audited), set by `_run_layer`; None outside a step
            if current is None or current[1]:
                tables = self._tables if self._auditing and current is not None else None
                return (_SaveMode(self.policy(region), storage, self, tables, (region, current and current[0])),
                        _ReplayMode(storage, self))
            return _TableSaveMode(self._tables[(region, current[0])], storage, self.host), _ReplayMode(storage, self)

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
        self._layers = layers
        self.replayed = ReplayedState(layers)
        originals = [layer.__dict__.get("forward") for layer in layers]
        if compile:
            hooks = [model.register_forward_pre_hook(lambda *_: self._reset())]
        else:  # the first step, and each with other inputs, audited; the others run from its tables
            hooks = [model.register_forward_pre_hook(self._begin_step, with_kwargs=True),
                     model.register_forward_hook(self._end_step, always_call=True),
                     model.register_forward_hook(self._commit_step)]
        try:
            for i, layer in enumerate(layers):
                layer.forward = self._forward(layer, i, compile, backend)
            if compile:  # module paths from dynamo's nn_module_stack: global hooks would break the graph
                with offload_enabled():
                    yield
            else:
                yield
        finally:
            self.modules.__exit__(None, None, None)
            self._auditing = True
            for hook in hooks:
                hook.remove()
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
        self._audit_all += 1  # the checkpoint caches' bytes are the record's: every step inside is audited
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield count
        finally:
            self._audit_all -= 1
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
        self.modules.stack.clear()

    def _forward(self, layer: torch.nn.Module, region: int, compile: bool, backend: object) -> Callable:
        if compile:
            return self._compiled(layer, region, backend)
        plain = type(layer).forward
        path = self.regions[region]
        if self.mechanisms()[region] == CHECKPOINT:  # every decided tensor recomputed: no policy to ask

            def checkpointed(*args, **kwargs):
                if self._auditing:
                    refuse_cache(path, args, kwargs)
                    self._note_plain(region)
                function = self.replayed.function(region, partial(plain, layer), self._auditing)
                return checkpoint(function, *args, use_reentrant=False, **kwargs)

            return checkpointed
        context_fn = self.context_fn(region)

        def forward(*args, **kwargs):
            function = self.replayed.function(region, partial(plain, layer), self._auditing)
            return checkpoint(function, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        def run(*args, **kwargs):
            if self._auditing:
                refuse_cache(path, args, kwargs)
            return self._run_layer(region, forward, args, kwargs)

        return run

    def mechanisms(self) -> list[str]:
        """Per layer, the mechanism the eager export runs it under (`slackswap.runtime.export.mechanism`):
        a plain checkpoint where the plan recomputes every tensor of the layer it decides, else the SAC
        policy."""
        if self._mechanisms is None:
            self._mechanisms = layer_mechanisms(self.graph, self.region_decisions, self.facts())
        return self._mechanisms

    def _note_plain(self, region: int) -> None:
        """An audited step's record of a plain-checkpoint layer, from its decisions (no policy is asked
        there): each decided tensor recomputed, a layer output another layer reads held (saved)."""
        fixed = self.facts().fixed_keep
        for name in self.region_decisions[region]:
            if fixed.get(name) == LAYER_OUTPUT:
                self.record.applied[name] = CheckpointPolicy.MUST_SAVE
                self.record.region_outputs.add(name)
            else:
                self.record.applied[name] = CheckpointPolicy.MUST_RECOMPUTE

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
        return ReplayedState.refused_when_drawing(path, layer, partial(compiled, layer))

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

