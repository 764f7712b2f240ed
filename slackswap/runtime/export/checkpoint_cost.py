"""The host cost of the eager export's non-reentrant checkpoint itself, per region and per saved tensor,
measured once on the machine by a microbenchmark that runs no plan and no model of the user's.

Why: every layer of an eager export runs under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`,
plain or with the SAC policy (`slackswap.runtime.export.install`). Beyond the ops it runs again (the
replay, which the prediction already simulates: `slackswap.pytorch_execution.pytorch_plan(..., "eager")`)
and the SAC modes' per-call dispatch (`slackswap.runtime.export.dispatch_cost`), the checkpoint does host
work of its own that no op-time table holds: per region, a frame, the RNG and autocast state stashed
and restored, the recompute started from backward and stopped early by an exception; per saved tensor,
a Python pack hook in the forward (a holder instead of the tensor), another in the recompute (the
recomputed tensor stored into the frame) and a Python unpack hook in backward. On the CPU at small
shapes that is a measurable part of a step, so it is measured once, apart from any plan's step, and a
prediction adds it per region and per saved tensor the export runs
(`slackswap.experiment.measured_executor.predict_export`).

The microbenchmark: `BLOCKS` small pre-norm MLP blocks (width `WIDTH`, `TOKENS` tokens), forward and
backward, thread CPU time (other load and intra-op threads add nothing), in three kinds of step that
alternate (drift touches all alike):

- `rerun`: no checkpoint, each block's forward run a second time with autograd on and dropped: the ops a
  checkpoint's recompute runs, without the checkpoint;
- `each`: every block its own checkpoint region (`BLOCKS` regions);
- `one`: all blocks in one region (1 region), the same ops and the same saved tensors.

So `each - rerun` = BLOCKS * per_region + S * per_saved and `each - one` = (BLOCKS - 1) * per_region, S the
tensors autograd saves in the blocks' forward (their pack events, weights included), counted. Medians over
the repeats; both kept >= 0.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from slackswap.profile.measured import ExportHostCost
from slackswap.runtime.export.dispatch_cost import mlp_blocks

#: Tiny shapes on purpose: the checkpoint's host work does not depend on them, the kernels do, and their
#: noise is what the differences must not carry (at width 64 and 64 tokens, on this project's loaded
#: 2-core machine, the per-saved figure came out 0 to 32 us over repeated runs; here 14 to 18 us).
BLOCKS, WIDTH, TOKENS = 8, 16, 8


@dataclass(frozen=True)
class CheckpointCost:
    """Host seconds of a non-reentrant checkpoint per region and per saved tensor (module docstring)."""

    per_region_s: float
    per_saved_s: float
    #: Saved tensors (pack events) per step of the microbenchmark.
    saved: int
    repeats: int
    source: str


def _run(blocks: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = x + block(x)
    return x


def measure_checkpoint_cost(warmup: int = 3, repeats: int = 41) -> CheckpointCost:
    """`CheckpointCost` of this machine's CPU (module docstring). The RNG state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        blocks = mlp_blocks(BLOCKS, WIDTH)
        x = torch.randn(TOKENS, WIDTH, requires_grad=True)
        count = [0]

        def pack(t):
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _run(blocks, x)
        saved = count[0]

        def step(kind: str) -> float:
            for p in blocks.parameters():
                p.grad = None
            x.grad = None
            c0 = time.thread_time_ns()
            if kind == "rerun":
                h = _run(blocks, x)
                _run(blocks, x.detach().requires_grad_())  # the recompute's ops, dropped
            elif kind == "each":
                h = x
                for block in blocks:
                    h = checkpoint(partial(_run, [block]), h, use_reentrant=False)
            else:
                h = checkpoint(partial(_run, blocks), x, use_reentrant=False)
            h.sum().backward()
            return (time.thread_time_ns() - c0) / 1e9

        each_rerun, each_one = [], []
        for i in range(warmup + repeats):
            t = {kind: step(kind) for kind in ("each", "rerun", "one")}
            if i >= warmup:
                each_rerun.append(t["each"] - t["rerun"])
                each_one.append(t["each"] - t["one"])
    per_region = max(0.0, statistics.median(each_one) / (BLOCKS - 1))
    per_saved = max(0.0, (statistics.median(each_rerun) - BLOCKS * per_region) / saved)
    source = (f"slackswap.runtime.export.checkpoint_cost: {BLOCKS} pre-norm MLP blocks (width {WIDTH}, {TOKENS} "
              f"tokens, {saved} saved tensors) in {BLOCKS} non-reentrant checkpoint regions vs 1 vs none with the "
              f"forward run twice, thread CPU time, medians of {repeats} steps; torch {torch.__version__}, "
              f"{torch.get_num_threads()} thread(s)")
    return CheckpointCost(per_region, per_saved, saved, repeats, source)


def measure_export_host_cost(shape: tuple[int, int] | None = None) -> ExportHostCost:
    """The eager export's `ExportHostCost` on this machine's CPU: the SAC modes' cost per call
    (`slackswap.runtime.export.dispatch_cost`), its blocks at `shape` (width, tokens: the model's, from
    `slackswap.experiment.measured_prediction.export_block_shape`; None: the microbenchmark's own), and the
    checkpoint's per region and per saved tensor (above)."""
    from slackswap.runtime.export.dispatch_cost import TOKENS, WIDTH, measure_dispatch_cost

    width, tokens = shape or (WIDTH, TOKENS)
    dispatch = measure_dispatch_cost(width=width, tokens=tokens)
    frames = measure_checkpoint_cost()
    return ExportHostCost(sac_per_call_s=dispatch.per_call_s, checkpoint_per_region_s=frames.per_region_s,
                          checkpoint_per_saved_s=frames.per_saved_s, source=f"{dispatch.source}; {frames.source}")


__all__ = ["CheckpointCost", "measure_checkpoint_cost", "measure_export_host_cost"]
