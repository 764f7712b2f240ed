"""The MILP planner: `model` builds the bound and plan problems, `solve` runs HiGHS, `planner` turns a
solution into a plan (docs/milp.md)."""

from slackswap.planners.milp.planner import MilpPlanner

__all__ = ["MilpPlanner"]
