"""Run a plan for real in a PyTorch training step (imports torch; the core library does not).

    with slackswap.runtime.apply(plan, graph, model):
        loss = loss_fn(model(batch)); loss.backward()

See docs/runtime.md.
"""

from slackswap.runtime.capture import capture_graph
from slackswap.runtime.eager import PlanMismatchError, PlanRun, RunReport, apply, plan_counts

__all__ = ["PlanMismatchError", "PlanRun", "RunReport", "apply", "capture_graph", "plan_counts"]
