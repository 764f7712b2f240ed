"""`graph.json`: a schema-versioned, lossless export of a profiled Graph.

Floats are written with Python's shortest round-trip repr (json does this), so
`graph_from_dict(graph_to_dict(g)) == g` exactly. A file with another schema name or version is
rejected on load rather than half-read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slackswap.errors import ConfigError
from slackswap.graph import Graph, Op, OpClass, Phase, Tensor

GRAPH_SCHEMA = "slackswap.graph"
GRAPH_SCHEMA_VERSION = 1

_OP_FIELDS = ("name", "phase", "op_class", "layer", "inputs", "outputs", "flops", "moved_bytes", "duration_s",
              "forward_op", "role")
_TENSOR_FIELDS = ("name", "size_bytes", "producer", "consumers", "layer", "saved", "role")


def graph_to_dict(graph: Graph) -> dict[str, Any]:
    return {
        "schema": GRAPH_SCHEMA,
        "schema_version": GRAPH_SCHEMA_VERSION,
        "name": graph.name,
        "num_layers": graph.num_layers,
        "weight_bytes": graph.weight_bytes,
        "weight_grad_bytes": graph.weight_grad_bytes,
        "optimizer_state_bytes": graph.optimizer_state_bytes,
        "meta": dict(graph.meta),
        "ops": [
            {
                "name": op.name, "phase": op.phase.value, "op_class": op.op_class.value, "layer": op.layer,
                "inputs": list(op.inputs), "outputs": list(op.outputs), "flops": op.flops,
                "moved_bytes": op.moved_bytes, "duration_s": op.duration_s, "forward_op": op.forward_op,
                "role": op.role,
            }
            for op in graph.ops
        ],
        "tensors": [
            {
                "name": t.name, "size_bytes": t.size_bytes, "producer": t.producer, "consumers": list(t.consumers),
                "layer": t.layer, "saved": t.saved, "role": t.role,
            }
            for t in graph.tensors.values()
        ],
    }


def _check_keys(where: str, record: Mapping[str, Any], expected: tuple[str, ...]) -> None:
    if set(record) != set(expected):
        raise ConfigError(where, sorted(set(record) ^ set(expected)), "missing or unknown field(s)")


def graph_from_dict(data: Mapping[str, Any]) -> Graph:
    """Inverse of `graph_to_dict`; checks the schema name and version first."""
    if data.get("schema") != GRAPH_SCHEMA:
        raise ConfigError("graph.schema", data.get("schema"), f"expected {GRAPH_SCHEMA!r}")
    if data.get("schema_version") != GRAPH_SCHEMA_VERSION:
        raise ConfigError("graph.schema_version", data.get("schema_version"),
                          f"this SlackSwap reads version {GRAPH_SCHEMA_VERSION} only")
    ops = []
    for rec in data["ops"]:
        _check_keys(f"graph.ops[{rec.get('name')!r}]", rec, _OP_FIELDS)
        ops.append(Op(rec["name"], Phase(rec["phase"]), OpClass(rec["op_class"]), rec["layer"], tuple(rec["inputs"]),
                      tuple(rec["outputs"]), float(rec["flops"]), rec["moved_bytes"], float(rec["duration_s"]),
                      rec["forward_op"], rec["role"]))
    tensors = {}
    for rec in data["tensors"]:
        _check_keys(f"graph.tensors[{rec.get('name')!r}]", rec, _TENSOR_FIELDS)
        tensors[rec["name"]] = Tensor(rec["name"], rec["size_bytes"], rec["producer"], tuple(rec["consumers"]),
                                      rec["layer"], rec["saved"], rec["role"])
    return Graph(data["name"], tuple(ops), tensors, data["num_layers"], weight_bytes=data["weight_bytes"],
                 weight_grad_bytes=data["weight_grad_bytes"], optimizer_state_bytes=data["optimizer_state_bytes"],
                 meta=data["meta"])


def write_graph_json(graph: Graph, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(graph_to_dict(graph)))
    return path


def read_graph_json(path: str | Path) -> Graph:
    return graph_from_dict(json.loads(Path(path).read_text()))
