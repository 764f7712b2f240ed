"""What did the seed assume? A grid over shared assumptions, evaluated in-process.

The seed's table (three workloads at half their keep-all peak) gives three numbers and no parameters.
One *setting* is one choice of every assumption for all three workloads at once: the attention kernel
(eager / flash), dropout (on / off, where the family has dropout), the matmul and HBM efficiencies
and the host link bandwidth. `evaluate` plans and simulates the three workloads under a setting and
returns the throughput each keeps; `search` screens a coarse full-factorial grid, then refines the
continuous knobs of every discrete combination that came near the table, and `pinned` reports which
knobs and ratios the settings that reproduce the table agree on. Nothing here is tuned per model: a
setting is shared by all three.

Why in-process rather than as a Hydra sweep: a setting is three plan+simulate calls (~1 s on one
core); a sweep pays a job's overhead (config, files, MLflow) per run, several times that, for a grid
of hundreds of settings. `evaluate_grid` spreads settings over joblib workers instead.

Time scales: multiplying the matmul efficiency, the HBM efficiency and the link bandwidth by one
factor scales every op and copy time by its inverse, so the throughput kept changes only through the
fixed per-kernel launch gap and per-copy latency. The table can therefore pin ratios (HBM / matmul,
link / matmul), not absolute speeds; `scale_check` measures how far from exact that is.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from slackswap import validation as check
from slackswap.errors import ConfigError, InfeasibleBudgetError
from slackswap.hardware import Hardware
from slackswap.memory.recipe import TrainingConfig
from slackswap.model_config import ATTENTION_KERNELS, ModelConfig

#: Families whose layers have dropout (llama has none, so the dropout knob leaves it unchanged).
DROPOUT_FAMILIES: tuple[str, ...] = ("bert", "gpt2")
CONTINUOUS: tuple[str, ...] = ("matmul_efficiency", "hbm_efficiency", "link_gbps")


@dataclass(frozen=True)
class Setting:
    """One shared assumption set, applied to every workload alike."""

    attention: str
    dropout: bool
    matmul_efficiency: float
    hbm_efficiency: float
    #: Effective host link bandwidth, each direction (GB/s).
    link_gbps: float

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError("identify.attention", self.attention, f"must be one of {ATTENTION_KERNELS}")
        check.flag("identify.dropout", self.dropout)
        for name in ("matmul_efficiency", "hbm_efficiency"):
            check.fraction(f"identify.{name}", getattr(self, name))
        check.positive("identify.link_gbps", self.link_gbps)

    def model(self, model: ModelConfig) -> ModelConfig:
        dropout = self.dropout if model.family in DROPOUT_FAMILIES else model.dropout
        return replace(model, attention=self.attention, dropout=dropout)

    def hardware(self, hardware: Hardware) -> Hardware:
        link_bps = self.link_gbps * 1e9
        for direction in ("d2h", "h2d"):
            theoretical = getattr(hardware.link, f"{direction}_theoretical_bytes_per_s")
            if link_bps > theoretical:
                raise ConfigError("identify.link_gbps", self.link_gbps,
                                  f"exceeds {hardware.name}'s theoretical {theoretical / 1e9:g} GB/s ({direction})")
        link = replace(hardware.link, d2h_effective_bytes_per_s=link_bps, h2d_effective_bytes_per_s=link_bps)
        efficiency = dict(hardware.efficiency) | {"matmul": self.matmul_efficiency}
        return replace(hardware, efficiency=efficiency, hbm_efficiency=self.hbm_efficiency, link=link)

    def scaled(self, factor: float) -> Setting:
        """Every speed knob times `factor` (the time-scale check)."""
        return replace(self, matmul_efficiency=self.matmul_efficiency * factor,
                       hbm_efficiency=self.hbm_efficiency * factor, link_gbps=self.link_gbps * factor)

    def label(self) -> str:
        return (f"{self.attention}, dropout {'on' if self.dropout else 'off'}, matmul {self.matmul_efficiency:g}, "
                f"HBM {self.hbm_efficiency:g}, link {self.link_gbps:g} GB/s")


@dataclass(frozen=True)
class Problem:
    """What every setting is evaluated against: the workloads, their reference figures, the base
    hardware whose other fields stay, the training recipe, the budget share and the planner."""

    workloads: Mapping[str, ModelConfig]
    reference: Mapping[str, float]
    hardware: Hardware
    training: TrainingConfig = field(default_factory=TrainingConfig)
    budget_fraction: float = 0.5
    planner: str = "slackswap"
    planner_options: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if set(self.workloads) != set(self.reference):
            raise ConfigError("identify.reference", sorted(self.reference),
                              f"must name exactly the workloads {sorted(self.workloads)}")
        check.fraction("identify.budget_fraction", self.budget_fraction)


@dataclass(frozen=True)
class Point:
    setting: Setting
    #: Throughput kept per workload (None: the planner or simulator found the budget infeasible).
    retained: Mapping[str, float | None]
    #: Step times (for the bound gap) per workload, None when infeasible.
    step_s: Mapping[str, float | None]

    def error_pp(self, reference: Mapping[str, float]) -> float:
        """Largest |ours - reference| over the workloads, in percentage points (inf if any infeasible)."""
        if any(v is None for v in self.retained.values()):
            return float("inf")
        return max(abs(self.retained[k] - reference[k]) * 100 for k in reference)


def evaluate(problem: Problem, setting: Setting, planner: str | None = None) -> Point:
    """Plan and simulate every workload under `setting` at the problem's budget share."""
    from slackswap.experiment.fitting import plan_and_simulate
    from slackswap.planners.registry import get_planner

    hardware = setting.hardware(problem.hardware)
    name = planner or problem.planner
    options = problem.planner_options if planner is None else {}
    retained: dict[str, float | None] = {}
    steps: dict[str, float | None] = {}
    for key in problem.workloads:
        graph, ideal = _graph_and_ideal(problem, key, setting)
        budget = int(ideal.peak_activation_bytes * problem.budget_fraction)
        try:
            fitted = plan_and_simulate(get_planner(name, **options), graph, hardware, budget)
        except InfeasibleBudgetError:
            retained[key] = steps[key] = None
            continue
        ok = fitted.result.feasible
        retained[key] = ideal.step_s / fitted.result.step_s if ok else None
        steps[key] = fitted.result.step_s if ok else None
    return Point(setting, retained, steps)


#: (workload, setting without its link) -> (graph, ideal). Op times do not depend on the link and the
#: keep-all ideal makes no copies, so settings that differ only in link bandwidth (the innermost knob
#: of a grid) share both; a few entries are kept, per process.
_GRAPHS: dict[tuple, tuple] = {}
_GRAPHS_KEPT = 8


def _graph_and_ideal(problem: Problem, key: str, setting: Setting) -> tuple:
    from slackswap.profile import build_graph
    from slackswap.simulate.metrics import simulate_ideal

    hardware = setting.hardware(problem.hardware)
    model = setting.model(problem.workloads[key])
    # everything the graph and the ideal depend on: the model, the recipe, the hardware but its link
    cache_key = (model, problem.training, repr(replace(hardware, link=problem.hardware.link)))
    if cache_key not in _GRAPHS:
        graph = build_graph(model, hardware, problem.training)
        if len(_GRAPHS) >= _GRAPHS_KEPT:
            _GRAPHS.pop(next(iter(_GRAPHS)))
        _GRAPHS[cache_key] = (graph, simulate_ideal(graph, hardware))
    return _GRAPHS[cache_key]


def bound_gaps(problem: Problem, point: Point, bound_planner: str = "milp",
               options: Mapping[str, object] | None = None) -> dict[str, float | None]:
    """The planner's step over the best lower bound `bound_planner` certifies, minus one, per workload."""
    from slackswap.experiment.fitting import plan_and_simulate
    from slackswap.planners.registry import get_planner
    from slackswap.profile import build_graph
    from slackswap.simulate.metrics import simulate_ideal

    hardware = point.setting.hardware(problem.hardware)
    gaps: dict[str, float | None] = {}
    for key, model in problem.workloads.items():
        step = point.step_s[key]
        graph = build_graph(point.setting.model(model), hardware, problem.training)
        ideal = simulate_ideal(graph, hardware)
        budget = int(ideal.peak_activation_bytes * problem.budget_fraction)
        try:
            fitted = plan_and_simulate(get_planner(bound_planner, **dict(options or {})), graph, hardware, budget)
        except InfeasibleBudgetError:
            gaps[key] = None
            continue
        bound = fitted.result.bound_step_s
        gaps[key] = None if step is None or bound is None else step / bound - 1.0
    return gaps


def grid(values: Mapping[str, Sequence]) -> list[Setting]:
    """Every combination of the knob values (full factorial), in a fixed order."""
    keys = ("attention", "dropout", *CONTINUOUS)
    missing = [k for k in keys if k not in values]
    if missing:
        raise ConfigError(f"identify.grid.{missing[0]}", None, "is required")
    unknown = sorted(set(values) - set(keys))
    if unknown:
        raise ConfigError("identify.grid", unknown, "unknown knob(s)")
    for k in keys:
        if not values[k]:
            raise ConfigError(f"identify.grid.{k}", list(values[k]), "must list at least one value")
    return [Setting(*combo) for combo in itertools.product(*(values[k] for k in keys))]


def _evaluate_chunk(task: tuple[Problem, tuple[Setting, ...]]) -> list[Point]:
    problem, settings = task
    return [evaluate(problem, s) for s in settings]


#: Called after each evaluated setting with (i from 1, how many, the point): a long grid says how far it is.
OnPoint = Callable[[int, int, Point], None]


def evaluate_grid(problem: Problem, settings: Sequence[Setting], workers: int = 1,
                  on_point: OnPoint | None = None, backend: str | None = "loky") -> list[Point]:
    """`evaluate` for every setting, in order, over `workers` joblib workers of `backend`
    (`slackswap.experiment.parallel_map`: 1 in this process, -1 every core; dask or ray reach a
    cluster); `on_point` after each, in order. The points do not depend on the worker count."""
    from slackswap.experiment.parallel_map import check_n_jobs, ordered_map

    check_n_jobs("identify.workers", workers)
    points: list[Point] = []
    # chunks of consecutive settings: a worker gets the link values of one graph together
    chunks = [tuple(settings[i:i + 4]) for i in range(0, len(settings), 4)]
    for chunk in ordered_map(_evaluate_chunk, ((problem, c) for c in chunks), workers, backend):
        for point in chunk:
            points.append(point)
            if on_point is not None:
                on_point(len(points), len(settings), point)
    return points


@dataclass(frozen=True)
class Search:
    coarse: tuple[Point, ...]
    refined: tuple[Point, ...]
    #: The discrete combinations (attention, dropout) whose coarse best came within `refine_within_pp`.
    refined_combos: tuple[tuple[str, bool], ...]

    @property
    def points(self) -> tuple[Point, ...]:
        return self.coarse + self.refined


def search(problem: Problem, coarse: Mapping[str, Sequence], fine: Mapping[str, Sequence],
           refine_within_pp: float, workers: int = 1,
           on_point: Callable[[str, int, int, Point], None] | None = None) -> Search:
    """Screen the coarse grid; for every (attention, dropout) whose best coarse setting is within
    `refine_within_pp` of the table, evaluate a fine grid centred on that setting: its matmul
    efficiency times each of `fine["matmul_scale"]` (values above 1 dropped), crossed with the fine
    HBM efficiencies and link bandwidths. `on_point(stage, i, n, point)` after each setting, stage
    "coarse" or "refined"."""
    unknown = sorted(set(fine) - {"matmul_scale", "hbm_efficiency", "link_gbps"})
    if unknown:
        raise ConfigError("identify.fine", unknown, "unknown knob(s); known: matmul_scale, hbm_efficiency, link_gbps")
    def stage(name: str) -> OnPoint | None:
        return None if on_point is None else (lambda i, n, point: on_point(name, i, n, point))

    coarse_points = evaluate_grid(problem, grid(coarse), workers, stage("coarse"))
    best: dict[tuple[str, bool], Point] = {}
    for p in coarse_points:
        combo = (p.setting.attention, p.setting.dropout)
        if combo not in best or p.error_pp(problem.reference) < best[combo].error_pp(problem.reference):
            best[combo] = p
    combos = tuple(c for c, p in best.items() if p.error_pp(problem.reference) <= refine_within_pp)
    fine_settings: list[Setting] = []
    for combo in combos:
        centre = best[combo].setting.matmul_efficiency
        matmul = sorted({round(centre * x, 4) for x in fine["matmul_scale"] if 0 < centre * x <= 1})
        fine_settings += grid({"attention": [combo[0]], "dropout": [combo[1]], "matmul_efficiency": matmul,
                               "hbm_efficiency": fine["hbm_efficiency"], "link_gbps": fine["link_gbps"]})
    return Search(tuple(coarse_points), tuple(evaluate_grid(problem, fine_settings, workers, stage("refined"))),
                  combos)


def matches(points: Sequence[Point], reference: Mapping[str, float], tolerance_pp: float) -> list[Point]:
    """The points within `tolerance_pp` of every reference figure, best first."""
    hits = [p for p in points if p.error_pp(reference) <= tolerance_pp]
    return sorted(hits, key=lambda p: p.error_pp(reference))


def pinned(hits: Sequence[Point], searched: Sequence[Point]) -> dict[str, dict[str, object]]:
    """For each knob and ratio: the values the matching settings take against those searched.

    A knob the table pins takes a narrow band (or one value) among the matches while the search
    spanned more; a knob it does not pin spans about as much among the matches as was searched.
    """
    def span(values: list[float]) -> list[float]:
        return [round(min(values), 4), round(max(values), 4)] if values else []

    if not hits:
        return {}
    getters = {
        "attention": lambda s: s.attention,
        "dropout": lambda s: s.dropout,
        "matmul_efficiency": lambda s: s.matmul_efficiency,
        "hbm_efficiency": lambda s: s.hbm_efficiency,
        "link_gbps": lambda s: s.link_gbps,
        "matmul_over_hbm": lambda s: s.matmul_efficiency / s.hbm_efficiency,
        "link_gbps_over_matmul": lambda s: s.link_gbps / s.matmul_efficiency,
    }
    out = {}
    for name, get in getters.items():
        if name in ("attention", "dropout"):
            out[name] = {"matches": sorted({get(p.setting) for p in hits}),
                         "searched": sorted({get(p.setting) for p in searched})}
        else:
            out[name] = {"matches": span([get(p.setting) for p in hits]),
                         "searched": span([get(p.setting) for p in searched])}
    return out


def scale_check(problem: Problem, point: Point, factors: Sequence[float] = (0.8, 1.2)) -> dict[float, float]:
    """The largest change (pp) in any workload's figure when every speed knob is scaled by a factor.
    Small: the table pins ratios, not absolute speeds. Factors that leave a knob's range are skipped."""
    out: dict[float, float] = {}
    for factor in factors:
        s = point.setting
        if s.matmul_efficiency * factor > 1 or s.hbm_efficiency * factor > 1:
            continue
        try:
            scaled = evaluate(problem, s.scaled(factor))
        except ConfigError:  # the link would exceed the theoretical bandwidth
            continue
        if any(v is None for v in scaled.retained.values()) or any(v is None for v in point.retained.values()):
            continue
        out[factor] = max(abs(scaled.retained[k] - point.retained[k]) * 100 for k in point.retained)
    return out
