"""The host cost per ATen call of the eager export's selective-checkpoint modes, measured on the machine,
at the model's activation shape, by a microbenchmark that runs no plan and no model of the user's.

Why: a layer under the export's SAC policy (`slackswap.runtime.export.mechanism.SELECTIVE`) routes
every ATen call of its forward (`_TableSaveMode`, the steps after the audited one) and of its replay
(`_ReplayMode`) through a Python dispatch mode; an op-time table measured on the plain step holds none
of that. The cost is a property of the machine, the PyTorch build (Python's dispatch into a mode, the
cache entry) and the size of the tensors the ops beside it touch (below), as the op times are, so it is
measured once per model shape, apart from any plan's step, and a prediction adds it per call it runs
(`slackswap.experiment.measured_executor.predict_export`). A plan's own measured step never feeds it.

The microbenchmark: a fixed stack of pre-norm MLP blocks (`BLOCKS` blocks, width `WIDTH`, `TOKENS` tokens
unless the caller gives the model's), each under a non-reentrant `torch.utils.checkpoint`, forward and
backward, (a) plain and (b) with the export's own save and replay modes over a call table of the block's
calls (every call recomputed, as a full recompute's table reads; a saved entry costs a `detach` more). The
same ops run in both and the same replay: the difference is the modes'. Pairs alternate (drift touches
both), the calling thread's CPU time is read (other load and intra-op threads add nothing), and the median
difference is spread over the calls the modes saw (forward and replay, counted).

Why at the model's shape (`width`, `tokens`: its hidden size and tokens per micro-batch, as
`slackswap.experiment.measured_prediction.export_block_shape` gives them): the per-call figure is not the
dispatch alone. The ops beside the modes' Python run slower too (their data no longer stays in the
caches between calls), and that grows with the tensors: on this project's 2-core machine, one thread,
7.3-7.7 us a call at 64 x 64 and at 64 x 256 or 128 x 64, 9.1-10.2 us at 128 x 256 (three runs each). At
64 x 64 the benchmark's exported rows of its 128-wide, 256-token models read -2 to -10 points of
overhead; at their own shape about 0 (docs/decisions/0026-export-dispatch-at-the-models-shape.md).
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
    """Seconds of host time per ATen call the export's SAC modes add, and how it was measured."""

    per_call_s: float
    #: Calls per step the modes saw in the microbenchmark (forward and replay).
    calls: int
    repeats: int
    source: str


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


def measure_dispatch_cost(warmup: int = 5, repeats: int = 41, width: int = WIDTH, tokens: int = TOKENS) -> DispatchCost:
    """`DispatchCost` on this machine's CPU with the blocks `width` wide over `tokens` tokens (module
    docstring). The RNG state is left as it was."""
    if width < 1 or tokens < 1:
        raise ValueError(f"the dispatch microbenchmark's blocks need a width and tokens of at least 1, got "
                         f"{width} x {tokens}")
    with torch.random.fork_rng(devices=[]):
        blocks = mlp_blocks(BLOCKS, width)
        x = torch.randn(tokens, width, requires_grad=True)
        recorder = _Calls()
        with torch.no_grad(), recorder:
            _block_forward(blocks[0], x)
        funcs = tuple(recorder.funcs)
        index: dict = {}
        keys = []
        for f in funcs:
            keys.append((f, index.get(f, 0)))
            index[f] = index.get(f, 0) + 1
        table = CallTable(funcs, tuple(keys), (RECOMPUTE,) * len(funcs), 0)
        host = HostCopies()
        replayed = [0]

        def contexts():
            storage: dict = {}
            return _TableSaveMode(table, storage, host), _CountingReplay(storage, replayed)

        def step(selective: bool) -> float:
            for p in blocks.parameters():
                p.grad = None
            c0 = time.thread_time_ns()
            h = x
            for block in blocks:
                if selective:
                    h = checkpoint(partial(_block_forward, block), h, use_reentrant=False, context_fn=contexts)
                else:
                    h = checkpoint(partial(_block_forward, block), h, use_reentrant=False)
            h.sum().backward()
            return (time.thread_time_ns() - c0) / 1e9

        diffs = []
        for i in range(warmup + repeats):
            replayed[0] = 0
            sac = step(True)
            plain = step(False)
            if i >= warmup:
                diffs.append(sac - plain)
        calls = BLOCKS * len(funcs) + replayed[0]
    per_call = max(0.0, statistics.median(diffs)) / calls
    source = (f"slackswap.runtime.export.dispatch_cost: {BLOCKS} pre-norm MLP blocks (width {width}, {tokens} tokens) "
              f"under plain checkpoint vs the export's SAC modes, thread CPU time, median of {repeats} pairs over "
              f"{calls} calls; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    return DispatchCost(per_call, calls, repeats, source)


__all__ = ["DispatchCost", "measure_dispatch_cost", "mlp_blocks"]
