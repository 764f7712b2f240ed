"""What PyTorch's own memory mechanisms really keep for backward, measured on a real (CPU) step.

The baselines `torch_sac` and `torch_budget` (slackswap/planners/strategies/) model two mechanisms on
the traced graph; these functions run the mechanisms themselves so tests can compare saved sets:
- `resident_after_forward`: run forward + loss under a dispatch mode that records every storage an
  op creates; after the loss, the storages still alive (held by autograd, a checkpoint's inputs, SAC's
  cache) minus parameters and inputs are what the step keeps for backward, whatever holds them.
- `checkpointed_layers`: wrap every transformer layer in `torch.utils.checkpoint.checkpoint`
  (non-reentrant) with a selective-checkpointing policy, as users apply SAC.
- `compiled_saved`: compile the step with torch.compile under `activation_memory_budget` and read the
  saved values off the partition the min-cut partitioner chose (the backward graph's inputs that are
  neither tangents nor forward inputs). With the backend `inductor_partition` the step goes through
  inductor's compile up to and including that partition, then runs without code generation.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Resident:
    """A storage the step keeps for backward: the aten op that created it, its dtype and bytes."""

    aten: str
    dtype: str
    shape: tuple[int, ...]
    size_bytes: int


class _StorageRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.created: dict[int, tuple[weakref.ref, Resident]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aten = func.overloadpacket.__name__
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                known = self.created.get(key)
                # An address is reused once its storage is freed: a dead or other storage is replaced.
                if key and (known is None or known[0]() is not storage):
                    self.created[key] = (weakref.ref(storage), Resident(
                        aten, str(t.dtype).removeprefix("torch."), tuple(t.shape), storage.nbytes()))
        return out


def resident_after_forward(step: Callable[[], torch.Tensor], exclude: Iterable[torch.Tensor]) -> tuple[
        list[Resident], torch.Tensor]:
    """(the storages `step` created that are still alive when it returns, the loss it returned).

    `exclude`: tensors whose storages do not count (parameters, inputs). The loss's own storage does
    not count either. Call `loss.backward()` afterwards to finish the step."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    recorder = _StorageRecorder()
    with recorder:
        loss = step()
    gc.collect()
    excluded.add(loss.untyped_storage().data_ptr())
    alive = [res for key, (ref, res) in recorder.created.items()
             if key not in excluded and ref() is not None and ref().data_ptr() == key]
    return alive, loss


def sac_policy(save_ops: frozenset[str]) -> Callable:
    """A SAC policy function: MUST_SAVE for ops whose aten name is in `save_ops`, else PREFER_RECOMPUTE."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        saved = op.overloadpacket.__name__ in save_ops
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@contextlib.contextmanager
def checkpointed_layers(layers: Iterable[torch.nn.Module], save_ops: frozenset[str] | None) -> Iterator[None]:
    """Every module of `layers` runs under non-reentrant `torch.utils.checkpoint.checkpoint`; with
    `save_ops`, under selective checkpointing with `sac_policy(save_ops)` (else plain checkpointing)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    originals = []
    for layer in layers:
        forward = layer.forward
        originals.append((layer, forward))
        extra = {} if save_ops is None else {
            "context_fn": functools.partial(create_selective_checkpoint_contexts, sac_policy(save_ops))}

        def wrapped(*args, _forward=forward, _extra=extra, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **_extra, **kwargs)

        layer.forward = wrapped
    try:
        yield
    finally:
        for layer, forward in originals:
            layer.forward = forward


def _inductor_cache_off():
    try:
        from torch._inductor import config as inductor_config
    except ImportError:
        return contextlib.nullcontext()
    return inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False)


@dataclass(frozen=True)
class SavedValue:
    """One value the compiled forward saves for backward (a node of the partitioned graph)."""

    name: str
    target: str
    dtype: str
    shape: tuple[int, ...]
    size_bytes: int


def _run_as_fx_graph(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: object) -> Callable:
    """An inductor `inner_compile` that generates no code: the partitioned graph runs as it is."""
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


def inductor_partition(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """A torch.compile backend for reading inductor's partition without paying for its code: inductor's
    `compile_fx` (its decompositions, joint-graph passes and config, its min-cut partitioner under
    `activation_memory_budget`), whose forward and backward graphs then run as FX graphs instead of being
    lowered to C++ and compiled. The partition is chosen before inductor lowers anything, so the saved set
    is inductor's own (tests/test_torch_mechanisms.py compares the two); only the step's speed, and its
    rounding where inductor's kernels round otherwise than ATen's, differ."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=_run_as_fx_graph)


def compiled_saved(step: Callable[[], torch.Tensor], budget: float, backend: str | Callable = "inductor") -> tuple[
        list[SavedValue], torch.Tensor]:
    """(the activations the compiled step saves for backward, its loss), torch.compile under
    `torch._functorch.config.activation_memory_budget = budget`. Saved values that are forward
    inputs (parameters, the batch) are left out, as the traced graph has no weights. `backend`: any
    torch.compile backend that partitions with `min_cut_rematerialization_partition`; `inductor_partition`
    gives inductor's saved set without its C++ compile (seconds per graph on the CPU)."""
    import torch._functorch.partitioners as partitioners
    from torch._functorch import config as functorch_config

    captured: list[tuple[torch.fx.GraphModule, torch.fx.GraphModule]] = []
    original = partitioners.min_cut_rematerialization_partition

    def recording(joint, joint_inputs, **kwargs):
        fw, bw = original(joint, joint_inputs, **kwargs)
        captured.append((fw, bw))
        return fw, bw

    modules = [partitioners]
    with contextlib.suppress(ImportError):
        import torch._inductor.compile_fx as compile_fx
        modules.append(compile_fx)
    with contextlib.suppress(ImportError):
        import torch._dynamo.backends.debugging as debugging
        modules.append(debugging)
    saved_attr = [(m, m.min_cut_rematerialization_partition) for m in modules
                  if hasattr(m, "min_cut_rematerialization_partition")]
    torch._dynamo.reset()
    try:
        for m, _ in saved_attr:
            m.min_cut_rematerialization_partition = recording
        # No compile cache: a cached graph would skip the partitioner this reads the saved set from.
        with functorch_config.patch(activation_memory_budget=budget, enable_autograd_cache=False), \
                _inductor_cache_off():
            loss = torch.compile(step, backend=backend, fullgraph=True)()
    finally:
        for m, fn in saved_attr:
            m.min_cut_rematerialization_partition = fn
    if len(captured) != 1:
        raise RuntimeError(f"expected one partitioned graph, got {len(captured)} (a graph break?)")
    fw, bw = captured[0]
    fw_inputs = {n.name for n in fw.graph.nodes if n.op == "placeholder"}
    out: list[SavedValue] = []
    for node in bw.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents") or node.name in fw_inputs:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        target = ""
        producer = next((n for n in fw.graph.nodes if n.name == node.name), None)
        if producer is not None and producer.op == "call_function":
            target = getattr(producer.target, "__name__", str(producer.target))
        out.append(SavedValue(node.name, target, str(val.dtype).removeprefix("torch."), tuple(val.shape),
                              val.numel() * val.element_size()))
    return out, loss
