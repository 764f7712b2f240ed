"""SlackSwap: plan which activations to keep, swap to host or recompute under a memory budget.

The library is pure Python + numpy/scipy. It imports neither Hydra nor MLflow: those live in
`pipelines/`, so the planners and the simulator can be used from any driver.
"""

#: The release (CHANGELOG.md); pyproject.toml reads it from here.
__version__ = "0.4.1"
