"""Whether a graph describes this model under this torch build: both executors check it first."""

from __future__ import annotations

import torch

from slackswap.graph import Graph
from slackswap.runtime.capture import model_signature
from slackswap.runtime.errors import PlanMismatchError
from slackswap.runtime.op_numbering import IDENTITY_SCHEME


def check_identity(graph: Graph, model: torch.nn.Module) -> None:
    """Before training: the graph must come from this model, this torch build and our naming scheme."""
    meta = graph.meta
    wanted = {
        "identity_scheme": IDENTITY_SCHEME,
        "torch_version": torch.__version__,
        "model_signature": model_signature(model),
    }
    for key, value in wanted.items():
        if meta.get(key) != value:
            raise PlanMismatchError(
                f"graph {graph.name!r}: meta[{key!r}]={meta.get(key)!r} but this run has {value!r}; "
                "capture the graph from this model with this torch build (slackswap.runtime.capture_graph) "
                "and plan again, or move a plan of the meta-traced graph onto it (runtime.translate)"
            )
