"""The shared-assumption grid's inputs, typed and checked before any work, and the whole study run
from them: the search, the matches, the bound planner's gaps at the best settings, what the matches
pin down and the time-scale check (`slackswap.experiment.identify` has each step).

`IdentifySpec.from_dict(config)` takes plain mappings: the `identify` node of `+experiment=seed_identify`
(the workloads, their reference figures, the knobs' coarse and fine values, the tolerances) beside the
`hardware`, `node` and `training` nodes of the run. Every bad value raises one `ConfigError` naming its
dotted field (`identify.fine.matmul_scale`) and the value, before the grid's minutes of planning.
`run_study(spec, progress)` then runs it; a caller prints from `IdentifyProgress` and writes the outcome.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slackswap import validation as check
from slackswap.errors import ConfigError
from slackswap.experiment import identify
from slackswap.experiment.identify import Point, Problem, Search

#: The knobs of the fine grid: factors on the matmul efficiency of a combination's best coarse
#: setting, and the HBM efficiencies and link bandwidths crossed with them.
FINE_KNOBS = ("matmul_scale", "hbm_efficiency", "link_gbps")


def _mapping(field_name: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(field_name, value, "must be a mapping (a config node)")
    return value


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def problem_from(config: Mapping[str, Any]) -> Problem:
    """The workloads, their reference figures, the hardware (on the run's node: the per-rank link),
    the training recipe, the budget share and the planner every setting is evaluated against."""
    from slackswap.experiment.spec import hardware_from_config
    from slackswap.memory.recipe import TrainingConfig
    from slackswap.model_config import ModelConfig

    node = _mapping("identify", config.get("identify"))
    models = node.get("models")
    if not models:
        raise ConfigError("identify.models", models if models is not None else {}, "names no workload")
    _mapping("identify.models", models)
    workloads = {}
    for key, model in models.items():
        model = dict(_mapping(f"identify.models.{key}", model))
        if model.pop("torch", None) is not None:
            raise ConfigError(f"identify.models.{key}.torch", "...", "the grid runs on analytic graphs only")
        workloads[key] = ModelConfig.from_dict(model)
    reference = _mapping("identify.reference", node.get("reference"))
    for key, value in reference.items():
        check.fraction(f"identify.reference.{key}", value, why="the throughput a workload keeps")
    hardware, _, _ = hardware_from_config(config)
    return Problem(
        workloads=workloads,
        reference=dict(reference),
        hardware=hardware,
        training=TrainingConfig.from_dict(config.get("training") or {}),
        budget_fraction=node.get("budget_fraction"),
        planner=node.get("planner"),
    )


@dataclass(frozen=True)
class IdentifySpec:
    """The problem and the knobs of one study."""

    problem: Problem
    #: Knob -> values of the coarse full-factorial grid (`identify.grid`).
    coarse: Mapping[str, Sequence[Any]]
    #: `FINE_KNOBS` -> values refined around each combination's best coarse setting (`identify.search`).
    fine: Mapping[str, Sequence[Any]]
    #: A setting matches when every figure is within this many percentage points.
    tolerance_pp: float = 0.3
    #: A discrete combination is refined when its best coarse setting is within this.
    refine_within_pp: float = 1.5
    workers: int = 1
    #: The planner whose certified bound gives the gap at the best settings, and at how many of them.
    bound_planner: str = "milp"
    bound_points: int = 3
    #: Each knob's plausible range and where it comes from (text, printed with the result).
    ranges: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> IdentifySpec:
        """Every knob value, before any work: building the grids constructs (validates) every setting,
        so a link above the theoretical bandwidth names `identify.link_gbps` here."""
        from slackswap.planners.registry import get_planner

        problem = problem_from(config)
        node = config["identify"]
        tolerance_pp = check.positive("identify.tolerance_pp", node.get("tolerance_pp"))
        refine_within_pp = check.positive("identify.refine_within_pp", node.get("refine_within_pp"))
        from slackswap.experiment.parallel_map import check_n_jobs

        workers = check_n_jobs("identify.workers", node.get("workers"))
        bound_points = check.integer("identify.bound_points", node.get("bound_points"), 0)
        coarse = dict(_mapping("identify.coarse", node.get("coarse")))
        for s in identify.grid(coarse):
            s.hardware(problem.hardware)  # a link above the theoretical bandwidth names identify.link_gbps
        fine = dict(_mapping("identify.fine", node.get("fine")))
        unknown = sorted(set(fine) - set(FINE_KNOBS))
        if unknown:
            raise ConfigError("identify.fine", unknown, f"unknown knob(s); known: {', '.join(FINE_KNOBS)}")
        scales = fine.get("matmul_scale")
        if not isinstance(scales, (list, tuple)) or not scales or not all(_positive(x) for x in scales):
            raise ConfigError("identify.fine.matmul_scale", scales, "must list positive factors")
        knobs = {k: v for k, v in fine.items() if k != "matmul_scale"}
        for s in identify.grid({"attention": ["eager"], "dropout": [False], "matmul_efficiency": [0.5], **knobs}):
            s.hardware(problem.hardware)
        get_planner(problem.planner)
        bound_planner = node.get("bound_planner")
        get_planner(bound_planner)
        ranges = node.get("ranges") or {}
        return cls(problem, coarse, fine, tolerance_pp, refine_within_pp, workers, bound_planner, bound_points,
                   dict(_mapping("identify.ranges", ranges)))


class IdentifyProgress:
    """What a study reports as it goes, one method per moment; here each does nothing. The pipeline
    overrides them to print its console lines (a seed grid is minutes of planning)."""

    def point(self, stage: str, i: int, n: int, point: Point) -> None:
        """Setting i of n of a stage ("coarse" or "refined") is evaluated."""

    def bound(self, i: int, n: int, point: Point, planner: str) -> None:
        """The bound planner is about to run at the i-th best setting of n."""

    def scale_check(self, point: Point) -> None:
        """The time-scale check is about to run at the best setting."""


@dataclass(frozen=True)
class IdentifyOutcome:
    search: Search
    #: The settings within `tolerance_pp` of every figure, best first.
    hits: tuple[Point, ...]
    #: The best settings (the matches, or the closest when none matches) with the bound planner's gap
    #: per workload (the planner's step over the certified bound, minus one; None where infeasible).
    best: tuple[tuple[Point, Mapping[str, float | None]], ...]
    #: Per knob and ratio: the values the matches take against those searched (`identify.pinned`).
    pins: Mapping[str, Any]
    #: Factor -> the largest change (pp) of any figure when every speed knob is scaled by it.
    scale: Mapping[float, float]
    #: The best error over every setting (pp), None when nothing was evaluated.
    best_error_pp: float | None
    wall_s: float


def run_study(spec: IdentifySpec, progress: IdentifyProgress | None = None) -> IdentifyOutcome:
    """Search the grid, rank, bound the best settings, pin the knobs and check the time scale."""
    say = progress or IdentifyProgress()
    t0 = time.perf_counter()
    problem = spec.problem
    ref = problem.reference
    result = identify.search(problem, spec.coarse, spec.fine, spec.refine_within_pp, spec.workers,
                             on_point=say.point)
    hits = identify.matches(result.points, ref, spec.tolerance_pp)
    ranked = hits or sorted(result.points, key=lambda p: p.error_pp(ref))
    chosen = ranked[: spec.bound_points]
    best = []
    for i, p in enumerate(chosen, start=1):
        say.bound(i, len(chosen), p, spec.bound_planner)
        best.append((p, identify.bound_gaps(problem, p, spec.bound_planner)))
    pins = identify.pinned(hits, result.points)
    scale: dict[float, float] = {}
    if ranked:
        say.scale_check(ranked[0])
        scale = identify.scale_check(problem, ranked[0])
    return IdentifyOutcome(result, tuple(hits), tuple(best), pins, scale,
                           ranked[0].error_pp(ref) if ranked else None, time.perf_counter() - t0)
