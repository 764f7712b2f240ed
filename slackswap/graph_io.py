"""`graph.json`: a schema-versioned, lossless export of a profiled Graph.

Floats are written with Python's shortest round-trip repr (json does this), so
`graph_from_dict(graph_to_dict(g)) == g` exactly. A file with another schema name or version is
rejected on load rather than half-read. Version 2 added the fields real programs need (`Tensor.base`,
`Op.random`, `Op.writes`, `Op.attention_core`); version 1 files are still read, with those fields at
their defaults (no aliases, no random or in-place ops), which is what version 1 meant. Version 3
added `Tensor.held_until` (the model's own references); older files read with no holds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slackswap.errors import ConfigError, read_json_file
from slackswap.graph import Graph, Op, OpClass, Phase, Tensor

GRAPH_SCHEMA = "slackswap.graph"
GRAPH_SCHEMA_VERSION = 3

_V1_OP_FIELDS = ("name", "phase", "op_class", "layer", "inputs", "outputs", "flops", "moved_bytes", "duration_s",
                 "forward_op", "role")
_V1_TENSOR_FIELDS = ("name", "size_bytes", "producer", "consumers", "layer", "saved", "role")
_OP_FIELDS = {1: _V1_OP_FIELDS, 2: (*_V1_OP_FIELDS, "random", "writes", "attention_core")}
_TENSOR_FIELDS = {1: _V1_TENSOR_FIELDS, 2: (*_V1_TENSOR_FIELDS, "base"), 3: (*_V1_TENSOR_FIELDS, "base", "held_until")}
_OP_FIELDS[3] = _OP_FIELDS[2]


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
                "role": op.role, "random": op.random, "writes": list(op.writes), "attention_core": op.attention_core,
            }
            for op in graph.ops
        ],
        "tensors": [
            {
                "name": t.name, "size_bytes": t.size_bytes, "producer": t.producer, "consumers": list(t.consumers),
                "layer": t.layer, "saved": t.saved, "role": t.role, "base": t.base,
                "held_until": t.held_until,
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
    version = data.get("schema_version")
    if version not in _OP_FIELDS:
        raise ConfigError("graph.schema_version", version, f"this SlackSwap reads versions {sorted(_OP_FIELDS)}")
    ops = []
    for rec in data["ops"]:
        _check_keys(f"graph.ops[{rec.get('name')!r}]", rec, _OP_FIELDS[version])
        ops.append(Op(rec["name"], Phase(rec["phase"]), OpClass(rec["op_class"]), rec["layer"], tuple(rec["inputs"]),
                      tuple(rec["outputs"]), float(rec["flops"]), rec["moved_bytes"], float(rec["duration_s"]),
                      rec["forward_op"], rec["role"], random=rec.get("random", False),
                      writes=tuple(rec.get("writes", ())), attention_core=rec.get("attention_core", False)))
    tensors = {}
    for rec in data["tensors"]:
        _check_keys(f"graph.tensors[{rec.get('name')!r}]", rec, _TENSOR_FIELDS[version])
        tensors[rec["name"]] = Tensor(rec["name"], rec["size_bytes"], rec["producer"], tuple(rec["consumers"]),
                                      rec["layer"], rec["saved"], rec["role"], base=rec.get("base", ""),
                                      held_until=rec.get("held_until", ""))
    return Graph(data["name"], tuple(ops), tensors, data["num_layers"], weight_bytes=data["weight_bytes"],
                 weight_grad_bytes=data["weight_grad_bytes"], optimizer_state_bytes=data["optimizer_state_bytes"],
                 meta=data["meta"])


def write_graph_json(graph: Graph, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(graph_to_dict(graph)))
    return path


def read_graph_json(path: str | Path) -> Graph:
    """Read a graph.json; a file that is not one is a `FileFormatError` naming the path (invalid JSON) or
    a `ConfigError` naming the field."""
    return graph_from_dict(read_json_file(path, "graph.json"))
