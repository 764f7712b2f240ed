"""Independent evaluations spread over cores, or a cluster, through joblib.

Why joblib rather than a hand-made process pool: its backends are chosen by name, so the same search
runs in this process (`n_jobs=1`), over local worker processes (`loky`, the default), or on a cluster
(`dask` with a `distributed` client, `ray` after `ray.util.joblib.register_ray()`; or any backend a
caller sets with `joblib.parallel_config`). Tasks are pickled with cloudpickle (loky, dask), which
also carries the read-only mappings a `Hardware` holds.

Results come back in the order of the tasks, one by one as they finish in that order, so a caller
can write each to disk as it arrives (an interrupted search keeps them) and the answer does not
depend on how many workers ran it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from slackswap.errors import ConfigError

#: Backends joblib ships with; others (dask, ray) are registered by their packages.
BUILTIN_BACKENDS = ("loky", "threading", "multiprocessing", "sequential")


def check_n_jobs(field: str, n_jobs: Any) -> int:
    """joblib's convention: a positive count, or -1 for every core (-2 all but one, ...); not 0."""
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs == 0:
        raise ConfigError(field, n_jobs, "must be a non-zero integer (joblib: -1 is every core)")
    return n_jobs


def _backend(name: str | None) -> contextlib.AbstractContextManager:
    if name is None:
        return contextlib.nullcontext()  # whatever `joblib.parallel_config` the caller set
    if name == "ray":
        from ray.util.joblib import register_ray  # ray[default]: the backend registers on import

        register_ray()
    from joblib import parallel_config

    return parallel_config(backend=name)


def ordered_map(fn: Callable[[Any], Any], tasks: Iterable[Any], n_jobs: int = 1,
                backend: str | None = "loky") -> Iterator[Any]:
    """`fn(task)` for every task, yielded in task order as each is ready, over `n_jobs` workers of
    `backend` (None: the caller's `joblib.parallel_config`). `n_jobs=1` runs in this process."""
    from joblib import Parallel, delayed

    with _backend(backend):
        yield from Parallel(n_jobs=n_jobs, return_as="generator")(delayed(fn)(t) for t in tasks)


def effective_n_jobs(n_jobs: int, backend: str | None = "loky") -> int:
    """How many workers `n_jobs` means under `backend` (a count of cores for -1)."""
    from joblib import effective_n_jobs as joblib_effective

    with _backend(backend):
        return joblib_effective(n_jobs)
