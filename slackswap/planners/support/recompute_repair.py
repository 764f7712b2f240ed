"""Repair a plan an executor prices over its budget by moving decisions to recompute (no torch).

Why: an executor can place a plan's decisions differently from the plan's own schedule. PyTorch's eager
checkpointing recomputes a layer's tensors all at once before its first backward reader and reloads
every offloaded tensor of the layer there at once, so a planner's plan within its budget in its own
schedule can peak over it as PyTorch runs it, at every planning budget the planner can meet (the zoo's
Llama at 70 %: every swapping planner's plan priced 1,189,384 B against a budget of 1,154,412 B while
recomputing every decidable tensor priced 960,008 B). Searching the planner's budget cannot help then;
changing the plan's decisions can. Recompute is the move: it is the decision the executor places
closest to the plan's own schedule (a recompute runs only in its layer's replay, an offloaded copy comes
back whole there and a kept one lives from the forward pass on), and the plan recomputing every decidable
tensor is the one the caller knows fits.

`repair_by_recompute` starts from the planner's plan and moves whole groups (`movable_groups`: the
tensors one executor decision covers together; a saved tensor moves to recompute, a checkpoint
candidate loses its decision, so the recompute chain runs through it) in the caller's order until the
executor's price and the plan's own replay both fit the budget, then restores each moved group, in the
order moved, whose restoration still fits: the planner's own decisions are kept wherever the budget
allows. At most twice the number of groups pricings. The caller names what was moved in the plan's notes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from slackswap.plan import Decision, Plan

#: A plan's price, or None where it does not fit (the executor's peak or the plan's own replay over the budget).
Price = Callable[[Plan], "int | None"]


@dataclass(frozen=True)
class Repaired:
    """A repaired plan: `plan`, its executor price `peak_bytes`, the groups moved to recompute (`moved`,
    in the order moved; restored groups left out) and how many plans were priced (`pricings`)."""

    plan: Plan
    peak_bytes: int
    moved: tuple[tuple[str, ...], ...]
    pricings: int


def movable_groups(decisions: Mapping[str, Decision], saved: Collection[str], frozen: Collection[str],
                   together: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """The groups of `decisions` a repair can move to recompute: each decided tensor, joined with the others
    of any `together` group it is in (one executor decision covers them: an op's outputs cached whole, the
    saved outputs one policy decides); a group with a `frozen` member (kept whatever a plan says, held by the
    executor, or not replayable) is left out, and so is one with nothing to move (every saved member already
    recomputed, no candidate decided). `saved`: the graph's saved tensors (the others are checkpoint
    candidates). Sorted members, groups in the order of their first member's name."""
    parent: dict[str, str] = {}

    def find(t: str) -> str:
        while parent.setdefault(t, t) != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    for group in together:
        for t in group[1:]:
            parent[find(t)] = find(group[0])
    members: dict[str, set[str]] = {}
    for t in decisions:
        members.setdefault(find(t), set()).add(t)
    for group in together:  # a group's undecided members move with it (a candidate of a recomputed op)
        for t in group:
            if find(t) in members:
                members[find(t)].add(t)
    frozen = frozenset(frozen)
    out = []
    for group in members.values():
        if frozen.intersection(group):
            continue
        if any((decisions.get(t) != Decision.RECOMPUTE) if t in saved else (t in decisions) for t in group):
            out.append(tuple(sorted(group)))
    return sorted(out)


def moved_decisions(decisions: Mapping[str, Decision], groups: Sequence[Sequence[str]],
                    saved: Collection[str]) -> dict[str, Decision]:
    """`decisions` with every tensor of `groups` moved: a saved one recomputed, a candidate undecided."""
    out = dict(decisions)
    for group in groups:
        for t in group:
            if t in saved:
                out[t] = Decision.RECOMPUTE
            else:
                out.pop(t, None)
    return out


def repair_by_recompute(plan: Plan, groups: Sequence[tuple[str, ...]], saved: Collection[str],
                        build: Callable[[dict[str, Decision]], Plan], price: Price) -> Repaired | None:
    """`plan` with the fewest of `groups` (tried in the order given) moved to recompute such that `price`
    fits (module docstring); `build(decisions)` makes the plan of a set of decisions (the executor's
    rules applied, the schedule rebuilt). None when even every group moved does not fit."""
    pricings = 0
    moved: list[tuple[str, ...]] = []
    fitted: tuple[Plan, int] | None = None
    for group in groups:
        moved.append(group)
        candidate = build(moved_decisions(plan.decisions, moved, saved))
        pricings += 1
        peak = price(candidate)
        if peak is not None:
            fitted = (candidate, peak)
            break
    if fitted is None:
        return None
    for group in list(moved):  # restore what the fit does not need, largest move first
        rest = [g for g in moved if g != group]
        candidate = build(moved_decisions(plan.decisions, rest, saved))
        pricings += 1
        peak = price(candidate)
        if peak is not None:
            moved, fitted = rest, (candidate, peak)
    return Repaired(fitted[0], fitted[1], tuple(moved), pricings)


__all__ = ["Price", "Repaired", "movable_groups", "moved_decisions", "repair_by_recompute"]
