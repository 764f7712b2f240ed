"""Helpers shared by the benchmarks: presets, pinning, best-of-N timing, scaling fits, machine load.

Timing on a shared machine is noisy. The benchmarks therefore time with the process's CPU clock
(`time.process_time`: the time this process ran, which other processes' load does not add to, unlike
wall time), report the best of several repeats (the least disturbed), pin themselves to one core
where the OS allows, interleave a measurement with its
peer (ours vs SimPy in the same loop, so both see the same load) and report the ratio, and fit
scaling exponents over a wide range of sizes (8..320 layers), which a constant factor of load does not
move. Every result file records the load average at start and end of the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def conf(group: str, name: str) -> dict:
    return yaml.safe_load((REPO / "conf" / group / f"{name}.yaml").read_text())


def pin_one_core() -> list[int] | None:
    """Run on one CPU (the lowest allowed), so the figures are single-core figures."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    return sorted(os.sched_getaffinity(0))


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_1_5_15": None if load is None else [round(x, 2) for x in load],
    }


def best_of(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best CPU time of each function (single-threaded code: CPU time = its own run time without the
    waits for other processes), measured interleaved (round robin) so all see the same conditions."""
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - t0)
    return best


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """k of y ~ c * x^k, least squares in log-log."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def save_result(filename: str, data: dict) -> Path:
    """Write one benchmark's figures to benchmarks/results/<filename> (indented JSON)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / filename
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def main_with_quick(run: Callable[[bool], object]) -> None:
    """The command line of a benchmark: `--quick` for the smaller sizes `run_all.py --quick` uses."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    run(parser.parse_args().quick)
