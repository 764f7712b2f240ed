"""The resolved schedule stores reads flat and writes as id ranges, and derives `step_reads`,
`step_writes`, `copy_readers`, `copy_last_use` and `prefetch_readers` from what the walk recorded.
These tests hold them to an independent walk (the SimPy model's own copy resolution, which shares no
code with slackswap.schedule) and to their definitions on real-program graphs (views, in-place ops,
RNG states)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap.schedule.validate import resolve_schedule
from slackswap.testing import random_graph, random_valid_plan
from tests.simpy_model import resolve as independent_resolve

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _readers(n_copies: int, step_reads) -> list[list[int]]:
    readers: list[list[int]] = [[] for _ in range(n_copies)]
    for j, reads in enumerate(step_reads):
        for c in reads:
            readers[c].append(j)
    return readers


@SETTINGS
@given(rng=st.randoms(use_true_random=False), layers=st.integers(1, 5))
def test_reads_writes_and_readers_match_an_independent_walk(rng, layers):
    graph = random_graph(rng, max_layers=layers)
    plan = random_valid_plan(graph, rng)
    s = resolve_schedule(graph, plan)
    copies, reads, writes, off_copy, pre_copy = independent_resolve(graph, plan)
    assert s.copy_tensor == tuple(c["tensor"] for c in copies)
    assert [list(r) for r in s.step_reads] == reads
    assert [list(w) for w in s.step_writes] == writes
    assert s.offload_copy == tuple(off_copy[k] for k in range(len(plan.offloads)))
    assert s.prefetch_copy == tuple(pre_copy[k] for k in range(len(plan.prefetches)))
    readers = _readers(len(copies), reads)
    assert s.copy_readers == tuple(map(tuple, readers))
    assert s.copy_last_use == tuple(r[-1] if r else -1 for r in readers)
    assert s.prefetch_readers == tuple(tuple(readers[c]) for c in s.prefetch_copy)


@SETTINGS
@given(rng=st.randoms(use_true_random=False), layers=st.integers(1, 4))
def test_flat_fields_agree_with_the_per_step_views_on_real_programs(rng, layers):
    graph = random_graph(rng, max_layers=layers, real_program=True)
    plan = random_valid_plan(graph, rng)
    s = resolve_schedule(graph, plan)
    n_steps = len(plan.steps)
    assert len(s.read_starts) == n_steps + 1 and s.read_starts[0] == 0 and s.read_starts[-1] == len(s.read_copies)
    assert [s.read_copies[a:b] for a, b in zip(s.read_starts, s.read_starts[1:], strict=False)] == list(s.step_reads)
    made_by_steps = []
    for j, writes in enumerate(s.step_writes):
        assert writes == tuple(range(s.write_starts[j], s.write_stops[j]))
        for c in writes:
            assert (s.copy_source[c], s.copy_source_index[c]) in (("run", j), ("recompute", j))
        made_by_steps += writes
    prefetched = [c for c in range(len(s.copy_tensor)) if s.copy_source[c] == "prefetch"]
    assert sorted(made_by_steps + prefetched) == list(range(len(s.copy_tensor)))
    assert sorted(prefetched) == sorted(s.prefetch_copy)
    readers = _readers(len(s.copy_tensor), s.step_reads)
    assert s.copy_readers == tuple(map(tuple, readers))
    assert s.prefetch_readers == tuple(tuple(readers[c]) for c in s.prefetch_copy)
    # Last use: the copy's own last reader, or later through an alias that holds it.
    for c, last in enumerate(s.copy_last_use):
        own = readers[c][-1] if readers[c] else -1
        assert last >= own
        if last > own:
            assert any(s.copy_holds[a] == c and s.copy_last_use[a] == last for a in range(len(s.copy_tensor)))
    # Offloads a copy waits for: its own and those of every alias up the chain that holds it.
    expected: list[set[int]] = [set() for _ in s.copy_tensor]
    for k, c in enumerate(s.offload_copy):
        while c is not None:
            expected[c].add(k)
            c = s.copy_holds[c]
    assert [set(w) for w in s.copy_wait_offloads] == expected
    assert all(len(w) == len(set(w)) for w in s.copy_wait_offloads)
