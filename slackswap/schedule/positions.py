"""Where a plan acts, step by step: the one record both the simulator and the eager runtime read.

`plan_positions(plan, schedule)` is built once per plan from its resolved schedule (`copies.py`) and
answers, without torch, the questions an executor of the plan asks at each step:

- which transfers are issued after each step (`offloads_at`, `prefetches_at`, per boundary);
- which device copies an executor outside autograd holds (`held_copies`: every copy a plan action
  makes or reads: prefetched and recomputed copies, offloaded run copies, run copies a recompute
  reads) and after which step it lets each go (`release_after`);
- each offload's last prefetch, and so when its host copy is freed;
- the host bytes live over each step, and their peak.

The host-copy rule (docs/decisions/0020-host-copies-go-at-the-last-prefetch.md): an offload's host
copy is taken when the offload is issued and freed when the last prefetch reading it has been issued
(the copy engine keeps what that prefetch reads until it lands); an offload no prefetch reads keeps
its host copy to the step's end. Positions are boundaries: boundary b sits between step b - 1 and
step b (0: before step 0; n: after the last step), so a transfer with `issue_after_step = i` is at
boundary i + 1 and runs during step i + 1. A host copy taken at boundary o and freed at boundary p is
live over steps o to p (the prefetch issued at p still reads it while step p runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from slackswap.plan import Plan, StepKind
from slackswap.schedule.copies import ResolvedSchedule

#: Each offload's pinned buffer starts at a multiple of this in the runtime's slab, so any dtype can
#: view it (`slackswap.runtime.copy_engines.HostPool.reserve`).
HOST_BUFFER_ALIGNMENT_BYTES = 512


@dataclass(frozen=True, eq=False)
class PlanPositions:
    """The positions of a plan's actions (module docstring); every table is indexed as the plan is:
    by step, by boundary, by copy id of the resolved schedule, by index into `plan.offloads` /
    `plan.prefetches`. Each offload's last prefetch and host bytes are made with the record (a pass
    over the transfers, all the simulator reads); every other table on first use (`cached_property`),
    once: the per-step tables cost a pass over the steps and the held copies one over every copy."""

    plan: Plan
    schedule: ResolvedSchedule
    #: Per offload: the index of its last prefetch (the last issued: by boundary, then plan order; -1: none).
    last_prefetch: tuple[int, ...]
    #: Per offload: the bytes of its host copy (the bytes it moves, `ResolvedSchedule.offload_bytes`).
    host_bytes: tuple[int, ...]

    @property
    def n_steps(self) -> int:
        return len(self.plan.steps)

    @cached_property
    def offloads_at(self) -> tuple[tuple[int, ...], ...]:
        """Per boundary b (0 to n_steps): the offloads issued there, in plan order."""
        return _by_boundary(self.plan.offloads, self.n_steps)

    @cached_property
    def prefetches_at(self) -> tuple[tuple[int, ...], ...]:
        """Per boundary b (0 to n_steps): the prefetches issued there, in plan order."""
        return _by_boundary(self.plan.prefetches, self.n_steps)

    @cached_property
    def host_taken_at(self) -> tuple[int, ...]:
        """Per offload: the boundary where its host copy is taken (its issue)."""
        return tuple(tr.issue_after_step + 1 for tr in self.plan.offloads)

    @cached_property
    def host_freed_at(self) -> tuple[int, ...]:
        """Per offload: the boundary where its host copy is freed (its last prefetch's issue; n_steps
        when no prefetch reads it)."""
        prefetches, n = self.plan.prefetches, self.n_steps
        return tuple(n if p < 0 else prefetches[p].issue_after_step + 1 for p in self.last_prefetch)

    @cached_property
    def frees_host(self) -> tuple[bool, ...]:
        """Per prefetch: whether it is its offload's last, after which the host copy goes."""
        frees = [False] * len(self.plan.prefetches)
        for p in self.last_prefetch:
            if p >= 0:
                frees[p] = True
        return tuple(frees)

    @cached_property
    def host_live_bytes(self) -> tuple[int, ...]:
        """Per step j (0 to n_steps; entry n_steps: after the last step): host bytes live while it runs,
        the host copies taken at or before boundary j and freed at or after it."""
        n = self.n_steps
        delta = [0] * (n + 2)
        for nbytes, o, p in zip(self.host_bytes, self.host_taken_at, self.host_freed_at, strict=True):
            delta[o] += nbytes
            delta[p + 1] -= nbytes
        live, running = [], 0
        for d in delta[: n + 1]:
            running += d
            live.append(running)
        return tuple(live)

    @property
    def host_peak_bytes(self) -> int:
        """The most host bytes live over any step: the pinned memory the plan needs per rank."""
        return max(self.host_live_bytes)

    @property
    def pinned_slab_bytes(self) -> int:
        """The pinned host bytes the runtime holds for the plan: one slab with a buffer per offload,
        pinned once and reused every step (`HostPool.reserve`). Host copies fill at most
        `host_peak_bytes` of it at once; a slab packed by lifetime could be that small, but an offload
        into reused bytes would then have to wait for the prefetch that last read them (not built:
        docs/decisions/0020-host-copies-go-at-the-last-prefetch.md)."""
        align = HOST_BUFFER_ALIGNMENT_BYTES
        return sum(-(-nbytes // align) * align for nbytes in self.host_bytes)

    def transfers_after(self, j: int) -> bool:
        """Whether the plan issues a transfer after step j (-1: before step 0)."""
        return bool(self.offloads_at[j + 1] or self.prefetches_at[j + 1])

    @cached_property
    def recompute_steps(self) -> frozenset[int]:
        return frozenset(j for j, s in enumerate(self.plan.steps) if s.kind == StepKind.RECOMPUTE)

    @cached_property
    def run_copy(self) -> dict[str, int]:
        """Per tensor: the id of its run copy (the one its run step makes)."""
        return {t: c for c, (t, source) in enumerate(zip(self.schedule.copy_tensor, self.schedule.copy_source,
                                                         strict=True)) if source == "run"}

    @cached_property
    def _holding(self) -> tuple[frozenset[int], dict[int, tuple[int, ...]]]:
        plan, recompute_steps = self.plan, self.recompute_steps
        held: set[int] = set()
        release_after: dict[int, list[int]] = {}
        for c, copy in enumerate(self.schedule.copies):
            if copy.source == "run" and copy.offload is None and not set(copy.readers) & recompute_steps:
                continue  # autograd holds it as long as anything reads it
            held.add(c)
            produced = copy.source_index
            if copy.source == "prefetch":
                produced = plan.prefetches[copy.source_index].issue_after_step
            # The resolver's facts: its last use (readers, views, the model's hold) and the offloads it
            # waits for (issued by then on the copy engines, which then hold it until they are done).
            last = max([produced, copy.last_use, *(plan.offloads[k].issue_after_step for k in copy.wait_offloads)])
            release_after.setdefault(last, []).append(c)
        return frozenset(held), {j: tuple(cs) for j, cs in release_after.items()}

    @property
    def held_copies(self) -> frozenset[int]:
        """The copies an executor outside autograd holds a reference to (module docstring)."""
        return self._holding[0]

    @property
    def release_after(self) -> dict[int, tuple[int, ...]]:
        """Per step: the held copies let go once it has finished (produced, last use passed, and every
        offload it waits for issued; an engine holds an offload's source until the copy is done)."""
        return self._holding[1]

    @cached_property
    def action_steps(self) -> tuple[int, ...]:
        """The steps at whose end the plan acts (a recompute, a transfer issued after it, a release), in order."""
        return tuple(sorted(self.recompute_steps | set(self.release_after)
                            | {j for j in range(self.n_steps) if self.transfers_after(j)}))


def plan_positions(plan: Plan, schedule: ResolvedSchedule) -> PlanPositions:
    """The positions of `plan`'s actions, from its resolved schedule (`resolve_schedule(graph, plan)`)."""
    last_prefetch = [-1] * len(plan.offloads)
    prefetches, prefetch_offload = plan.prefetches, schedule.prefetch_offload
    for k in sorted(range(len(prefetches)), key=lambda k: prefetches[k].issue_after_step):  # stable
        last_prefetch[prefetch_offload[k]] = k
    return PlanPositions(plan, schedule, tuple(last_prefetch), schedule.offload_bytes)


def _by_boundary(transfers, n: int) -> tuple[tuple[int, ...], ...]:
    at: list[list[int]] = [[] for _ in range(n + 1)]
    for k, tr in enumerate(transfers):
        at[tr.issue_after_step + 1].append(k)
    return tuple(map(tuple, at))
