"""The simulator against its peer: our engine vs a linear SimPy model of the same rules, in one run.

Run: `python benchmarks/bench_simulate.py [--quick]` (pins itself to one CPU). Writes
benchmarks/results/simulate.json.

Graph: `build_graph` of the Llama-2-70B preset with `num_layers` overridden, on a100_80gb_pcie4. Plan:
in each layer the saved tensors, in production order, are cycled swap / recompute / keep (recompute only
for forward-produced tensors; others keep), turned into an explicit schedule by `build_schedule` (ALAP
prefetch). Budget: that plan's own unlimited peak, the tightest budget it meets, so every allocation is
checked against a binding limit and the whole step runs.

Timed, interleaved round robin so both sides see the same load (best of N):
- `simulate`: our end-to-end call (plan validation + copy resolution + event loop + SimResult);
- `engine`: copy resolution + event loop + SimResult, without the validation rules, which the peer
  does not check either. The SimResult holds its events as an `EventLog` (start/end, waits, engine
  per event, by index), as the peer holds its (start, end) pairs; the TraceEvent tuples are built on
  first use;
- `engine_events`: `engine` plus building every TraceEvent (what a caller that reads `.events`, such
  as the trace.json writer, pays once), reported beside it so the laziness hides nothing;
- `simpy`: `tests/simpy_model.py` (its own copy resolution + SimPy processes), the model the tests
  hold the engine to, with linear setup.
Each size also checks that the two agree event for event (same events, start/end within 1e-12 s).
"""

from __future__ import annotations

import sys

REPO_PATH = __import__("pathlib").Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_PATH))

from benchmarks.common import best_of, conf, fit_exponent, machine, main_with_quick, pin_one_core, save_result  # noqa: E402
from slackswap.graph import FORWARD_PHASES, Graph  # noqa: E402
from slackswap.hardware import Hardware  # noqa: E402
from slackswap.model_config import ModelConfig  # noqa: E402
from slackswap.plan import Decision  # noqa: E402
from slackswap.profile import build_graph  # noqa: E402
from slackswap.schedule.build import build_schedule  # noqa: E402
from slackswap.schedule.copies import resolve_copies  # noqa: E402
from slackswap.simulate import simulate  # noqa: E402
from slackswap.simulate.engine import _execute  # noqa: E402
from tests.simpy_model import simpy_model  # noqa: E402

LAYERS = (8, 16, 32, 80, 160, 320)
QUICK_LAYERS = (8, 32, 80, 160, 320)
CYCLE = (Decision.SWAP, Decision.RECOMPUTE, Decision.KEEP)
SIDES = ("simulate", "engine", "engine_events", "simpy")


def mixed_decisions(graph: Graph) -> dict[str, Decision]:
    index_in_layer: dict[int, int] = {}
    out = {}
    for t in graph.saved_tensors:
        i = index_in_layer.get(t.layer, 0)
        index_in_layer[t.layer] = i + 1
        decision = CYCLE[i % 3]
        forward = graph.op_by_name[t.producer].phase in FORWARD_PHASES
        out[t.name] = Decision.KEEP if decision == Decision.RECOMPUTE and not forward else decision
    return out


def prepare(layers: int, hw: Hardware) -> dict:
    """The graph, plan, budget and the three timed callables of one size; checks the peer agrees."""
    graph = build_graph(ModelConfig.from_dict({**conf("model", "llama2_70b"), "num_layers": layers}), hw)
    plan = build_schedule(graph, mixed_decisions(graph), planner="bench_mixed", budget_bytes=None, hardware=hw)
    budget = simulate(graph, plan, hw, None).peak_activation_bytes
    offload_of = {tr.tensor: k for k, tr in enumerate(plan.offloads)}
    result = simulate(graph, plan, hw, budget)
    feasible, peer_events, peer_peak = simpy_model(graph, plan, hw, budget)
    ours = {(e.stream, e.index): (e.start_s, e.end_s) for e in result.events}
    assert feasible == result.feasible and peer_peak == result.peak_activation_bytes
    assert ours.keys() == peer_events.keys(), "the engine and the SimPy peer ran different events"
    max_diff = max(abs(a - b) for k, v in ours.items() for a, b in zip(v, peer_events[k], strict=True))
    assert max_diff <= 1e-12 * max(1.0, result.end_s), max_diff
    return {
        "row": {
            "layers": layers,
            "ops": len(graph.ops),
            "steps": len(plan.steps),
            "transfers": len(plan.offloads) + len(plan.prefetches),
            "events": len(result.events),
            "memory_samples": len(result.memory_bytes),
            "feasible": result.feasible,
            "max_event_time_diff_s": max_diff,
        },
        "fns": {
            "simulate": lambda: simulate(graph, plan, hw, budget),
            "engine": lambda: _execute(graph, plan, hw, budget, resolve_copies(graph, plan, offload_of)),
            "engine_events": lambda: tuple(
                _execute(graph, plan, hw, budget, resolve_copies(graph, plan, offload_of)).events
            ),
            "simpy": lambda: simpy_model(graph, plan, hw, budget),
        },
    }


def run(quick: bool = False) -> dict:
    cpus = pin_one_core()
    start = machine()
    hw = Hardware.from_dict(conf("hardware", "a100_80gb_pcie4"))
    layers = QUICK_LAYERS if quick else LAYERS
    repeats = 5 if quick else 9
    sizes = {n: prepare(n, hw) for n in layers}
    # One round robin over every (size, side): all of them see the same load over time, so neither
    # the ratios nor the scaling fit pick up a change of load between sizes.
    best = best_of({(n, k): fn for n, p in sizes.items() for k, fn in p["fns"].items()}, repeats)
    rows = []
    for n, p in sizes.items():
        row = p["row"]
        for k in SIDES:
            row[f"{k}_best_s"] = best[n, k]
            row[f"{k}_us_per_op"] = best[n, k] / row["ops"] * 1e6
        row["ratio_simpy_over_engine"] = best[n, "simpy"] / best[n, "engine"]
        row["ratio_simpy_over_engine_events"] = best[n, "simpy"] / best[n, "engine_events"]
        row["ratio_simpy_over_simulate"] = best[n, "simpy"] / best[n, "simulate"]
        rows.append(row)
    print(f"{'layers':>6} {'ops':>6} {'events':>7} {'simulate ms':>11} {'engine ms':>9} {'+events ms':>10} "
          f"{'simpy ms':>9} {'simpy/engine':>12} {'simpy/+ev':>9} {'simpy/sim':>9} {'us/op sim':>9} {'us/op eng':>9}")
    for r in rows:
        print(f"{r['layers']:>6} {r['ops']:>6} {r['events']:>7} {r['simulate_best_s'] * 1e3:>11.2f} "
              f"{r['engine_best_s'] * 1e3:>9.2f} {r['engine_events_best_s'] * 1e3:>10.2f} "
              f"{r['simpy_best_s'] * 1e3:>9.2f} {r['ratio_simpy_over_engine']:>12.2f} "
              f"{r['ratio_simpy_over_engine_events']:>9.2f} {r['ratio_simpy_over_simulate']:>9.2f} "
              f"{r['simulate_us_per_op']:>9.2f} {r['engine_us_per_op']:>9.2f}")
    xs = [r["layers"] for r in rows]
    exponents = {k: fit_exponent(xs, [r[f"{k}_best_s"] for r in rows]) for k in SIDES}
    print("scaling exponent (time ~ layers^k): " + ", ".join(f"{k} {v:.2f}" for k, v in exponents.items()))
    out = {
        "benchmark": "simulate",
        "model": "llama2_70b (num_layers overridden)",
        "hardware": "a100_80gb_pcie4",
        "plan": "per layer cycle swap/recompute/keep over saved tensors; build_schedule (alap); "
        "budget = plan's own unlimited peak",
        "peer": "tests/simpy_model.py (linear SimPy model of the same rules), timed interleaved",
        "engine_events": "engine plus building every TraceEvent of the result's EventLog",
        "repeats": repeats,
        "cpu_affinity": cpus,
        "machine_at_start": start,
        "machine_at_end": machine(),
        "rows": rows,
        "exponents": exponents,
    }
    save_result("simulate.json", out)
    return out


if __name__ == "__main__":
    main_with_quick(run)
