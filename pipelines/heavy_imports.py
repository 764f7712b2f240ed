"""The heavy imports of a pipeline process (mlflow with its SQLAlchemy store, matplotlib), made once
with CPython's cyclic garbage collector paused, then frozen.

Importing them creates a few hundred thousand long-lived objects (classes, functions, dicts). The
collector runs a generation-0 pass every 700 net allocations and promotes survivors into ever larger
older generations, so it re-traverses the growing heap again and again while nothing is garbage:
about a quarter of the import time (measured on the 2-core machine: `import mlflow`, the SQLAlchemy
store and `matplotlib.pyplot` in 2.9 s with the collector, 2.2 s without). After the imports,
`gc.freeze()` moves every object that exists into the permanent generation, so the full collections
of the jobs that follow (a sweep runs hundreds in this process) no longer traverse mlflow's,
SQLAlchemy's and pandas' objects either. What this gives up: reference cycles that exist at that
moment and become garbage later are never collected; they are import-time objects that live as long
as the process anyway.

Pausing is skipped once a module is imported, so a process (a test session, a sweep) pays it and
freezes once per module, not per job.
"""

from __future__ import annotations

import gc
import importlib
import sys
from types import ModuleType


def import_paused(name: str) -> ModuleType:
    """`importlib.import_module(name)`, with the collector paused and the heap frozen after a first import."""
    if name in sys.modules:
        return sys.modules[name]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(name)
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
