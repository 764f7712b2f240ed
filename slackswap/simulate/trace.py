"""trace.json: the simulated step in Chrome trace-event format (opens in ui.perfetto.dev / chrome://tracing).

One process ("slackswap step"); threads `compute`, `d2h`, `h2d` (extra copy engines of a direction
get their own thread, `d2h.1`, ...: events of one thread must not overlap); complete events
(`"ph": "X"`, `ts`/`dur` in microseconds); a counter track `memory` (`"ph": "C"`, `args.bytes`)
with the device activation bytes after every change. Compute events carry `args.op` and `args.kind`
(run / recompute); transfer events `args.tensor` and `args.bytes`.
"""

from __future__ import annotations

import json
from pathlib import Path

from slackswap.simulate.result import STREAMS, SimResult

_PID = 1
_US_PER_S = 1e6


def _thread(stream: str, engine: int) -> str:
    return stream if engine == 0 else f"{stream}.{engine}"


def trace_events(result: SimResult) -> list[dict]:
    threads = sorted(
        {(e.stream, e.engine) for e in result.events} | {(s, 0) for s in STREAMS},
        key=lambda se: (STREAMS.index(se[0]), se[1]),
    )
    tid = {se: i + 1 for i, se in enumerate(threads)}
    out: list[dict] = [
        {"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": f"slackswap step ({result.planner})"}}
    ]
    for se, t in tid.items():
        out.append({"ph": "M", "pid": _PID, "tid": t, "name": "thread_name", "args": {"name": _thread(*se)}})
        out.append({"ph": "M", "pid": _PID, "tid": t, "name": "thread_sort_index", "args": {"sort_index": t}})
    for e in result.events:
        event = {
            "ph": "X",
            "pid": _PID,
            "tid": tid[e.stream, e.engine],
            "ts": e.start_s * _US_PER_S,
            "dur": (e.end_s - e.start_s) * _US_PER_S,
            "cat": e.stream,
        }
        if e.stream == "compute":
            event["name"] = e.op if e.kind == "run" else f"recompute {e.op}"
            event["args"] = {
                "op": e.op,
                "kind": e.kind,
                "step": e.index,
                "alloc_bytes": e.size_bytes,
                "wait_prefetch_s": e.wait_prefetch_s,
                "wait_memory_s": e.wait_memory_s,
            }
            if e.wait_offload_s:  # only under a tool offloader (slackswap.schedule.offloader)
                event["args"]["wait_offload_s"] = e.wait_offload_s
        else:
            event["name"] = f"{e.kind} {e.tensor}"
            event["args"] = {"tensor": e.tensor, "bytes": e.size_bytes, "kind": e.kind, "index": e.index}
        out.append(event)
    for t, b in zip(result.memory_times_s, result.memory_bytes, strict=True):
        out.append({"ph": "C", "pid": _PID, "name": "memory", "ts": t * _US_PER_S, "args": {"bytes": b}})
    return out


#: First key of the file, so a text preview (the MLflow artifact view) says what to open it with.
HOW_TO_OPEN = "Open in https://ui.perfetto.dev (drop the file in, or 'Open trace file'); chrome://tracing works too."


def write_trace_json(result: SimResult, path: str | Path) -> Path:
    """Write the trace, one event per line after a header naming the viewer: a preview of the file
    reads as a trace, not as one line of JSON, and the bytes are the same but for the newlines."""
    path = Path(path)
    head = {
        "otherData": {
            "how_to_open": HOW_TO_OPEN,
            "planner": result.planner,
            "feasible": result.feasible,
            "infeasible_reason": result.infeasible_reason,
            "step_s": result.step_s,
            "budget_bytes": result.budget_bytes,
            "peak_activation_bytes": result.peak_activation_bytes,
        },
        "displayTimeUnit": "ms",
    }
    events = ",\n".join(json.dumps(e) for e in trace_events(result))
    path.write_text(json.dumps(head)[:-1] + ', "traceEvents": [\n' + events + "\n]}\n")
    return path
