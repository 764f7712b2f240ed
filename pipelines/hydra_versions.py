"""What differs between Hydra 1.3 / omegaconf 2.3 and Hydra 1.4 / omegaconf 2.4, in one place.

The project runs on both through their public APIs (CI runs the fast tests on 1.4.0rc3). Three
things differ, each a deprecation that prints a warning on every command under 1.4 and breaks the
one-line error contract (`pipelines.faults`):
- `@hydra.main(version_base=...)`: 1.3 needs it ("1.3": without it Hydra 1.3 assumes 1.1's defaults
  and warns); 1.4 deprecates the parameter and uses its own defaults, which keep 1.3's behaviour.
- omegaconf 2.4 deprecates `register_new_resolver` for a new `register_resolver` (2.3's
  `register_resolver` is another, removed API, so the name alone cannot tell them apart).
- Hydra 1.4 warns that it instantiates a callback's `_target_` without an execution whitelist; the
  call site is Hydra's own, so the warning is filtered for the project's own callback only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import hydra
import omegaconf
from omegaconf import OmegaConf


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


HYDRA_1_4 = _major_minor(hydra.__version__) >= (1, 4)
OMEGACONF_2_4 = _major_minor(omegaconf.__version__) >= (2, 4)

#: Keyword arguments of every `@hydra.main` of the project.
MAIN_VERSION: dict[str, Any] = {} if HYDRA_1_4 else {"version_base": "1.3"}


def register_resolver(name: str, resolver: Callable[..., Any]) -> None:
    """Register an OmegaConf resolver once, under the API the installed omegaconf prefers."""
    if OmegaConf.has_resolver(name):
        return
    if OMEGACONF_2_4:
        OmegaConf.register_resolver(name, resolver)
    else:
        OmegaConf.register_new_resolver(name, resolver)


def trust_own_callbacks() -> None:
    """Hydra 1.4's warning about instantiating `pipelines.callbacks.*` from `hydra.callbacks`: the target is
    this project's own class, named by its own conf/, so it is trusted."""
    own_callback = r"hydra\.utils\.instantiate\(\) resolved _target_='pipelines\.callbacks\."
    warnings.filterwarnings("ignore", message=own_callback, category=UserWarning)
