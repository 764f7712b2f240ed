"""`milp`: the exact optimum of a joint keep/swap/recompute MILP (HiGHS), and a lower bound on step time.

Two products (docs/milp.md):
- `Plan.bound_step_s`: the optimum (a dual bound) of the bound problem of `milp.model`, every
  constraint of which is a necessary condition of any simulated execution of a valid plan whose run
  steps follow graph order. Exact MILP for models of up to `exact_max_layers` layers; beyond that the
  LP relaxation's optimum (and the MIP dual bound if a time-limited MILP improves on it).
- the plan: the MILP incumbent's decisions turned into a schedule by the shared `build_schedule`.
  The bound problem relaxes memory timing (fractional offload/prefetch progress, coarse windows),
  so its decisions may not fit when scheduled. Then the MILP is re-solved for the PLAN only with the
  budget lowered by the excess the schedule showed (never for the bound), up to `max_repair_rounds`.
"""

from __future__ import annotations

from slackswap import validation as check
from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.base import check_budget, gib
from slackswap.planners.milp.model import GRANULARITIES, MEMORY_ROWS, build_bound_problem
from slackswap.planners.milp.solve import BoundSolution, infeasibility_reason, solve
from slackswap.planners.registry import get_planner, register_planner
from slackswap.schedule.build import build_schedule
from slackswap.schedule.replay import estimate_plan


def _optional_positive_number(field: str, value: object) -> float | None:
    return None if value is None else float(check.positive(field, value))


#: Branch-and-bound node limits of the exact bound MILP and of the plan MILP. They stop HiGHS at the
#: same point on every machine (a wall-clock limit made the tiny preset's result vary from 94.6 % to
#: 97.2 %); see docs/milp.md for what they cost on the presets.
NODE_LIMIT = 500
PLAN_NODE_LIMIT = 5


@register_planner("milp")
class MilpPlanner:
    name = "milp"
    #: An infeasible milp run reports no floor: each bisection probe would be a MILP solve (seconds to
    #: minutes on the presets), about 20 of them (`slackswap.experiment.floor`).
    floor_by_bisection = False

    def __init__(
        self,
        node_limit: int = NODE_LIMIT,
        mip_rel_gap: float = 1e-4,
        granularity: str = "auto",
        op_level_max_ops: int = 80,
        exact_max_layers: int = 8,
        max_repair_rounds: int = 8,
        plan_node_limit: int = PLAN_NODE_LIMIT,
        time_limit_s: float | None = None,
        relaxed_time_limit_s: float | None = None,
        plan_time_limit_s: float | None = None,
        memory_rows: str = "auto",
        transfer_groups: bool | str = "auto",
        layers_per_window: int | str = "auto",
        heuristic_candidates: tuple[str, ...] | list[str] = ("slackswap", "capuchin", "recompute_knapsack"),
        plan_problem_max_layers: int = 8,
        chain_cuts: bool = True,
        candidates: bool = True,
        peak_split: bool | str = "auto",
    ):
        self.node_limit = check.integer("planner.options.node_limit", node_limit, 1)
        self.plan_node_limit = check.integer("planner.options.plan_node_limit", plan_node_limit, 1)
        # Wall-clock caps: off by default, because a cap that binds makes the plan depend on the machine.
        self.time_limit_s = _optional_positive_number("planner.options.time_limit_s", time_limit_s)
        self.mip_rel_gap = float(check.fraction("planner.options.mip_rel_gap", mip_rel_gap, zero=True, one=False))
        if granularity not in ("auto", *GRANULARITIES):
            raise ConfigError("planner.options.granularity", granularity, f"known: {('auto', *GRANULARITIES)}")
        self.granularity = granularity
        self.op_level_max_ops = check.integer("planner.options.op_level_max_ops", op_level_max_ops, 0)
        self.exact_max_layers = check.integer("planner.options.exact_max_layers", exact_max_layers, 0)
        self.max_repair_rounds = check.integer("planner.options.max_repair_rounds", max_repair_rounds, 0)
        self.relaxed_time_limit_s = _optional_positive_number(
            "planner.options.relaxed_time_limit_s", relaxed_time_limit_s
        )
        self.plan_time_limit_s = _optional_positive_number("planner.options.plan_time_limit_s", plan_time_limit_s)
        if memory_rows not in ("auto", *MEMORY_ROWS):
            raise ConfigError("planner.options.memory_rows", memory_rows, f"known: {('auto', *MEMORY_ROWS)}")
        self.memory_rows = memory_rows
        if transfer_groups not in ("auto", True, False):
            raise ConfigError("planner.options.transfer_groups", transfer_groups, "must be auto, true or false")
        self.transfer_groups = transfer_groups
        if layers_per_window != "auto" and (
            isinstance(layers_per_window, bool) or not isinstance(layers_per_window, int) or layers_per_window < 1
        ):
            raise ConfigError("planner.options.layers_per_window", layers_per_window, "must be auto or an integer >= 1")
        self.layers_per_window = layers_per_window
        from slackswap.planners.registry import available_planners

        known = set(available_planners()) - {"milp"}
        bad = [c for c in heuristic_candidates if c not in known]
        if bad or isinstance(heuristic_candidates, str):
            raise ConfigError("planner.options.heuristic_candidates", heuristic_candidates, f"known: {sorted(known)}")
        self.heuristic_candidates = tuple(heuristic_candidates)
        check.flag("planner.options.chain_cuts", chain_cuts)
        self.chain_cuts = chain_cuts
        check.flag("planner.options.candidates", candidates)
        self.candidates = candidates
        if peak_split not in ("auto", True, False):
            raise ConfigError("planner.options.peak_split", peak_split, "must be auto, true or false")
        self.peak_split = peak_split
        self.plan_problem_max_layers = check.integer(
            "planner.options.plan_problem_max_layers", plan_problem_max_layers, 0
        )

    def _exact(self, graph: Graph) -> bool:
        return graph.num_layers <= self.exact_max_layers

    def _model_options(self, graph: Graph) -> dict[str, object]:
        """Model size knobs: everything at full resolution for exact solves, reduced above."""
        exact = self._exact(graph)
        granularity = self.granularity
        if granularity == "auto":
            granularity = "op" if len(graph.ops) <= self.op_level_max_ops else "layer"
        rows = self.memory_rows if self.memory_rows != "auto" else ("all" if exact else "reduced")
        groups = self.transfer_groups if self.transfer_groups != "auto" else not exact
        window = self.layers_per_window
        if window == "auto":
            window = 1 if exact else max(1, -(-graph.num_layers // 16))
        # The split costs the LP little, but slows branch and bound (docs/milp.md): auto = LP only.
        split = self.peak_split if self.peak_split != "auto" else not exact
        return {"granularity": granularity, "memory_rows": rows, "transfer_groups": bool(groups),
                "layers_per_window": window, "peak_split": bool(split)}

    def _granularity_for(self, graph: Graph) -> str:
        return str(self._model_options(graph)["granularity"])

    def _problem(self, graph: Graph, hardware: Hardware, budget_bytes: int, *, plan_rules: bool,
                 chain_cuts: bool | None = None):
        opts = self._model_options(graph)
        return build_bound_problem(
            graph, hardware, budget_bytes, str(opts["granularity"]), memory_rows=str(opts["memory_rows"]),
            transfer_groups=bool(opts["transfer_groups"]), layers_per_window=int(opts["layers_per_window"]),
            plan_rules=plan_rules, chain_cuts=self.chain_cuts if chain_cuts is None else chain_cuts,
            candidates=self.candidates, peak_split=bool(opts["peak_split"]),
        )

    def bound(self, graph: Graph, hardware: Hardware, budget_bytes: int) -> tuple[BoundSolution, str]:
        """Solve the bound problem (exact MILP up to exact_max_layers, else its LP relaxation).

        Raises InfeasibleBudgetError."""
        granularity = self._granularity_for(graph)
        problem = self._problem(graph, hardware, budget_bytes, plan_rules=False)
        reason = infeasibility_reason(problem, budget_bytes, tuple(op.name for op in graph.ops))
        if reason is not None:
            raise InfeasibleBudgetError(reason)
        if self._exact(graph):
            exact = solve(
                problem, integral=True, node_limit=self.node_limit, time_limit_s=self.time_limit_s,
                mip_rel_gap=self.mip_rel_gap,
            )
            if self.chain_cuts and exact.status != "optimal":
                # The cut rows can slow branch and bound past its limit, leaving a weaker dual bound
                # than the model without them reaches. Both are valid: report the larger.
                plain = solve(
                    self._problem(graph, hardware, budget_bytes, plan_rules=False, chain_cuts=False),
                    integral=True, node_limit=self.node_limit, time_limit_s=self.time_limit_s,
                    mip_rel_gap=self.mip_rel_gap,
                )
                if plain.bound_step_s > exact.bound_step_s:
                    return plain, granularity
            return exact, granularity
        relaxed = solve(problem, integral=False, time_limit_s=self.relaxed_time_limit_s, mip_rel_gap=self.mip_rel_gap)
        return relaxed, granularity

    def _plan_decisions(self, graph: Graph, hardware: Hardware, plan_budget: int) -> dict[str, Decision] | None:
        """Decisions from the PLAN problem (build_schedule's memory rules; not a bound)."""
        problem = self._problem(graph, hardware, plan_budget, plan_rules=True)
        if max(problem.floor_bytes) > plan_budget:
            return None
        try:
            solution = solve(
                problem, integral=True, node_limit=self.plan_node_limit, time_limit_s=self.plan_time_limit_s,
                mip_rel_gap=self.mip_rel_gap,
            )
        except InfeasibleBudgetError:
            return None
        return dict(solution.decisions) if solution.decisions is not None else None

    def plan(self, graph: Graph, hardware: Hardware, budget_bytes: int | None) -> Plan:
        check_budget(budget_bytes)
        if budget_bytes is None:
            keep = {t.name: Decision.KEEP for t in graph.saved_tensors}
            return build_schedule(
                graph, keep, planner=self.name, budget_bytes=None, hardware=hardware,
                bound_step_s=sum(op.duration_s for op in graph.ops),
                notes={"milp_mode": "no_budget", "milp_bound_basis": "serial compute stream"},
            )
        solution, granularity = self.bound(graph, hardware, budget_bytes)
        opts = self._model_options(graph)
        notes: dict[str, object] = {
            "milp_mode": solution.mode,
            "milp_status": solution.status,
            "milp_mip_gap": solution.mip_gap,
            # Node counts, not seconds: plan.json is the same file on every machine.
            "milp_nodes": solution.nodes,
            "milp_granularity": granularity,
            "milp_memory_rows": opts["memory_rows"],
            "milp_transfer_groups": opts["transfer_groups"],
            "milp_layers_per_window": opts["layers_per_window"],
            "milp_chain_cuts": self.chain_cuts,
            "milp_candidates": self.candidates,
            "milp_peak_split": opts["peak_split"],
            "milp_bound_step_s": solution.bound_step_s,
            "milp_model_step_s": solution.incumbent_step_s,
        }
        candidates: list[tuple[float, Plan, str]] = []
        repair_note = "no plan-problem solution"
        if graph.num_layers <= self.plan_problem_max_layers:
            decisions = self._plan_decisions(graph, hardware, budget_bytes)
        else:
            decisions = None
            repair_note = f"not solved: {graph.num_layers} layers > plan_problem_max_layers"
        plan_budget = budget_bytes
        peak = None
        for round_ in range(self.max_repair_rounds + 1):
            if decisions is None:
                break
            plan = build_schedule(graph, decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware)
            est = estimate_plan(graph, plan, hardware)
            peak = est.peak_bytes
            if peak <= budget_bytes:
                candidates.append((est.step_s, plan, "milp_plan_problem"))
                repair_note = f"fits after {round_} repair round(s) at plan budget {plan_budget}"
                notes.update(milp_repair_rounds=round_, milp_plan_budget_bytes=plan_budget)
                break
            repair_note = f"peaks at {gib(peak)} > budget after {round_} repair round(s)"
            # Plan-only re-solve with the excess taken off the budget; the bound is not touched.
            plan_budget = plan_budget - (peak - budget_bytes)
            decisions = self._plan_decisions(graph, hardware, plan_budget)
        if solution.decisions is not None:
            # The bound problem's own incumbent (exact mode), scheduled as is: a candidate, no repair.
            incumbent = build_schedule(graph, solution.decisions, planner=self.name, budget_bytes=budget_bytes,
                                       hardware=hardware)
            est = estimate_plan(graph, incumbent, hardware)
            if est.peak_bytes <= budget_bytes:
                candidates.append((est.step_s, incumbent, "milp_bound_incumbent"))
        for name in self.heuristic_candidates:
            try:
                heuristic = get_planner(name).plan(graph, hardware, budget_bytes)
            except InfeasibleBudgetError:
                continue
            est = estimate_plan(graph, heuristic, hardware)
            if est.peak_bytes <= budget_bytes:
                candidates.append((est.step_s, heuristic, name))
        notes["milp_plan_problem"] = repair_note
        if not candidates:
            raise InfeasibleBudgetError(
                f"milp: no plan fits: the plan problem's decisions, scheduled by build_schedule, {repair_note} "
                f"(budget {gib(budget_bytes)}; lower bound {solution.bound_step_s:.6f} s still holds); "
                f"heuristic candidates {list(self.heuristic_candidates)} infeasible too"
            )
        step_s, best, source = min(candidates, key=lambda c: c[0])
        notes["milp_plan_source"] = source
        notes["milp_candidates_est_step_s"] = {s: round(t, 9) for t, _, s in candidates}
        return build_schedule(
            graph, best.decisions, planner=self.name, budget_bytes=budget_bytes, hardware=hardware,
            bound_step_s=solution.bound_step_s, notes=notes,
        )
