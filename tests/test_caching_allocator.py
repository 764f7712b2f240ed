"""The caching-allocator model on hand-worked sequences, and its invariants on random ones.

Every expected number below is worked out from the rules in slackswap/memory/caching_allocator.py
(PyTorch's c10/cuda/CUDACachingAllocator.cpp): 512-byte rounding; <= 1 MiB small pool of 2 MiB
segments; 1-10 MiB requests in 20 MiB segments; >= 10 MiB rounded to 2 MiB; split in the small pool if
>= 512 bytes remain, in the large pool if > 1 MiB remains; best fit; free blocks coalesce.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slackswap.memory.allocator_replay import allocator_report, memory_ops, replay
from slackswap.memory.caching_allocator import CachingAllocator, OutOfMemory, allocation_size, round_size
from slackswap.simulate import simulate
from slackswap.testing import random_graph, random_valid_plan, toy_hardware

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 511, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    assert allocation_size(MiB) == 2 * MiB  # largest small request: a 2 MiB small segment
    assert allocation_size(MiB + 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB  # >= 10 MiB: its own size, rounded to 2 MiB
    assert allocation_size(10 * MiB + 512) == 12 * MiB


def test_small_pool_packs_requests_into_one_2mib_segment_by_splitting():
    a = CachingAllocator()
    x = a.malloc(1)  # 512-byte block at 0; the rest (2 MiB - 512) stays free in the small pool
    y = a.malloc(1000)  # 1024 bytes, cut from that rest: address 512
    assert (x.address, x.size, y.address, y.size) == (0, 512, 512, 1024)
    assert a.reserved_bytes == 2 * MiB and a.allocated_bytes == 1536
    assert a.free_blocks(small=True) == [(1536, 2 * MiB - 1536)]
    assert a.free_blocks(small=False) == []


def test_large_pool_splits_a_20mib_segment_only_when_more_than_1mib_remains():
    a = CachingAllocator()
    b = a.malloc(3 * MiB)  # 20 MiB segment, 17 MiB remain (> 1 MiB): split
    assert (b.size, a.reserved_bytes) == (3 * MiB, 20 * MiB)
    assert a.free_blocks(small=False) == [(3 * MiB, 17 * MiB)]
    c = a.malloc(11 * MiB)  # best fit from the 17 MiB block: 6 MiB remain, split
    assert (c.address, c.size) == (3 * MiB, 11 * MiB)
    d = a.malloc(5 * MiB)  # 6 MiB block, 1 MiB would remain (not > 1 MiB): the whole 6 MiB is handed out
    assert (d.address, d.size, a.allocated_bytes) == (14 * MiB, 6 * MiB, 20 * MiB)
    assert a.reserved_bytes == 20 * MiB  # no new segment


def test_small_and_large_pools_never_lend_to_each_other():
    a = CachingAllocator()
    big = a.malloc(12 * MiB)  # a 12 MiB large segment, no rest
    a.free(big)
    a.malloc(1024)  # small request: the free 12 MiB large block is not used; a new 2 MiB segment is
    assert a.reserved_bytes == 14 * MiB and a.cuda_mallocs == 2


def test_freed_block_is_reused_exactly_without_a_new_segment():
    a = CachingAllocator()
    x = a.malloc(12 * MiB)
    address = x.address
    a.free(x)
    y = a.malloc(12 * MiB)
    assert (y.address, y.size, a.reserved_bytes, a.cuda_mallocs) == (address, 12 * MiB, 12 * MiB, 1)


def test_best_fit_takes_the_smallest_block_that_fits():
    a = CachingAllocator()
    blocks = [a.malloc(4 * MiB) for _ in range(3)]  # one 20 MiB segment: [0,4) [4,8) [8,12), rest [12,20)
    a.free(blocks[0])  # free: [0,4) (4 MiB) and [12,20) (8 MiB)
    z = a.malloc(3 * MiB)  # smallest fit is the 4 MiB block; 1 MiB would remain: handed out whole
    assert (z.address, z.size) == (0, 4 * MiB)


def test_a_fragmenting_sequence_reserves_a_new_segment_and_then_runs_out():
    a = CachingAllocator()
    x, y, z = (a.malloc(4 * MiB) for _ in range(3))  # [0,4) [4,8) [8,12) of one 20 MiB segment
    a.free(x)
    a.free(z)  # z merges with the free tail: free blocks [0,4) and [8,20)
    assert sorted(a.free_blocks(small=False)) == [(0, 4 * MiB), (8 * MiB, 12 * MiB)]
    w = a.malloc(14 * MiB)  # 16 MiB free in total, but no 14 MiB hole: y is live and never moves
    assert (a.reserved_bytes, a.allocated_bytes) == (34 * MiB, 18 * MiB)
    assert w.address == 20 * MiB
    # The same sequence on a device of 33 MiB: the 20 MiB segment is split (y is live), so releasing
    # the cache frees nothing and the 14 MiB request is out of memory with 16 MiB free.
    b = CachingAllocator(capacity_bytes=33 * MiB)
    x, y, z = (b.malloc(4 * MiB) for _ in range(3))
    b.free(x)
    b.free(z)
    with pytest.raises(OutOfMemory):
        b.malloc(14 * MiB)


def test_a_failed_cudamalloc_releases_entirely_free_segments_and_retries():
    a = CachingAllocator(capacity_bytes=20 * MiB)
    a.free(a.malloc(512))  # a 2 MiB small segment, now entirely free
    block = a.malloc(4 * MiB)  # needs a 20 MiB segment: 2 + 20 > 20, so the free small segment goes first
    assert (block.size, a.reserved_bytes, a.cuda_frees) == (4 * MiB, 20 * MiB, 1)


def test_free_coalesces_with_both_neighbours():
    a = CachingAllocator()
    x, y, z = (a.malloc(4 * MiB) for _ in range(3))
    a.free(x)
    a.free(z)
    a.free(y)  # merges with [0,4) before it and [8,20) after it: the whole segment again
    assert a.free_blocks(small=False) == [(0, 20 * MiB)]
    assert a.release_cached_blocks() == 20 * MiB and a.reserved_bytes == 0


SIZES = st.one_of(st.integers(1, 4096), st.integers(1, 2 * MiB), st.integers(MiB, 40 * MiB))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), SIZES, st.integers(0, 1 << 30)), max_size=60))
def test_reserved_covers_allocated_and_blocks_tile_their_segments(calls):
    a = CachingAllocator()
    live = []
    requested = 0
    for is_alloc, size, pick in calls:
        if is_alloc or not live:
            live.append((a.malloc(size), size))
            requested += size
        else:
            block, size = live.pop(pick % len(live))
            a.free(block)
            requested -= size
        assert a.reserved_bytes >= a.allocated_bytes >= requested
        assert a.reserved_bytes == sum(a.segment_size.values())
        for segment, first in a.segments.items():  # blocks tile the segment with no gap or overlap
            total, block, address = 0, first, first.address
            while block is not None:
                assert block.address == address and block.size % 512 == 0
                address += block.size
                total += block.size
                block = block.next
            assert total == a.segment_size[segment]


SCENARIO_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SCENARIO_SETTINGS
@given(st.randoms(use_true_random=False), st.sampled_from([None, 0.5, 0.8, 1.0]))
def test_replay_of_a_simulated_step_matches_the_engine_and_reserved_covers_it(rng: random.Random, fraction):
    graph = random_graph(rng, max_layers=4, max_size_bytes=30 * MiB)
    plan = random_valid_plan(graph, rng)
    hw = toy_hardware(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, latency_s=1e-4)
    free = simulate(graph, plan, hw, None)
    budget = None if fraction is None else int(free.peak_activation_bytes * fraction)
    result = simulate(graph, plan, hw, budget)
    ops = memory_ops(graph, plan, result)
    # The replayed live bytes reach the engine's value at the end of every instant, and its peak.
    engine_at: dict[float, int] = {}
    for t, b in zip(result.memory_times_s, result.memory_bytes, strict=True):
        engine_at[t] = b
    live, replay_at, peak = 0, {}, 0
    allocator = CachingAllocator()
    blocks = {}
    for op in ops:
        if op.alloc:
            live += op.size_bytes
            blocks[op.copy] = allocator.malloc(op.size_bytes)
        else:
            live -= op.size_bytes
            allocator.free(blocks.pop(op.copy))
        replay_at[op.time_s] = live
        peak = max(peak, live)
        assert allocator.reserved_bytes >= allocator.allocated_bytes >= live  # at every instant
    assert peak == result.peak_activation_bytes
    assert all(engine_at[t] == v for t, v in replay_at.items())
    report = allocator_report(graph, plan, result, budget)
    assert report.peak_reserved_bytes >= report.peak_block_bytes >= report.peak_allocated_bytes == peak
    assert 0.0 <= report.fragmentation_share < 1.0 or peak == 0
    if budget is not None and report.peak_reserved_bytes <= budget:
        assert report.fits  # never more than the uncapped run needs
    _, oom, _ = replay(ops, None)
    assert oom is None
