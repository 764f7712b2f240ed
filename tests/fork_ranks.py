"""Start the two ranks of a tests/*_fsdp2_worker.py by fork, after importing what they use.

With `mp.spawn` each rank was a fresh interpreter importing torch, transformers, lightning or
accelerate again (about 5 s CPU each under load, more than the training itself); forked ranks inherit
the parent's modules. Nothing here runs a torch op before the fork, so no OpenMP or intra-op thread
pool exists to be copied broken; each rank still makes its own gloo process group after the fork,
so the ranks are two processes with their own collectives, as before."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch.multiprocessing as mp


def fork_two_ranks(worker: Callable[..., None], args: tuple, preload: tuple[str, ...] = ()) -> None:
    """Import `preload` here, then run `worker(rank, *args)` in two forked processes; raise if one fails."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in preload:
        importlib.import_module(name)
    mp.start_processes(worker, args=args, nprocs=2, join=True, start_method="fork")
