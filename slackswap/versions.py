"""The versions of Python and of installed distributions, read from package metadata.

Why: a result depends on the code that produced it, not only on its config: a traced graph on the
torch and transformers versions (their model code decides which aten ops run, so which tensors are
saved), a plan and its simulation on numpy and scipy. Reading `importlib.metadata` imports nothing,
so a record can name torch's version in a process that never imports torch.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from importlib import metadata

import slackswap

#: Shown for a distribution that is not installed (the torch extra on a core-only install).
NOT_INSTALLED = "not installed"


def package_versions(distributions: Sequence[str]) -> dict[str, str]:
    """{"python": "3.11.9", "slackswap": "0.1.0", name: version of each distribution}."""
    out = {"python": platform.python_version(), "slackswap": slackswap.__version__}
    for name in distributions:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = NOT_INSTALLED
    return out
