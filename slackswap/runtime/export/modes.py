"""The export's eager swaps: `_SaveMode` copies a swapped tensor to the host when its op returns,
`_ReplayMode` hands it back at the layer's recompute (torch 2.13's eager SAC does not offload).

`_SaveMode` is the audited forward: it names every call, asks the plan's policy and records what it
decided, and leaves behind the region's `CallTable` (what each call's cache entry became, in call
order). `_TableSaveMode` is the steady-state forward: the same entries read from that table by
position, nothing named or recorded (why: naming and recording cost more per call than torch's own
selective checkpointing; the decisions depend only on the calls, which it checks one by one)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import CheckpointPolicy

from slackswap.runtime.errors import PlanMismatchError
from slackswap.runtime.export.policy import _IGNORED, _OFFLOAD, _SAVE, _RegionPolicy, _storage
from slackswap.runtime.export_heads import head_outputs, weak_outputs
from slackswap.runtime.op_numbering import fresh_output_flags, writes_into
from slackswap.runtime.replay_check import scratch_running_statistics

#: A cache entry's kinds (`_Entry.kind`).
SAVE, OFFLOAD, RECOMPUTE = "save", "offload", "recompute"


class _Entry:
    __slots__ = ("kind", "value", "device")

    def __init__(self, kind: str, value: object, device: torch.device | None = None):
        self.kind, self.value, self.device = kind, value, device


class _SaveMode(TorchDispatchMode):
    """Eager forward of a region: SAC's caching mode, with MUST_CPU_OFFLOAD really offloading."""

    def __init__(self, policy: _RegionPolicy, storage: dict, export: object, tables: dict | None = None,
                 key: object = None):
        """`tables`: where the region's `CallTable` goes under `key` when the forward ends."""
        super().__init__()
        self.policy, self.storage, self.export = policy, storage, export
        self.counter: dict[object, int] = defaultdict(int)
        #: Storage -> (storage key of the op that created it, its policy), for in-place chains.
        self.heads: dict[int, tuple[tuple, CheckpointPolicy, object]] = {}
        self.tables, self.key = tables, key
        #: Every governed call of the forward, (func, its index among func's calls), in call order.
        self.calls: list[tuple] = []

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self.tables is not None:
            self.tables[self.key] = CallTable.of(self.calls, self.storage, self.policy.region,
                                                 self.policy.writes_outside)
        return super().__exit__(exc_type, exc, tb)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _IGNORED:
            return out
        idx = self.counter[func]
        self.counter[func] += 1
        self.calls.append((func, idx))
        from torch.utils.checkpoint import SelectiveCheckpointContext

        policy = self.policy(SelectiveCheckpointContext(is_recompute=False, op_output=out), func, *args, **kwargs)
        written = [args[i] for i in writes_into(func) if i < len(args) and isinstance(args[i], torch.Tensor)]
        head = self.heads.get(_storage(written[0])) if written else None
        if head is not None:
            key, head_policy, shape = head
            if head_policy not in _SAVE:  # the head returns the chain's final tensor at replay
                self._undo(key)
                self.storage[key] = _Entry(SAVE, head_outputs(shape, key))
                self.export.record.saved_bytes += written[0].untyped_storage().nbytes()
                self.export.record.saved_storages[_storage(written[0])] = written[0].untyped_storage().nbytes()
                self.heads[_storage(written[0])] = (key, CheckpointPolicy.MUST_SAVE, shape)
            self.storage[(func, idx)] = _Entry(SAVE, tree_map(_detach, out))
            return out
        for leaf, f in zip(tree_leaves(out), fresh_output_flags(func, out), strict=False):
            if f and isinstance(leaf, torch.Tensor):
                self.heads[_storage(leaf)] = ((func, idx), policy, weak_outputs(out))
        if policy in _SAVE:
            self.storage[(func, idx)] = _Entry(SAVE, tree_map(_detach, out))
            self.export.record.saved_bytes += _fresh_bytes(func, out)
            for leaf, f in zip(tree_leaves(out), fresh_output_flags(func, out), strict=False):
                if f and isinstance(leaf, torch.Tensor):
                    self.export.record.saved_storages[_storage(leaf)] = leaf.untyped_storage().nbytes()
        elif policy in _OFFLOAD:
            leaves = iter(range(1 << 30))
            key = (self.policy.region, str(func), idx)
            self.storage[(func, idx)] = _Entry(OFFLOAD, tree_map(
                lambda x: self.export.host.offload(x, (*key, next(leaves))), out))
            self.export.record.offloaded_bytes += _fresh_bytes(func, out)
        else:
            self.storage[(func, idx)] = _Entry(RECOMPUTE, None)
        return out

    def _undo(self, key: tuple) -> None:
        entry = self.storage.get(key)
        if entry is not None and entry.kind is OFFLOAD:
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
        if entry.kind is SAVE:
            return entry.value
        if entry.kind is OFFLOAD:
            return tree_map(self.export.host.reload, entry.value)
        return func(*scratch_running_statistics(func, args), **kwargs)  # a batch norm's statistics move once


_RECOMPUTE_ENTRY = _Entry(RECOMPUTE, None)


class CallTable:
    """One region call's decisions as the audited forward executed them: per governed ATen call, in call
    order, (func, the replay's key (func, index among func's calls), what its cache entry became). The
    kinds are final: the head of an in-place chain a later call wrote into reads "save" (the audited mode
    re-pointed it), the calls into it too."""

    __slots__ = ("funcs", "keys", "kinds", "region", "writes_outside")

    def __init__(self, funcs: tuple, keys: tuple, kinds: tuple, region: int, writes_outside: bool = False):
        self.funcs, self.keys, self.kinds, self.region = funcs, keys, kinds, region
        #: Whether the forward wrote into a tensor it did not make (module state, an input): not run twice.
        self.writes_outside = writes_outside

    @classmethod
    def of(cls, calls: list[tuple], storage: dict, region: int, writes_outside: bool = False) -> CallTable:
        """From the audited forward's calls and its cache (before any replay popped it)."""
        return cls(tuple(f for f, _ in calls), tuple(calls), tuple(storage[c].kind for c in calls), region,
                   writes_outside)

    def policies(self) -> dict[tuple, CheckpointPolicy]:
        """(func, index among func's calls) -> the selective-checkpoint policy that makes the same entry."""
        policy = {SAVE: CheckpointPolicy.MUST_SAVE, OFFLOAD: CheckpointPolicy.MUST_CPU_OFFLOAD,
                  RECOMPUTE: CheckpointPolicy.MUST_RECOMPUTE}
        return {key: policy[kind] for key, kind in zip(self.keys, self.kinds, strict=True)}


class CallsDiffer(PlanMismatchError):
    """A steady-state forward's ATen calls differ from the audited one's (a data-dependent code path at
    unchanged inputs): its decisions would be guesses. The layer is run again audited
    (`slackswap.runtime.export.steady`), or, where it cannot run twice, the step is refused."""


class _TableSaveMode(TorchDispatchMode):
    """Steady-state eager forward of a region: each call's cache entry from the audited forward's
    `CallTable`, by position. A call that is not the audited one at its position (another op, or one
    more) raises `CallsDiffer` before any entry is guessed; one fewer is caught at `__exit__`."""

    def __init__(self, table: CallTable, storage: dict, host: HostCopies):
        super().__init__()
        self.funcs, self.keys, self.kinds = table.funcs, table.keys, table.kinds
        self.region, self.storage, self.host, self.i = table.region, storage, host, 0

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and self.i != len(self.funcs):
            raise CallsDiffer(f"the layer's forward made {self.i} governed ATen calls where the audited one made "
                              f"{len(self.funcs)}")
        return super().__exit__(exc_type, exc, tb)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if func in _IGNORED:
            return out
        i = self.i
        if i >= len(self.funcs) or self.funcs[i] is not func:
            expected = self.funcs[i] if i < len(self.funcs) else "none"
            raise CallsDiffer(f"governed ATen call {i} of the layer's forward is {func} where the audited forward "
                              f"made {expected}")
        self.i = i + 1
        kind = self.kinds[i]
        if kind is RECOMPUTE:
            self.storage[self.keys[i]] = _RECOMPUTE_ENTRY
        elif kind is SAVE:
            self.storage[self.keys[i]] = _Entry(SAVE, out.detach() if type(out) is torch.Tensor
                                                else tree_map(_detach, out))
        else:
            leaves = iter(range(1 << 30))
            key = (self.region, str(func), self.keys[i][1])
            self.storage[self.keys[i]] = _Entry(OFFLOAD, tree_map(
                lambda x: self.host.offload(x, (*key, next(leaves))), out))
        return out


def _detach(x: object) -> object:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _fresh_bytes(func, out) -> int:
    return sum(leaf.untyped_storage().nbytes() for leaf, f in zip(tree_leaves(out), fresh_output_flags(func, out),
                                                                  strict=False)
               if f and isinstance(leaf, torch.Tensor))


class HostCopies:
    """Eager export's offloads: device -> host when the op returns, back at the layer's recompute.

    A pinned (on the CPU plain) host buffer from a pool (`slackswap.runtime.copy_engines.HostPool`), one
    per offloading call of a layer (region, op, call index: the same on every step), reused across
    steps, and a blocking copy, no side stream (the eager runtime's copies overlap on their own
    streams; here the reload is PyTorch's, at the layer's recompute). The reload is a new device tensor
    (its allocation is the reload's memory), with the strides the offloaded tensor had. Reuse is safe:
    the copies are blocking and a step's backward has reloaded them all before the next step's forward
    offloads again.

    On the CPU, which stands in for a device, the pool's buffers are the host and the reload allocates
    as a device's would, as the eager runtime's `CpuCopies` do: so from the second step on (the pool
    allocated) the CPU allocator sees only device bytes, an offloaded tensor's bytes absent while it is
    off the device and its reloaded copy present from the reload, and a measured CPU peak is the
    step's device peak (`benchmarks/zoo.py`, `Arch.over_budget`). A clone held from the offload to the
    end of the backward would save nothing on the CPU, and no measure could tell an offload from a keep."""

    def __init__(self) -> None:
        from slackswap.runtime.copy_engines import HostPool

        self.copies = 0
        self.pool = HostPool(pinned=torch.cuda.is_available())

    def offload(self, x: object, key: object = None) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        self.copies += 1
        nbytes = x.numel() * x.element_size()
        host = self.pool.get(key, nbytes).view(x.dtype).view(x.shape)
        host.copy_(x.detach(), non_blocking=False)
        # The layout the reload restores (a clone's: strides kept where dense), no bytes: a kernel reading
        # a transposed copy rounds as it did on the original.
        return _Offloaded(host, x.device, torch.empty_like(x, device="meta"))

    def reload(self, x: object) -> object:
        if not isinstance(x, _Offloaded):
            return x
        if x.device.type != "cpu":
            return x.host.to(x.device, non_blocking=False)
        return torch.empty_like(x.layout, device=x.device).copy_(x.host)


class _Offloaded:
    """A host copy, the device it came from and its layout there (a meta tensor; a pytree leaf, unlike a
    tuple)."""

    __slots__ = ("device", "host", "layout")

    def __init__(self, host: torch.Tensor, device: torch.device, layout: torch.Tensor):
        self.host, self.device, self.layout = host, device, layout
