"""An entry point run in the test's own process, as `python -m <module>` would run it.

Starting an interpreter costs seconds (mlflow, hydra); many fault and config tests only need the exit
code and what was printed, so they run the module with `runpy` instead. Hydra resolves
`config_path="../conf"` next to the file only when the task function lives in `__main__`, hence
`run_name="__main__"`; its global state is cleared before and after so runs do not leak into each other.
"""

from __future__ import annotations

import runpy
import sys
import warnings
from collections.abc import Sequence

import pytest
from hydra.core.global_hydra import GlobalHydra


def run_cli_in_process(
    monkeypatch: pytest.MonkeyPatch, module: str, args: Sequence[str], *, full_error: bool = False
) -> int:
    """Run `module` with `args`; returns its exit code (0 when it returns without `sys.exit`).

    `full_error` sets HYDRA_FULL_ERROR, under which Hydra re-raises the task's exception instead of
    printing it and exiting 1 (a test that wants the exception itself)."""
    monkeypatch.setattr(sys, "argv", [module.replace(".", "/") + ".py", *args])
    if full_error:
        monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    else:
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    GlobalHydra.instance().clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules" after a previous run
            runpy.run_module(module, run_name="__main__")
    except SystemExit as exc:
        return exc.code
    finally:
        GlobalHydra.instance().clear()
    return 0
