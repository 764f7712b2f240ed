"""Machinery the strategies share: profile analysis (slack windows, boundaries, regeneration chains),
greedy helpers and the "build, replay, check peak" helper, bisection on the budget, and the
swap-then-recompute base class. No planner is registered here."""
