"""Start the two ranks of a tests/*_fsdp2_worker.py by fork, after importing what they use.

With `mp.spawn` each rank was a fresh interpreter importing torch, transformers, lightning or
accelerate again (about 5 s CPU each under load, more than the training itself); forked ranks inherit
the parent's modules. What a rank imports only once it runs (Dynamo at the capture's first dispatch,
sympy, scipy's solvers, the planners, the Trainer's modules) is imported here too: in each rank it
cost about 1.5 s CPU a rank. Nothing here runs a torch op before the fork, and the process is still
one thread when it forks, so no OpenMP or intra-op thread pool exists to be copied broken; each rank
still makes its own gloo process group after the fork, so the ranks are two processes with their own
collectives, as before."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch.multiprocessing as mp

#: What each rank's first planned step imports (Dynamo, which torch imports at the capture's first
#: dispatch, sympy, scipy's solvers, the planners): imported once here, not once in each rank.
PLANNING = ("torch._dynamo", "slackswap.runtime.export", "slackswap.experiment.export_plan",
            "slackswap.simulate.metrics", "slackswap.simulate.saved_peak", "slackswap.profile.torch.assemble",
            "slackswap.profile.torch.tracer", "scipy.optimize", "scipy.sparse.csgraph")
#: What examples/hf_trainer.py's module and its Trainer import (transformers resolves its names lazily).
EXAMPLE = ("transformers.trainer", "transformers.models.llama.modeling_llama", "transformers.models.t5.modeling_t5",
           "accelerate.accelerator", "torch.distributed.checkpoint", "torch.distributed.elastic")


def fork_two_ranks(worker: Callable[..., None], args: tuple, preload: tuple[str, ...] = ()) -> None:
    """Import `preload` and `PLANNING` here (and every planner), then run `worker(rank, *args)` in two
    forked processes; raise if one fails."""
    from slackswap.planners.registry import available_planners

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in (*preload, *PLANNING):
        importlib.import_module(name)
    available_planners()
    mp.start_processes(worker, args=args, nprocs=2, join=True, start_method="fork")
