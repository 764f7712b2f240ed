"""The profile graph of a workload and its ideal (keep-all, no limit) simulation, once per process.

Every planner and budget of one workload shares them: in a sweep with the basic launcher, ten planners
on one model profile it once. The cache is keyed on `RunSpec.workload_key` (the model, hardware,
training and profile nodes as given), not on preset names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from slackswap.experiment.spec import RunSpec
from slackswap.graph import Graph
from slackswap.model_config import ModelConfig
from slackswap.profile.torch.spec import TorchSpec
from slackswap.simulate.result import SimResult


@dataclass(frozen=True)
class Baseline:
    graph: Graph
    ideal: SimResult
    profile_wall_s: float
    ideal_sim_wall_s: float
    #: Traced graphs only: the keep-all peak of the analytic graph of the same shape, for comparison.
    analytic_peak_bytes: int | None = None
    #: Traced graphs only: the analytic graph (profile.csv's formula column).
    analytic_graph: Graph | None = None

    @property
    def keep_all_peak_bytes(self) -> int:
        return int(self.ideal.peak_activation_bytes)


def analytic_twin(model: ModelConfig, spec: TorchSpec) -> ModelConfig:
    """The analytic model of a traced preset's shape: sdpa is a fused kernel (`flash`), eager is eager."""
    return replace(model, attention="flash" if spec.attention == "sdpa" else "eager")


_BASELINES: dict[str, Baseline] = {}


def load_baseline(spec: RunSpec) -> tuple[Baseline, bool]:
    """(baseline, cache_hit) of the spec's workload."""
    cached = _BASELINES.get(spec.workload_key)
    if cached is not None:
        return cached, True
    from slackswap.profile import build_graph
    from slackswap.profile.sources import profile_graph
    from slackswap.simulate.metrics import simulate_ideal

    t0 = time.perf_counter()
    graph = profile_graph(spec.profile_source, spec.model, spec.hardware, spec.training, spec.parallel,
                          **spec.profile_options)
    t1 = time.perf_counter()
    ideal = simulate_ideal(graph, spec.hardware)
    t2 = time.perf_counter()
    if not ideal.feasible:
        raise RuntimeError(f"the keep-all plan with no memory limit is infeasible: {ideal.infeasible_reason}")
    analytic_peak = analytic = None
    if spec.torch_spec is not None and spec.torch_spec.builder not in ("hook", "hf"):
        # The analytic twin has the traced model's shape and attention; a user's hook or hf model is any
        # module, which no analytic graph describes: no comparison rather than a meaningless one.
        analytic = build_graph(analytic_twin(spec.model, spec.torch_spec), spec.hardware, spec.training)
        analytic_peak = int(simulate_ideal(analytic, spec.hardware).peak_activation_bytes)
    base = Baseline(graph, ideal, t1 - t0, t2 - t1, analytic_peak, analytic)
    if spec.workload_key:
        _BASELINES[spec.workload_key] = base
    return base, False


def clear_cache() -> None:
    """Forget every cached baseline (tests that change what a workload key profiles)."""
    _BASELINES.clear()
