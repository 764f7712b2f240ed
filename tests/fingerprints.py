"""Fingerprints of every heuristic planner's plan and of its simulation, on the seed presets.

Why: speed work on the planners and the engine must not change a single decision, step, transfer,
event time or memory sample unless the change is deliberate. `tests/test_fingerprints.py` recomputes
these and compares them with `tests/data/fingerprints.json`, which was written by running this module
on the code *before* the speed work. A deliberate change of plans (a new planner rule) regenerates the
file with `python -m tests.fingerprints` and says in its commit which fingerprints moved and why.

milp is left out: its plan comes from a time-limited solver.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml

from slackswap.errors import InfeasibleBudgetError
from slackswap.hardware import Hardware
from slackswap.model_config import ModelConfig
from slackswap.plan import Plan
from slackswap.planners.registry import get_planner
from slackswap.profile import build_graph
from slackswap.schedule.build import keep_all_plan
from slackswap.simulate import simulate
from slackswap.simulate.result import SimResult

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data" / "fingerprints.json"
PLANNERS = ("slackswap", "slackswap_seed", "capuchin", "recompute_knapsack", "selective_recompute",
            "full_recompute", "swap_only", "keep_all")
#: (model preset, layers override or None, budget fraction of the keep-all peak)
CASES = (("tiny", None, 0.5), ("bert_large", None, 0.5), ("gpt2_xl", None, 0.5), ("gpt2_xl", None, 0.3),
         ("llama7b", None, 0.5), ("llama2_70b", 8, 0.5), ("llama2_70b", 8, 0.25))


def _yaml(group: str, name: str) -> dict:
    return yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())


def _sha(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def plan_fingerprint(plan: Plan) -> str:
    """Everything the simulator executes (notes left out: they may hold wall times)."""
    return _sha({
        "budget_bytes": plan.budget_bytes,
        "decisions": {t: d.value for t, d in plan.decisions.items()},
        "steps": [[s.op, s.kind.value, list(s.outputs)] for s in plan.steps],
        "offloads": [[t.tensor, t.issue_after_step] for t in plan.offloads],
        "prefetches": [[t.tensor, t.issue_after_step] for t in plan.prefetches],
        "bound_step_s": plan.bound_step_s,
    })


def result_fingerprint(result: SimResult) -> str:
    """Every event (times as exact float reprs) and every memory sample, plus the outcome."""
    return _sha({
        "feasible": result.feasible,
        "reason": result.infeasible_reason,
        "events": [[e.stream, e.kind, e.index, repr(e.start_s), repr(e.end_s), e.op, e.tensor, e.size_bytes,
                    e.engine, repr(e.wait_prefetch_s), repr(e.wait_memory_s)] for e in result.events],
        "memory": [[repr(t), b] for t, b in zip(result.memory_times_s, result.memory_bytes, strict=True)],
        "stall": [repr(result.stall_prefetch_s), repr(result.stall_memory_s)],
    })


def compute(cases=CASES, planners=PLANNERS) -> dict[str, dict]:
    hw = Hardware.from_dict(_yaml("hardware", "a100_80gb_pcie4"))
    out: dict[str, dict] = {}
    for model, layers, fraction in cases:
        data = _yaml("model", model)
        if layers is not None:
            data["num_layers"] = layers
        graph = build_graph(ModelConfig.from_dict(data), hw)
        ideal = simulate(graph, keep_all_plan(graph), hw, None)
        budget = int(fraction * ideal.peak_activation_bytes)
        for name in planners:
            key = f"{model}{'' if layers is None else f'@{layers}'}/{fraction}/{name}"
            try:
                plan = get_planner(name, **(_yaml("planner", name)["options"] or {})).plan(graph, hw, budget)
            except InfeasibleBudgetError:
                out[key] = {"infeasible": True}  # the outcome, not the wording of the reason
                continue
            result = simulate(graph, plan, hw, budget)
            out[key] = {
                "plan": plan_fingerprint(plan),
                "simulation": result_fingerprint(result),
                "throughput_ratio": None if result.step_s is None else ideal.step_s / result.step_s,
            }
    out.update(engine_cases(hw))
    return out


def engine_cases(hw: Hardware) -> dict[str, dict]:
    """The simulator on a mixed plan (per layer: swap / recompute / keep in turn) with memory waits,
    a deadlock and two copy engines per direction, which the planners' own plans rarely reach."""
    from dataclasses import replace

    from slackswap.graph import FORWARD_PHASES
    from slackswap.plan import Decision
    from slackswap.schedule.build import build_schedule

    out: dict[str, dict] = {}
    cycle = (Decision.SWAP, Decision.RECOMPUTE, Decision.KEEP)
    two_engines = replace(hw, link=replace(hw.link, d2h_engines=2, h2d_engines=2))
    for model, layers in (("gpt2_xl", 4), ("llama2_70b", 4)):
        graph = build_graph(ModelConfig.from_dict({**_yaml("model", model), "num_layers": layers}), hw)
        decisions, seen = {}, {}
        for t in graph.saved_tensors:
            seen[t.layer] = seen.get(t.layer, -1) + 1
            d = cycle[seen[t.layer] % 3]
            forward = graph.op_by_name[t.producer].phase in FORWARD_PHASES
            decisions[t.name] = Decision.KEEP if d == Decision.RECOMPUTE and not forward else d
        for label, h in (("1x1", hw), ("2x2", two_engines)):
            plan = build_schedule(graph, decisions, planner="mixed", budget_bytes=None, hardware=h)
            peak = simulate(graph, plan, h, None).peak_activation_bytes
            for fraction in (None, 1.0, 0.8, 0.6):
                budget = None if fraction is None else int(fraction * peak)
                result = simulate(graph, plan, h, budget)
                out[f"engine/{model}@{layers}/{label}/{fraction}"] = {
                    "plan": plan_fingerprint(plan), "simulation": result_fingerprint(result),
                    "feasible": result.feasible,
                }
    return out


if __name__ == "__main__":
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {DATA}")
