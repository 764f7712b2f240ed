"""Shared helpers of the runtime tests: capture a workload, plan it, run one step plainly or under a plan."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import Graph, GraphMemo
from slackswap.hardware import Hardware
from slackswap.plan import Plan
from slackswap.planners.registry import get_planner
from slackswap.runtime import apply, capture_graph
from slackswap.runtime.training_workload import Workload, build_training_workload, small_config
from slackswap.simulate.metrics import simulate_ideal

ROOT = Path(__file__).resolve().parents[1]
# Toy tensors on shared CPU cores: a second intra-op thread costs far more than it gains (10x here).
torch.set_num_threads(1)
#: Budgets tried per planner, as fractions of the keep-all peak; None (no limit) last.
FRACTIONS = (0.5, 0.7, 0.9, None)


@functools.cache
def h200() -> Hardware:
    """The H200 preset, read once per process (a `Hardware` is frozen, its mappings read-only)."""
    return Hardware.from_dict(yaml.safe_load((ROOT / "conf/hardware/h200_sxm_pcie5.yaml").read_text()))


@dataclass
class Captured:
    workload: Workload
    graph: Graph
    keep_all_peak_bytes: int
    reference: tuple[torch.Tensor, list[torch.Tensor]]


def capture(kind: str, **shape: int) -> Captured:
    w = build_training_workload(*small_config(kind, **shape))
    graph = capture_graph(w.model, (w.batch,), w.loss_fn, h200(), kind)
    peak = simulate_ideal(graph, h200()).peak_activation_bytes
    loss, grads, _ = run_step(w)
    return Captured(w, graph, peak, (loss, grads))


#: Options the runtime tests give a planner beyond its defaults. milp: its bound as the LP of the reduced
#: model. These tests run the plan, not the bound (tests/test_milp.py checks the bound), and on their
#: small graphs the full-resolution bound costs 2-4 s a plan while the plan it adds loses to slackswap's
#: (notes.milp_plan_source "slackswap": the step would run slackswap's plan twice). With the LP the
#: plan problem's own plan wins on tiny and llama, so the runtime also runs a plan no other planner makes.
RUNTIME_TEST_OPTIONS: dict[str, dict[str, object]] = {"milp": {"exact_max_layers": 0}}


def planner_for_runtime(planner: str, **options: object):
    """`get_planner(planner, ...)` with RUNTIME_TEST_OPTIONS under `options`."""
    return get_planner(planner, **{**RUNTIME_TEST_OPTIONS.get(planner, {}), **options})


#: Each planner's plan per graph, kept with the graph: a test file that runs every planner's plan in
#: several tests (tests/test_runtime_exact.py: twice per model) plans each once. A planner is a pure
#: function of the graph, the hardware and the budget (tests/test_reliability.py checks the same
#: config twice gives the same plan files), and a Plan is frozen, so a shared one cannot leak a change.
_PLANS: GraphMemo[dict[tuple[str, str], tuple[Plan, float | None]]] = GraphMemo(lambda graph: {})


def plan_for(planner: str, captured: Captured, **options: object) -> tuple[Plan, float | None]:
    """The planner's plan (with `options`) at the tightest of FRACTIONS it can meet (planned once per graph)."""
    plans = _PLANS(captured.graph)
    key = (planner, repr(sorted(options.items())))
    if key not in plans:
        plans[key] = _plan_for(planner, captured, **options)
    return plans[key]


def _plan_for(planner: str, captured: Captured, **options: object) -> tuple[Plan, float | None]:
    for fraction in FRACTIONS:
        budget = None if fraction is None else int(captured.keep_all_peak_bytes * fraction)
        try:
            return planner_for_runtime(planner, **options).plan(captured.graph, h200(), budget), fraction
        except InfeasibleBudgetError:
            continue
    raise AssertionError(f"{planner} has no plan even without a budget")


@pytest.fixture
def deterministic_kernels():
    """Bit-exactness is claimed for deterministic kernels; restored afterwards for the other tests.
    A test module opts in with `pytestmark = pytest.mark.usefixtures("deterministic_kernels")`."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture
def one_thread():
    """One intra-op thread while a test measures: the allocator's peak does not depend on the pool."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def step_under(w: Workload, context=None):
    """One step from seed 1 (the dropout stream), plainly or inside `context` (an `apply(...)` run, which
    can be entered once per step, or an export's `installed(...)`); returns (loss, grads)."""
    torch.manual_seed(1)
    for p in w.model.parameters():
        p.grad = None
    with context if context is not None else contextlib.nullcontext():
        loss = w.loss_fn(w.model(w.batch))
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in w.model.parameters() if p.grad is not None]


def run_step(w: Workload, plan: Plan | None = None, graph: Graph | None = None, **options: object):
    """One step from seed 1 (the dropout stream); returns (loss, grads, report or None)."""
    if plan is None:
        return (*step_under(w), None)
    run = apply(plan, graph, w.model, **options)
    loss, grads = step_under(w, run)
    return loss, grads, run.report


def bit_equal(
    reference: tuple[torch.Tensor, list[torch.Tensor]], loss: torch.Tensor, grads: list[torch.Tensor]
) -> bool:
    ref_loss, ref_grads = reference
    return (
        torch.equal(ref_loss, loss)
        and len(ref_grads) == len(grads)
        and all(torch.equal(a, b) for a, b in zip(ref_grads, grads, strict=True))
    )
