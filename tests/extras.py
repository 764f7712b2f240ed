"""The one switch between "skip" and "fail" for tests that need the `torch` extra.

The core and `pytest` run without torch (`pip install -e ".[test]"`): a test that needs torch or
transformers skips there. CI installs the extra and sets `SLACKSWAP_REQUIRE_TORCH=1` (`.ci/run`), and
then a missing module is a failure, so a broken install cannot turn the torch tests into silent
skips. Every test that needs the extra goes through `require_torch_extra`, at module level (the whole
file needs it) or inside one test.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

ENV = "SLACKSWAP_REQUIRE_TORCH"
HINT = "needs the torch extra: pip install -e '.[torch]'"


def torch_required() -> bool:
    """True where CI demands the torch tests run (the variable set to anything but empty or 0)."""
    return os.environ.get(ENV, "") not in ("", "0")


def require_torch_extra(module: str = "torch") -> ModuleType:
    """Import `module` (torch, transformers, or a module of ours that needs them) and return it; without
    it, skip the caller, or fail it when `SLACKSWAP_REQUIRE_TORCH` is set."""
    if not torch_required():
        return pytest.importorskip(module, reason=HINT)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        why = str(exc)
    pytest.fail(f"{ENV}={os.environ[ENV]} but {module} cannot be imported ({why}); {HINT}", pytrace=False)
