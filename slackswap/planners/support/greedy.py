"""Shared machinery of the greedy planners: recompute ordering and the budget search over it.

A greedy planner fixes its swapped set, ranks the remaining recompute candidates, then needs the
shortest prefix of that ranking whose schedule fits the budget. `fit_prefix` finds it with the
replay (`slackswap.schedule.replay.estimate_plan`): a galloping search from the byte-count guess, then
bisection. The peak is close to monotone in the prefix length; the search only ever returns a prefix
it has checked to fit, so a non-monotone step can cost optimality but never the budget.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

from slackswap.errors import InfeasibleBudgetError
from slackswap.graph import Graph
from slackswap.hardware import Hardware
from slackswap.plan import Decision, Plan
from slackswap.planners.support.analysis import ProfileAnalysis, SlackLedger
from slackswap.planners.support.budget_check import over_budget, scheduled_peak
from slackswap.planners.support.exact_time import PS_PER_S, op_durations_ps
from slackswap.schedule.build import build_schedule


def recompute_candidates(graph: Graph, analysis: ProfileAnalysis, taken: set[str]) -> list[str]:
    """Saved tensors a greedy planner may recompute: not already taken, not a layer boundary."""
    return [t for t, info in analysis.tensors.items() if t not in taken and not info.boundary]


def order_by_standalone_cost(analysis: ProfileAnalysis, candidates: Sequence[str]) -> list[str]:
    """Cheapest regeneration per byte first; each tensor priced alone (the seed's rule)."""
    infos = analysis.tensors
    return sorted(candidates, key=lambda t: infos[t].regen_s / max(infos[t].size_bytes, 1))


def order_by_marginal_cost(graph: Graph, analysis: ProfileAnalysis, candidates: Sequence[str]) -> list[str]:
    """Cheapest *marginal* regeneration per byte first.

    A tensor's marginal cost is the time of the ops in its recompute chain that no earlier pick
    already re-runs. Chains share ops (q, k and v come from one qkv op; a softmax output and the
    dropout after it share the softmax), so after each pick the candidates whose chains share the
    newly covered ops are re-priced (lazy heap with versions).

    A pick also makes the picked tensor missing, which lengthens the chain of every candidate whose
    chain reads it (`regen_chain` with the larger missing set): by the picked tensor's own chain.
    Those ops are all covered by the pick, so the lengthening never changes a marginal cost, nor
    which ops a later pick newly covers; the chains are therefore not re-walked (on traced graphs,
    where chains run back through unsaved residual tensors across layers, re-walking them after
    every pick made planning quadratic). tests/test_marginal_cost.py checks the order against the
    definition that re-walks them.
    """
    dur_ps = op_durations_ps(graph)
    missing: set[str] = set()
    covered: set[str] = set()
    chain = {t: analysis.tensors[t].regen_ops for t in candidates}
    users: dict[str, set[str]] = {}
    for t, ops in chain.items():
        for o in ops:
            users.setdefault(o, set()).add(t)
    # The time of each candidate's chain ops not yet covered, kept as picks cover ops: re-summing
    # the chain at each re-pricing was O(chain) per affected candidate, and on traced graphs chains
    # through the unsaved residual stream are O(L) long and affect each other (cubic in depth).
    uncovered_ps = {t: sum(dur_ps[o] for o in chain[t]) for t in candidates}
    version = dict.fromkeys(candidates, 0)
    rank = {t: i for i, t in enumerate(candidates)}

    def key(t: str) -> float:
        return uncovered_ps[t] / PS_PER_S / max(analysis.tensors[t].size_bytes, 1)

    heap = [(key(t), rank[t], 0, t) for t in candidates]
    heapq.heapify(heap)
    order: list[str] = []
    while heap:
        _, _, v, t = heapq.heappop(heap)
        if v != version[t] or t in missing:
            continue
        order.append(t)
        missing.add(t)
        new_ops = [o for o in chain[t] if o not in covered]
        covered.update(new_ops)
        affected: set[str] = set()
        for o in new_ops:
            for z in users.get(o, ()):
                uncovered_ps[z] -= dur_ps[o]
                affected.add(z)
        for z in affected - missing:
            version[z] += 1
            heapq.heappush(heap, (key(z), rank[z], version[z], z))
    return order


def fit_prefix(
    graph: Graph,
    hardware: Hardware,
    budget_bytes: int,
    analysis: ProfileAnalysis,
    base: Mapping[str, Decision],
    order: Sequence[str],
    *,
    planner: str,
    prefetch: str = "alap",
    notes: Callable[[int], Mapping[str, object]] | None = None,
    what: str = "",
    hopeless: Callable[[int], bool] | None = None,
) -> Plan | None:
    """The plan recomputing the shortest fitting prefix of `order` on top of `base` decisions.

    Raises InfeasibleBudgetError when even the whole of `order` does not fit (`what` describes the
    plan tried, for the message).

    `hopeless(k)`, if given, is asked whenever the search learns that the prefix it will return is
    at least k long (k = 0 before the first probe, k = x + 1 after a probe of x does not fit: the
    returned prefix is always longer than every non-fitting probe of the final bracket). True stops
    the search and returns None. A caller comparing alternatives passes "a prefix this long cannot
    beat the best plan so far", which spares the probes of a losing alternative (each is a build and a
    replay of the whole schedule) without changing which plan wins.
    """
    cache: dict[int, tuple[Plan, int]] = {}

    def probe(k: int) -> tuple[Plan, int]:
        if k not in cache:
            decisions = dict(base)
            decisions.update(dict.fromkeys(order[:k], Decision.RECOMPUTE))
            cache[k] = scheduled_peak(
                graph,
                decisions,
                planner=planner,
                budget_bytes=budget_bytes,
                hardware=hardware,
                prefetch=prefetch,
                notes=dict(notes(k)) if notes else None,
            )
        return cache[k]

    n = len(order)
    if hopeless is not None and hopeless(0):
        return None

    def infeasible() -> InfeasibleBudgetError:
        return over_budget(planner, budget_bytes, what or "its most frugal plan")

    # Byte-count guess: the first k whose bytes, with what `base` already frees, cover the excess.
    excess = analysis.keep_all_peak_bytes - budget_bytes - sum(
        analysis.tensors[t].size_bytes for t, d in base.items() if d != Decision.KEEP
    )
    freed = 0
    guess = n
    for k, t in enumerate(order):
        if freed >= excess:
            guess = k
            break
        freed += analysis.tensors[t].size_bytes

    def gives_up(failed: int) -> bool:
        """A probe of `failed` did not fit: the answer is longer; is that already hopeless?"""
        return hopeless is not None and hopeless(failed + 1)

    step = max(1, n // 64)
    if probe(guess)[1] <= budget_bytes:
        hi = guess
        lo = guess - step
        while lo >= 0 and probe(lo)[1] <= budget_bytes:
            hi, lo, step = lo, lo - 2 * step, 2 * step
        lo = max(lo, -1)
        if lo >= 0 and gives_up(lo):
            return None
    else:
        if guess == n:
            raise infeasible()
        if gives_up(guess):
            return None
        lo = guess
        hi = min(n, guess + step)
        while probe(hi)[1] > budget_bytes:
            if hi == n:
                raise infeasible()
            if gives_up(hi):
                return None
            lo, hi, step = hi, min(n, hi + 2 * step), 2 * step
    while hi - lo > 1:  # invariant: probe(hi) fits; lo == -1 or probe(lo) does not
        mid = (lo + hi) // 2
        if probe(mid)[1] <= budget_bytes:
            hi = mid
        else:
            if gives_up(mid):
                return None
            lo = mid
    return probe(hi)[0]


def smallest_fitting_count(
    count: int,
    probe: Callable[[int], tuple[Plan, int]],
    budget_bytes: int | None,
    unit_bytes: Sequence[int] | None = None,
) -> Plan | None:
    """The plan of the smallest k in 0..count whose `probe(k)` peak fits the budget.

    `probe(k)` returns (plan, peak bytes) for a strategy applied to its first k units (layers), and
    must be monotone: more units, lower peak. None when even all `count` units do not fit, so the
    caller can say why in its own terms.

    Each probe builds and replays a whole schedule, so plain bisection (log2(count) probes) makes a
    planner grow as L log L. With `unit_bytes` (what each unit frees at best, in order), the search
    starts from the byte-count guess, the first k whose bytes cover the excess of `probe(0)`'s peak,
    and gallops from there (`first_true`): a handful of probes at any depth when the guess is near.
    On a monotone `probe` every search returns the same k.
    """
    if budget_bytes is None or probe(0)[1] <= budget_bytes:
        return probe(0)[0]
    if probe(count)[1] > budget_bytes:
        return None

    def fits(k: int) -> bool:
        return probe(k)[1] <= budget_bytes

    if unit_bytes is None:  # plain bisection
        lo, hi = 0, count
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return probe(hi)[0]
    guess = byte_count_guess(probe(0)[1] - budget_bytes, unit_bytes)
    return probe(first_true(0, count, fits, guess))[0]


def byte_count_guess(excess_bytes: int, unit_bytes: Sequence[int]) -> int:
    """The first k whose first k `unit_bytes` add up to `excess_bytes` (len(unit_bytes) if none)."""
    freed = 0
    for k, size in enumerate(unit_bytes):
        if freed >= excess_bytes:
            return k
        freed += size
    return len(unit_bytes)


def first_true(lo: int, hi: int, holds: Callable[[int], bool], guess: int) -> int:
    """The smallest k in (lo, hi] with `holds(k)`, given `holds(hi)` and (lo == -1 or not `holds(lo)`),
    for a monotone `holds` (False up to some k, True from there). Gallops from `guess` (steps 1, 2,
    4, ... towards the answer), then bisects the last step: O(log |answer - guess|) calls, where
    bisection from (lo, hi] needs log2(hi - lo). Returns only a k it has seen hold."""
    k = min(max(guess, lo + 1), hi)
    step = 1
    if k == hi or holds(k):
        hi = k
        while hi - step > lo:
            if not holds(hi - step):
                lo = hi - step
                break
            hi, step = hi - step, 2 * step
    else:
        lo = k
        while lo + step < hi:
            if holds(lo + step):
                hi = lo + step
                break
            lo, step = lo + step, 2 * step
    while hi - lo > 1:  # invariant: holds(hi); lo == -1 or not holds(lo)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


def take_while_hidden(analysis: ProfileAnalysis, ranked: list[str]) -> list[str]:
    """Walk `ranked`, keeping each tensor whose offload and prefetch still hide (exact ledger)."""
    ledger = SlackLedger(analysis, ranked)
    swaps = []
    for t in ranked:
        if ledger.fits(t):
            ledger.add(t)
            swaps.append(t)
    return swaps


def keep_all_if_it_fits(
    graph: Graph, hardware: Hardware, analysis: ProfileAnalysis, budget_bytes: int | None, planner: str
) -> Plan | None:
    """The keep-everything schedule when the budget does not bind (no budget, or the keep-all peak
    fits), else None: a planner then has nothing to decide."""
    if budget_bytes is not None and analysis.keep_all_peak_bytes > budget_bytes:
        return None
    keep = {t: Decision.KEEP for t in analysis.tensors}
    return build_schedule(graph, keep, planner=planner, budget_bytes=budget_bytes, hardware=hardware)
