"""Schema-versioned JSON export of a Plan (`plan.json` in every run directory).

`plan_from_dict(plan_to_dict(p)) == p` for every plan; an unknown schema version or a missing field
is an error naming it, never a silent default. Version 1 files (before `graph_fingerprint`) are still
read: their plan has graph_fingerprint "" (unknown), which the validator does not check.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slackswap.errors import ConfigError, read_json_file
from slackswap.plan import PLAN_SCHEMA_VERSION, ComputeStep, Decision, Direction, Plan, StepKind, Transfer

_V1_FIELDS = ("schema_version", "planner", "budget_bytes", "decisions", "steps", "offloads", "prefetches",
              "bound_step_s", "notes")
_FIELDS_BY_VERSION = {1: _V1_FIELDS, 2: (*_V1_FIELDS, "graph_fingerprint")}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "schema_version": PLAN_SCHEMA_VERSION,
        "planner": plan.planner,
        "budget_bytes": plan.budget_bytes,
        "decisions": {t: d.value for t, d in plan.decisions.items()},
        "steps": [{"op": s.op, "kind": s.kind.value, "outputs": list(s.outputs)} for s in plan.steps],
        "offloads": [_transfer_to_dict(t) for t in plan.offloads],
        "prefetches": [_transfer_to_dict(t) for t in plan.prefetches],
        "bound_step_s": plan.bound_step_s,
        "notes": dict(plan.notes),
        "graph_fingerprint": plan.graph_fingerprint,
    }


def plan_from_dict(data: Mapping[str, Any]) -> Plan:
    version = data.get("schema_version")
    if version not in _FIELDS_BY_VERSION:
        raise ConfigError("plan.schema_version", version, f"this code reads versions {sorted(_FIELDS_BY_VERSION)}")
    fields = _FIELDS_BY_VERSION[version]
    missing = [f for f in fields if f not in data]
    if missing:
        raise ConfigError("plan", missing, "missing field(s)")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError("plan", unknown, "unknown field(s)")
    return Plan(
        planner=data["planner"],
        budget_bytes=data["budget_bytes"],
        decisions={t: Decision(d) for t, d in data["decisions"].items()},
        steps=tuple(ComputeStep(s["op"], StepKind(s["kind"]), tuple(s["outputs"])) for s in data["steps"]),
        offloads=tuple(_transfer_from_dict(t) for t in data["offloads"]),
        prefetches=tuple(_transfer_from_dict(t) for t in data["prefetches"]),
        bound_step_s=data["bound_step_s"],
        notes=dict(data["notes"]),
        graph_fingerprint=data.get("graph_fingerprint", ""),
    )


def write_plan_json(plan: Plan, path: str | Path) -> Path:
    """Write `plan.json`; notes must be JSON-able (non-finite floats are rejected, not written as NaN)."""
    path = Path(path)
    bound = plan.bound_step_s
    if bound is not None and not math.isfinite(bound):
        raise ConfigError("plan.bound_step_s", bound, "must be finite to be written as JSON")
    text = json.dumps(plan_to_dict(plan), indent=1, allow_nan=False)
    path.write_text(text + "\n")
    return path


def read_plan_json(path: str | Path) -> Plan:
    """Read a plan.json; a file that is not one is a `FileFormatError` naming the path (invalid JSON) or
    a `ConfigError` naming the field."""
    return plan_from_dict(read_json_file(path, "plan.json"))


def _transfer_to_dict(t: Transfer) -> dict[str, Any]:
    return {"tensor": t.tensor, "direction": t.direction.value, "issue_after_step": t.issue_after_step}


def _transfer_from_dict(d: Mapping[str, Any]) -> Transfer:
    return Transfer(d["tensor"], Direction(d["direction"]), int(d["issue_after_step"]))
