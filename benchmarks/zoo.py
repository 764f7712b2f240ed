"""The conformance zoo: every architecture x planner x budget x executor, each cell exact, refused or infeasible.

    PYTHONPATH=. python benchmarks/zoo.py                 # all of `slackswap.runtime.zoo.FACTORIES`
    PYTHONPATH=. python benchmarks/zoo.py --extra         # EXTRA_FACTORIES, to benchmarks/results/zoo_extra.json
    PYTHONPATH=. python benchmarks/zoo.py --models llama t5 --planners full_recompute --fractions 0.7

Per architecture (`slackswap.runtime.zoo`, tiny shapes, CPU, fp32, seeded random weights) the step is
captured once (`capture_graph`), and per planner and budget (a fraction of the keep-all peak) the plan
runs on each executor:
- `runtime`: `apply(plan, graph, model)`; loss, every gradient and every buffer (BatchNorm's running
  statistics) compared bit for bit with a plain step of a copy of the same model from the same RNG
  seed (deterministic kernels);
- `export`: the plan made for the export (`plan_for_export`) through `PlanExport(...).installed(model)`
  (eager selective checkpointing), compared the same way.
A runtime plan equal to one already run on the architecture (same decisions, steps and transfers: the
executor reads nothing else, and the step is seeded and deterministic) takes that run's cell.
A cell is `exact` (`exact: repaired ...` where the planner's plan for the export was repaired to fit,
`slackswap.experiment.export_repair`), `infeasible: <why>` (the planner has no plan within the budget), `refused: <why>`
(the executor declined the plan with its error: `PlanMismatchError`, `InexactRecomputeError`,
`RuntimeUsageError`), `different: <what>` (a gradient, loss or buffer differs), `crash: <error>` or,
for the export, `over budget: <bytes>` (the exact step's measured CPU peak, less the checkpoints' CPU RNG
state and a weight gradient in flight, above the budget; every plan, a swapping one measured on its
second step, when the export's host buffers exist and the CPU allocator sees device bytes only).
The last three are the failures this suite exists to find (issue 39). Per architecture (unless `--no-trace`)
the tracer's saved tensors are compared with what `saved_tensors_hooks` saw on the real step
(`trace_vs_hooks`). The matrix is printed and saved as JSON (`benchmarks/results/zoo.json`, or `--out`).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.common import RESULTS
from slackswap.errors import InfeasibleBudgetError, SlackSwapError
from slackswap.hardware import load_preset
from slackswap.planners.registry import available_planners, get_planner
from slackswap.runtime import apply, capture_graph
from slackswap.runtime.errors import PlanMismatchError
from slackswap.runtime.replay_check import InexactRecomputeError
from slackswap.runtime.training_workload import Workload
from slackswap.runtime.zoo import EXTRA_FACTORIES, FACTORIES, build
from slackswap.simulate.metrics import simulate_ideal

FRACTIONS = (0.3, 0.5, 0.7)
EXECUTORS = ("runtime", "export")
HARDWARE = "a100_80gb_pcie4"
#: Planners run by default: every registered one but the MILP (minutes per graph on a shared CPU; the
#: same candidacy rule wraps it, `--planners milp` runs it).
DEFAULT_PLANNERS = tuple(p for p in available_planners() if p != "milp")
_REFUSALS = (PlanMismatchError, InexactRecomputeError)
#: Characters of a refusal's or infeasibility's reason kept in the saved matrix (printed in full).
REASON_CHARS = 100


def _short(exc: BaseException, limit: int = 240) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}"


def step(w: Workload, model: torch.nn.Module, context=None) -> tuple[torch.Tensor, list, list]:
    """One step of `model` (a copy of `w.model`) from seed 1, plainly or inside `context`: (loss, grads, buffers)."""
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = None
    with context if context is not None else _Null():
        loss = w.loss_fn(model(w.batch))
        loss.backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, [b.clone() for b in model.buffers()]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def compare(reference: tuple, got: tuple) -> str:
    """'exact', or 'different: ...' naming what differs (loss, how many gradients / buffers, max abs diff)."""
    (loss_a, grads_a, bufs_a), (loss_b, grads_b, bufs_b) = reference, got
    bad = []
    if not torch.equal(loss_a, loss_b):
        bad.append(f"loss {float(loss_a):.6g} vs {float(loss_b):.6g}")
    diffs = [(a - b).abs().max().item() if a is not None and b is not None else float("inf")
             for a, b in zip(grads_a, grads_b, strict=True) if not (a is None and b is None)
             and not (a is not None and b is not None and torch.equal(a, b))]
    if diffs:
        bad.append(f"{len(diffs)} of {len(grads_a)} gradients (max abs diff {max(diffs):.3g})")
    buf = sum(not torch.equal(a, b) for a, b in zip(bufs_a, bufs_b, strict=True))
    if buf:
        bad.append(f"{buf} of {len(bufs_a)} buffers")
    return "exact" if not bad else "different: " + "; ".join(bad)


def saved_by_trace(w: Workload, model: torch.nn.Module) -> dict[str, int]:
    """What the torch profile's tracer (`slackswap.profile.torch.tracer.trace_step`, CPU kernels, fp32)
    says autograd saves in one step of `model` (a copy of `w.model`): tensor name -> bytes."""
    from slackswap.profile.torch.tracer import trace_step

    trace = trace_step(model, (w.batch,), w.loss_fn, semantics="cpu", dtype="fp32")
    return {trace.storages[k].name: trace.storages[k].size_bytes for k in trace.saved}


def trace_vs_hooks(traced: dict[str, int], graph) -> str:
    """The traced saved tensors against what `saved_tensors_hooks` saw on the real CPU step (the captured
    graph's saved tensors: `capture_graph` names what its pack hook receives), by name: 'same: <count>
    tensors, <bytes> B', or 'differs: ...' naming each tensor one side lacks and each whose bytes differ.
    A tensor the hooks packed for a node backward never ran (the node died with its output, as a
    router's logits do after argsort) is named as such: the capture frees it with the node, the trace
    holds it to the step's end."""
    hooked = {t.name: t.size_bytes for t in graph.saved_tensors}
    never_read = set(graph.meta.get("packed_never_read", ()))
    head = f"trace {len(traced)} tensors {sum(traced.values())} B, hooks {len(hooked)} tensors {sum(hooked.values())} B"
    parts = []
    only_traced = sorted(set(traced) - set(hooked))
    for why, names in (("packed for a node backward never ran (the capture frees it with the node)",
                        [n for n in only_traced if n in never_read]),
                       ("saved by the trace only", [n for n in only_traced if n not in never_read]),
                       ("seen by the hooks only", sorted(set(hooked) - set(traced)))):
        if names:
            parts.append(f"{why}: {', '.join(f'{n} ({traced.get(n, hooked.get(n))} B)' for n in names)}")
    resized = sorted(n for n in set(traced) & set(hooked) if traced[n] != hooked[n])
    if resized:
        parts.append("bytes differ: " + ", ".join(f"{n} (trace {traced[n]} B, hooks {hooked[n]} B)" for n in resized))
    if not parts:
        return f"same: {len(hooked)} tensors, {sum(hooked.values())} B"
    return f"differs: {head}; " + "; ".join(parts)


def measure_export_peak(plan, graph, pristine: torch.nn.Module, w: Workload, peak_cpu_bytes, export_class
                        ) -> tuple[int, int, int]:
    """One exported step's CPU peak (`Arch.over_budget`): (measured bytes, the checkpoints' CPU RNG state,
    the largest weight gradient). A plan with swaps runs one step first, unmeasured (the host pool)."""
    from slackswap.plan import Decision
    from slackswap.runtime.export_facts import layer_paths

    model = copy.deepcopy(pristine)
    for p in model.parameters():  # weight gradients are model state, not activations (docs/memory.md)
        p.grad = torch.zeros_like(p)

    def one_step() -> None:
        torch.manual_seed(1)
        w.loss_fn(model(w.batch)).backward()

    with export_class(plan, graph, model).installed(model):
        if any(d == Decision.SWAP for d in plan.decisions.values()):
            one_step()  # allocates the host buffers, reused by every later step
        gc.collect()  # an earlier cell's garbage freed inside the window would lower the reading
        measured = peak_cpu_bytes(one_step)
    rng = torch.get_rng_state().numel() * len(layer_paths(model))
    # With .grad allocated, a weight gradient is a transient its backward op makes and accumulation
    # frees: at most the largest parameter's bytes in flight, which the graph counts as model state.
    in_flight = max(p.numel() * p.element_size() for p in model.parameters())
    return measured, rng, in_flight


class Arch:
    """One architecture captured once: its workload, graph, keep-all peak and reference step."""

    def __init__(self, name: str, hardware, measure: bool = True) -> None:
        self.name, self.hardware, self.measure = name, hardware, measure
        self.w = build(name)
        self.pristine = copy.deepcopy(self.w.model)
        self.graph = capture_graph(copy.deepcopy(self.pristine), (self.w.batch,), self.w.loss_fn, hardware, name=name)
        self.peak = simulate_ideal(self.graph, hardware).peak_activation_bytes
        self.reference = step(self.w, copy.deepcopy(self.pristine))
        #: The runtime executor's outcome per plan content (`Plan.schedule_key` and its budget): planners
        #: that agree share a run.
        self._ran: dict[tuple, str] = {}

    def saved(self) -> str:
        """`trace_vs_hooks` of this architecture, or 'crash: trace: <error>' when the tracer fails."""
        try:
            return trace_vs_hooks(saved_by_trace(self.w, copy.deepcopy(self.pristine)), self.graph)
        except Exception as exc:  # noqa: BLE001 - a tracer failure is a result of this suite
            return f"crash: trace: {_short(exc)}"

    def plan(self, planner: str, fraction: float, executor: str):
        budget = max(1, int(self.peak * fraction))
        if executor == "export":
            from slackswap.experiment.export_plan import plan_for_export

            return plan_for_export(get_planner(planner), self.graph, self.pristine, self.hardware, budget)
        return get_planner(planner).plan(self.graph, self.hardware, budget)

    def run(self, plan, executor: str) -> tuple:
        model = copy.deepcopy(self.pristine)
        if executor == "export":
            from slackswap.runtime.export import PlanExport

            return step(self.w, model, PlanExport(plan, self.graph, model).installed(model))
        return step(self.w, model, apply(plan, self.graph, model))

    def over_budget(self, plan, fraction: float) -> str | None:
        """An exported step's measured peak over its budget, in words (None: within it, or not measured).

        The CPU allocator's events (`peak_cpu_bytes`), less the CPU RNG state `checkpoint` keeps per
        layer (host memory on a GPU) and the largest weight gradient (model state, in flight between its
        op and the accumulation into the `.grad` allocated before the window); garbage collected first.
        A plan with swaps is measured on its second step: the first allocates the export's host buffers
        (`HostCopies`, a pool reused across steps: host memory on a GPU), so in the second the allocator
        sees device bytes only, an offloaded tensor absent while it is off the device and its reloaded
        copy present from the reload on, what the runtime's ledger counts."""
        from benchmarks.runtime_overhead_measures import peak_cpu_bytes
        from slackswap.runtime.export import PlanExport

        budget = max(1, int(self.peak * fraction))
        measured, rng, in_flight = measure_export_peak(plan, self.graph, self.pristine, self.w, peak_cpu_bytes,
                                                       PlanExport)
        if measured - rng - in_flight <= budget:
            return None
        return (f"over budget: measured {measured} B, {measured - rng - in_flight} B without the checkpoints' CPU RNG "
                f"state ({rng} B) and a weight gradient in flight ({in_flight} B), > budget {budget} B (priced "
                f"{plan.notes.get('pytorch_peak_bytes')} B)")

    def _run_and_compare(self, plan, executor: str) -> str:
        try:
            got = self.run(plan, executor)
        except _REFUSALS as exc:
            return f"refused: {_short(exc)}"
        except Exception as exc:  # noqa: BLE001 - a crash is a result of this suite, reported as such
            return f"crash: {_short(exc)}"
        return compare(self.reference, got)

    def cell(self, planner: str, fraction: float, executor: str) -> str:
        """The cell of `planner` at `fraction` on `executor`. The runtime executor reads a plan's
        decisions, steps, transfers and graph fingerprint only, and the step is seeded and deterministic:
        a plan equal in those to one already run here (keep_all, swap_only and selective_recompute often
        agree) has that run's outcome, so it is not run again."""
        try:
            plan = self.plan(planner, fraction, executor)
        except InfeasibleBudgetError as exc:
            return f"infeasible: {_short(exc)}"
        except SlackSwapError as exc:
            return f"refused: {_short(exc)}"
        except Exception as exc:  # noqa: BLE001 - a crash is a result of this suite, reported as such
            return f"crash: planning: {_short(exc)}"
        key = (plan.schedule_key(), plan.budget_bytes) if executor == "runtime" else None
        if key in self._ran:
            return self._ran[key]
        result = self._run_and_compare(plan, executor)
        if key is not None:
            self._ran[key] = result
        if result == "exact" and executor == "export" and self.measure:
            result = self.over_budget(plan, fraction) or result
        if result == "exact" and plan.notes.get("export_repaired"):
            moved = plan.notes["export_repaired_tensors"]
            result = (f"exact: repaired for the export, {len(moved)} tensor(s) "
                      f"({plan.notes['export_repaired_bytes']} B) moved to recompute")
        return result


def kind(cell: str) -> str:
    return cell.split(":", 1)[0]


def run(models, planners, fractions, executors, log=print, measure: bool = True, trace: bool = False,
        archs: dict[str, Arch] | None = None) -> dict:
    """The matrix of `models` x `planners` x `fractions` x `executors` (`Arch.cell`), and with `trace`
    each model's traced saved tensors against what the hooks saw (`Arch.saved`, result["saved"]).
    `archs`: architectures already captured, by name, reused (with the runs they remember) and added to."""
    torch.set_num_threads(1)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    hardware = load_preset(HARDWARE)
    rows = []
    saved: dict[str, str] = {}
    try:
        for name in models:
            t0 = time.process_time()
            try:
                arch = (archs or {}).get(name)
                if arch is None or arch.measure != measure:
                    arch = Arch(name, hardware, measure)
                if archs is not None:
                    archs[name] = arch
            except Exception as exc:  # noqa: BLE001
                cell = f"crash: capture: {_short(exc)}"
                rows += [dict(model=name, planner=p, fraction=f, executor=e, cell=cell)
                         for p in planners for f in fractions for e in executors]
                log(f"{name}: {cell}")
                continue
            if trace:
                saved[name] = arch.saved()
                log(f"{name} trace vs hooks: {saved[name]}")
            for p in planners:
                for f in fractions:
                    for e in executors:
                        cell = arch.cell(p, f, e)
                        rows.append(dict(model=name, planner=p, fraction=f, executor=e, cell=cell))
                        if kind(cell) not in ("exact", "infeasible"):
                            log(f"  {name} {p} {f:.0%} {e}: {cell}")
            counts = Counter(kind(r["cell"]) for r in rows if r["model"] == name)
            log(f"{name}: {dict(sorted(counts.items()))} ({time.process_time() - t0:.1f} s CPU)")
    finally:
        torch.use_deterministic_algorithms(deterministic)
    summary = {e: dict(sorted(Counter(kind(r["cell"]) for r in rows if r["executor"] == e).items()))
               for e in executors}
    return {"hardware": HARDWARE, "torch": torch.__version__, "models": list(models), "planners": list(planners),
            "fractions": list(fractions), "executors": list(executors), "summary": summary,
            **({"saved": saved} if trace else {}), "cells": rows}


def _compact(result: dict) -> str:
    """The result as JSON with the cells nested model -> planner -> "<percent> <executor>" -> cell (each
    reason cut to `REASON_CHARS`), one model per line: the file stays small enough to read in a diff."""
    matrix: dict[str, dict[str, dict[str, str]]] = {}
    for r in result["cells"]:
        cell = r["cell"] if len(r["cell"]) <= REASON_CHARS else r["cell"][:REASON_CHARS] + "..."
        matrix.setdefault(r["model"], {}).setdefault(r["planner"], {})[f"{r['fraction']:.0%} {r['executor']}"] = cell
    head = {k: v for k, v in result.items() if k not in ("cells", "saved")}
    lines = [f"  {json.dumps(m)}: {json.dumps(row, separators=(',', ':'))}" for m, row in matrix.items()]
    saved = ""
    if "saved" in result:  # one model per line, in full: the names are the point
        saved = ',\n "trace_vs_hooks": {\n' + ",\n".join(
            f"  {json.dumps(m)}: {json.dumps(v)}" for m, v in result["saved"].items()) + "\n }"
    return json.dumps(head, indent=1)[:-2] + saved + ',\n "matrix": {\n' + ",\n".join(lines) + "\n }\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None,
                        help="default: every architecture of FACTORIES (with --extra: of EXTRA_FACTORIES)")
    parser.add_argument("--extra", action="store_true",
                        help="the architectures run once to check the rules (slackswap.runtime.zoo.EXTRA_FACTORIES); "
                             "the result goes to zoo_extra.json unless --out says otherwise")
    parser.add_argument("--planners", nargs="+", default=list(DEFAULT_PLANNERS))
    parser.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    parser.add_argument("--executors", nargs="+", default=list(EXECUTORS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-trace", dest="trace", action="store_false",
                        help="skip the column comparing the traced saved tensors with what saved_tensors_hooks sees")
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = list(EXTRA_FACTORIES if args.extra else FACTORIES)
    if args.out is None:
        args.out = RESULTS / ("zoo_extra.json" if args.extra else "zoo.json")
    checks = (("--models", args.models, {**FACTORIES, **EXTRA_FACTORIES}),
              ("--planners", args.planners, available_planners()), ("--executors", args.executors, EXECUTORS))
    for field, values, known in checks:
        bad = [v for v in values if v not in known]
        if bad:
            print(f"{field}: {bad[0]!r} unknown; known: {', '.join(known)}", file=sys.stderr)
            return 2
    bad = [f for f in args.fractions if not 0 < f <= 1]
    if bad:
        print(f"--fractions: {bad[0]} is not in (0, 1]", file=sys.stderr)
        return 2
    result = run(args.models, args.planners, args.fractions, args.executors, trace=args.trace)
    print(json.dumps(result["summary"], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(_compact(result))
    print(f"wrote {args.out}")
    failures = sum(kind(r["cell"]) in ("different", "crash", "over budget") for r in result["cells"])
    failures += sum(kind(v) == "crash" for v in result.get("saved", {}).values())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
