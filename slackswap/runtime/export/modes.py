"""The export's eager swaps: `_SaveMode` copies a swapped tensor to the host when its op returns,
`_ReplayMode` hands it back at the layer's recompute (torch 2.13's eager SAC does not offload)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy

from slackswap.runtime.export.policy import _IGNORED, _OFFLOAD, _SAVE, _RegionPolicy, _storage
from slackswap.runtime.export_heads import head_outputs, weak_outputs
from slackswap.runtime.op_numbering import fresh_output_flags, writes_into


class _Entry:
    __slots__ = ("kind", "value", "device")

    def __init__(self, kind: str, value: object, device: torch.device | None = None):
        self.kind, self.value, self.device = kind, value, device


class _SaveMode(TorchDispatchMode):
    """Eager forward of a region: SAC's caching mode, with MUST_CPU_OFFLOAD really offloading."""

    def __init__(self, policy: _RegionPolicy, storage: dict, export: object):
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

    def __init__(self, storage: dict, export: object):
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


