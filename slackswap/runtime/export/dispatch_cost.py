"""The host cost per ATen call of the eager export's selective-checkpoint modes, measured once on the
machine by a microbenchmark that runs no plan and no model of the user's.

Why: a layer under the export's SAC policy (`slackswap.runtime.export.mechanism.SELECTIVE`) routes
every ATen call of its forward (`_TableSaveMode`, the steps after the audited one) and of its replay
(`_ReplayMode`) through a Python dispatch mode; an op-time table measured on the plain step holds none
of that. The cost is a property of the machine and the PyTorch build (Python's dispatch into a mode,
the cache entry), as the op times are, so it is measured once, apart from any plan's step, and a
prediction adds it per call it runs (`slackswap.experiment.measured_executor.predict_export`). A plan's
own measured step never feeds it.

The microbenchmark: a fixed stack of small pre-norm MLP blocks (`BLOCKS` blocks, width `WIDTH`, `TOKENS`
tokens), each under a non-reentrant `torch.utils.checkpoint`, forward and backward, (a) plain and (b) with
the export's own save and replay modes over a call table of the block's calls (every call recomputed,
as a full recompute's table reads; a saved entry costs a `detach` more). The same ops run in both and
the same replay: the difference is the modes'. Pairs alternate (drift touches both), the calling
thread's CPU time is read (other load and intra-op threads add nothing). The modes also cost per region
(the context made, the modes entered and left in the forward and the replay, the cache), so the blocks
run in two configurations, each block its own region and all in one, and the two median differences
are fitted as per call x calls + per region x regions (least squares, both >= 0: `per_call_and_region`),
the calls the modes saw counted (forward and replay).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from slackswap.runtime.export.modes import RECOMPUTE, CallTable, HostCopies, _ReplayMode, _TableSaveMode
from slackswap.runtime.export.policy import _IGNORED

BLOCKS, WIDTH, TOKENS = 4, 64, 64


@dataclass(frozen=True)
class DispatchCost:
    """Seconds of host time the export's SAC modes add per ATen call and per region, and how it was measured."""

    per_call_s: float
    #: Calls per step the modes saw in the microbenchmark with every block its own region (forward and replay).
    calls: int
    repeats: int
    source: str
    #: Per SAC region (its context and modes made, entered and left in the forward and the replay, its
    #: cache): fitted beside the per-call cost from the two region counts (module docstring).
    per_region_s: float = 0.0


class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.funcs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _IGNORED:
            self.funcs.append(func)
        return func(*args, **(kwargs or {}))


class _CountingReplay(_ReplayMode):
    def __init__(self, storage: dict, counter: list[int]):
        super().__init__(storage, None)
        self.calls = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[0] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def mlp_blocks(blocks: int = BLOCKS, width: int = WIDTH) -> torch.nn.ModuleList:
    """The microbenchmarks' fixed stack: `blocks` pre-norm MLP blocks of `width`, seeded."""
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                                                   torch.nn.GELU(), torch.nn.Linear(4 * width, width))
                               for _ in range(blocks))


def _block_forward(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x + block(x)


def _table(funcs: tuple) -> CallTable:
    """The call table of a region making `funcs`, every call recomputed (as a full recompute's reads)."""
    index: dict = {}
    keys = []
    for f in funcs:
        keys.append((f, index.get(f, 0)))
        index[f] = index.get(f, 0) + 1
    return CallTable(funcs, tuple(keys), (RECOMPUTE,) * len(funcs), 0)


def _forward_all(blocks, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = _block_forward(block, x)
    return x


def per_call_and_region(diffs_s: tuple[float, ...], calls: tuple[int, ...], regions: tuple[int, ...]
                        ) -> tuple[float, float]:
    """(per call, per region) >= 0 fitting diff = per_call x calls + per_region x regions by least squares
    over the configurations: the unconstrained fit when both come out >= 0, else the better of the two
    one-term fits (a term that is not there is 0, never negative)."""
    sxx = sum(c * c for c in calls)
    syy = sum(r * r for r in regions)
    sxy = sum(c * r for c, r in zip(calls, regions, strict=True))
    bx = sum(c * d for c, d in zip(calls, diffs_s, strict=True))
    by = sum(r * d for r, d in zip(regions, diffs_s, strict=True))
    det = sxx * syy - sxy * sxy
    if det > 0:
        a, b = (bx * syy - by * sxy) / det, (by * sxx - bx * sxy) / det
        if a >= 0 and b >= 0:
            return a, b

    def residual(a: float, b: float) -> float:
        return sum((d - a * c - b * r) ** 2 for d, c, r in zip(diffs_s, calls, regions, strict=True))

    only_calls = (max(0.0, bx / sxx), 0.0)
    only_regions = (0.0, max(0.0, by / syy))
    return min(only_calls, only_regions, key=lambda ab: residual(*ab))


def measure_dispatch_cost(warmup: int = 3, repeats: int = 15) -> DispatchCost:
    """`DispatchCost` on this machine's CPU (module docstring). The RNG state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        blocks = mlp_blocks()
        x = torch.randn(TOKENS, WIDTH, requires_grad=True)
        recorder = _Calls()
        with torch.no_grad(), recorder:
            _block_forward(blocks[0], x)
        block_table = _table(tuple(recorder.funcs))
        recorder = _Calls()
        with torch.no_grad(), recorder:
            _forward_all(blocks, x)
        all_table = _table(tuple(recorder.funcs))
        host = HostCopies()
        replayed = [0]

        def contexts(table: CallTable):
            storage: dict = {}
            return _TableSaveMode(table, storage, host), _CountingReplay(storage, replayed)

        def step(selective: bool, each: bool) -> float:
            for p in blocks.parameters():
                p.grad = None
            c0 = time.thread_time_ns()
            if each:
                h = x
                for block in blocks:
                    h = checkpoint(partial(_block_forward, block), h, use_reentrant=False,
                                   **({"context_fn": partial(contexts, block_table)} if selective else {}))
            else:
                h = checkpoint(partial(_forward_all, blocks), x, use_reentrant=False,
                               **({"context_fn": partial(contexts, all_table)} if selective else {}))
            h.sum().backward()
            return (time.thread_time_ns() - c0) / 1e9

        diffs: dict[bool, list[float]] = {True: [], False: []}
        calls: dict[bool, int] = {}
        for i in range(warmup + repeats):
            for each in (True, False):
                replayed[0] = 0
                sac = step(True, each)
                calls[each] = len(all_table.funcs) + replayed[0]
                plain = step(False, each)
                if i >= warmup:
                    diffs[each].append(sac - plain)
    per_call, per_region = per_call_and_region(
        (statistics.median(diffs[True]), statistics.median(diffs[False])), (calls[True], calls[False]), (BLOCKS, 1))
    source = (f"slackswap.runtime.export.dispatch_cost: {BLOCKS} pre-norm MLP blocks (width {WIDTH}, {TOKENS} tokens) "
              f"in {BLOCKS} regions and in 1, each under plain checkpoint vs the export's SAC modes, thread CPU time, "
              f"medians of {repeats} pairs over {calls[True]} and {calls[False]} calls, fitted per call and per "
              f"region; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    return DispatchCost(per_call, calls[True], repeats, source, per_region)


__all__ = ["DispatchCost", "measure_dispatch_cost", "mlp_blocks", "per_call_and_region"]
