"""Which saved tensors a recompute cannot yield at the version autograd saved: one rule, every planner.

A recompute step replays its op's calls (the producer and the in-place calls that join it, with the
RNG state it ran with: `slackswap.runtime.op_numbering`). A tensor that a *later* op writes in place
(`scores = q @ k.T; scores /= 4.0`, T5's `relative_buckets += ...`, Mixtral's `inv_perm =
torch.empty_like(perm); inv_perm[perm] = arange(...)`) is not what that replay makes: the replay
stops at the producer's version (or at uninitialised memory). A captured graph records those writes
in its meta (`slackswap.runtime.capture`, `REWRITTEN_KEY`: tensor -> [writing op, model line]) and
the ops that write module state a replay must not write again (`STATE_KEY`: op -> [what, line]).

`replay_rule(graph)` derives from them, for a forward op P reading a forward tensor u:
- u written in place by an op after P: P read an older version than any copy of u later holds;
- u written in place before P and u not saved: a recompute chain regenerates u without the write;
- u itself not replayable and not saved (a chain through it): the same.
P's outputs are then not replayable, and so are the rewritten tensors and the outputs of an op that
writes module state. Not replayable saved tensors are fixed to keep (`fixed`, with the reason:
a swap is no better, its offload is issued after the producer, before the write); rewritten
checkpoint candidates get no decision (`not_kept`: a swapped one would be the old version too).
A constant made from Python data inside forward (an op whose role is in `PYTHON_CONSTANT_OPS`:
Falcon's index tensors of `fused_qkv[..., [-2], :]`) is not replayable either: its replay returns the
very tensor the recompute was to free, so the run copy would outlive the plan's release of it.
A saved tensor that is rewritten before every reader keeps exactly (its run copy is the storage
autograd saved). The runtime checks the result on its verified step with autograd's version
counters (`slackswap.runtime.replay_check`), so a case the rule misses is refused, not silent.

`ruled_plan` wraps every registered planner's `plan` (`slackswap.planners.registry`): on a graph
with no such tensor (every analytic and traced graph) it is the planner's plan unchanged; else the
planner plans with those tensors fixed to keep (`slackswap.planners.support.fixed_keep`), and the
plan's notes name each one with its reason (`not_recomputable`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from slackswap.graph import FORWARD_PHASES, PYTHON_CONSTANT_OPS, REWRITTEN_KEY, STATE_KEY, Graph, GraphMemo


@dataclass(frozen=True)
class ReplayRule:
    #: Saved tensors fixed to keep -> why a recompute cannot yield them.
    fixed: Mapping[str, str]
    #: Rewritten checkpoint candidates: no plan decision (a swap would copy the old version).
    not_kept: frozenset[str]


def _build_rule(graph: Graph) -> ReplayRule:
    rewritten: Mapping[str, list] = graph.meta.get(REWRITTEN_KEY) or {}
    state: Mapping[str, list] = graph.meta.get(STATE_KEY) or {}
    tensors, ops = graph.tensors, graph.op_by_name
    constants = {t: f"a constant made from Python data in forward ({ops[tensors[t].producer].role}): a replay "
                    "returns the very tensor it would free" for t in (x.name for x in graph.saved_tensors)
                 if ops[tensors[t].producer].role in PYTHON_CONSTANT_OPS}
    if not rewritten and not state:
        return ReplayRule(constants, frozenset())
    index = graph.op_index
    why: dict[str, str] = {t: f"op {w[0]!r} ({w[1]}) writes it in place after its producer"
                           for t, w in rewritten.items() if t in tensors}
    why.update(constants)
    for op_name, (what, line) in state.items():
        for t in ops[op_name].outputs if op_name in ops else ():
            why.setdefault(t, f"its op {op_name!r} ({line}) writes module state {what} a replay would write again")
    for op in graph.ops:
        if op.phase not in FORWARD_PHASES:
            continue
        for u in op.inputs:
            if tensors[u].producer == op.name:
                continue
            writer = rewritten.get(u)
            reason = None
            if writer is not None and index[writer[0]] > index[op.name]:
                reason = f"it reads {u!r} before op {writer[0]!r} ({writer[1]}) overwrites it"
            elif u in why and not tensors[u].saved:
                reason = f"it reads {u!r}, which a recompute cannot regenerate ({why[u]})"
            if reason is not None:
                for t in op.outputs:
                    why.setdefault(t, reason)
                break
    fixed = {t: r for t, r in why.items() if tensors[t].saved and ops[tensors[t].producer].phase in FORWARD_PHASES}
    return ReplayRule(fixed, frozenset(t for t in rewritten if t in graph.candidate_names))


#: The rule of one graph, computed once.
replay_rule: GraphMemo[ReplayRule] = GraphMemo(_build_rule)


class _Unruled:
    """The planner with its own `plan` (not the ruled one): what `plan_with_fixed_keep` runs."""

    def __init__(self, planner: object, plan: Callable) -> None:
        self.name, self._planner, self._plan = planner.name, planner, plan

    def plan(self, graph: Graph, hardware: object, budget_bytes: int | None):
        return self._plan(self._planner, graph, hardware, budget_bytes)


def ruled_plan(plan: Callable) -> Callable:
    """`plan` (a planner class's method) under the replay rule (module docstring)."""
    if getattr(plan, "replay_ruled", False):
        return plan

    @functools.wraps(plan)
    def ruled(self, graph: Graph, hardware, budget_bytes):
        rule = replay_rule(graph)
        if not rule.fixed and not rule.not_kept:
            return plan(self, graph, hardware, budget_bytes)
        from slackswap.planners.support.fixed_keep import plan_with_fixed_keep

        out = plan_with_fixed_keep(_Unruled(self, plan), graph, hardware, budget_bytes, rule.fixed,
                                   not_kept=rule.not_kept)
        return replace(out, notes={**dict(out.notes), "not_recomputable": dict(sorted(rule.fixed.items()))})

    ruled.replay_ruled = True
    return ruled


__all__ = ["REWRITTEN_KEY", "STATE_KEY", "ReplayRule", "replay_rule", "ruled_plan"]
