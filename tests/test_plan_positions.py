"""The plan-positions record (`slackswap.schedule.positions`) and the host memory read from it: exact
host bytes per step on hand-worked plans, the simulator's host peak on the same plans worked out in
time, and the eager runtime measuring what the record says on a small torch model.

Hand-worked graph (tests/test_simulate_hand.py's three layers): F1 -> a -> F2 -> b -> F3 -> c;
backward B3, B2 (reads b), B1 (reads a). Steps 0-5 are F1 F2 F3 B3 B2 B1; boundary b is before step b.
Link 100 B/s per direction, so a 100-byte copy takes 1 s."""

from __future__ import annotations

from dataclasses import replace

from slackswap.node import Node, pinned_reason
from slackswap.plan import Decision, Direction, Plan, Transfer
from slackswap.schedule.positions import plan_positions
from slackswap.schedule.validate import resolve_schedule
from slackswap.simulate import simulate
from slackswap.testing import toy_hardware
from tests.extras import require_torch_extra
from tests.test_simulate_hand import run_steps, three_layer_graph

HW = toy_hardware()


def _swap(graph, offloads: dict[str, int], prefetches: dict[str, int]) -> Plan:
    decisions = {t.name: Decision.KEEP for t in graph.saved_tensors} | {t: Decision.SWAP for t in offloads}
    return Plan(
        planner="hand", budget_bytes=None, decisions=decisions, steps=run_steps(graph),
        offloads=tuple(Transfer(t, Direction.D2H, i) for t, i in offloads.items()),
        prefetches=tuple(Transfer(t, Direction.H2D, i) for t, i in sorted(prefetches.items(), key=lambda x: x[1])),
    )


def test_two_swaps_hold_their_host_copies_from_offload_to_last_prefetch_step_by_step() -> None:
    # a (100 B): offload after step 0 (boundary 1), prefetch after step 3 (boundary 4): live steps 1-4.
    # b (200 B): offload after step 1 (boundary 2), prefetch after step 2 (boundary 3): live steps 2-3.
    g = three_layer_graph(a=100, b=200)
    plan = _swap(g, {"a": 0, "b": 1}, {"b": 2, "a": 3})
    p = plan_positions(plan, resolve_schedule(g, plan))
    assert p.offloads_at == ((), (0,), (1,), (), (), (), ())
    assert p.prefetches_at == ((), (), (), (0,), (1,), (), ())
    assert p.last_prefetch == (1, 0) and p.frees_host == (True, True)
    assert (p.host_taken_at, p.host_freed_at, p.host_bytes) == ((1, 2), (4, 3), (100, 200))
    assert p.host_live_bytes == (0, 100, 300, 300, 100, 0, 0)
    assert p.host_peak_bytes == 300
    # The device copies the runtime holds: a and b's run copies (offloaded) and their prefetched copies.
    s = resolve_schedule(g, plan)
    assert {s.copy_tensor[c] + "/" + s.copy_source[c] for c in p.held_copies} == {
        "a/run", "b/run", "a/prefetch", "b/prefetch"}
    # a's run copy goes after step 1 (F2 reads it; its offload issued after step 0), b's after step 2.
    released = {s.copy_tensor[c] + "/" + s.copy_source[c]: j for j, cs in p.release_after.items() for c in cs}
    assert released == {"a/run": 1, "b/run": 2, "b/prefetch": 4, "a/prefetch": 5}
    assert not plan.idle and p.action_steps == (0, 1, 2, 3, 4, 5)


def test_the_simulator_holds_host_copies_from_offload_start_to_the_freeing_prefetchs_end() -> None:
    # F1 [0,1], F2 [1,2], F3 [2,6], B3 [6,7]; d2h a [1,2], b [2,4]; h2d b [6,8] (issued after F3),
    # B2 waits for it: [8,9]; h2d a issued after B3 (7) waits for the engine: [8,9]; B1 [9,10].
    # Host: a [1,9], b [2,8]: 300 B at once over [2,8].
    g = three_layer_graph(a=100, b=200, f3_s=4.0)
    r = simulate(g, _swap(g, {"a": 0, "b": 1}, {"b": 2, "a": 3}), HW, None)
    assert r.step_s == 10.0 and r.host_peak_bytes == 300 and r.d2h_bytes == 300


def test_a_late_prefetch_holds_its_host_copy_until_it_lands() -> None:
    # a alone (400 B): d2h [1,5]; its prefetch, issued after step 2 (F3 ends at 2.5), waits for the
    # offload: h2d [5,9]. Host copy live [1,9] in time; in steps, taken at boundary 1 and freed at
    # boundary 3: live over steps 1-3.
    g = three_layer_graph(a=400, f3_s=0.5)
    plan = _swap(g, {"a": 0}, {"a": 2})
    r = simulate(g, plan, HW, None)
    p = plan_positions(plan, resolve_schedule(g, plan))
    assert r.stream_events("h2d")[0].end_s == 9.0 and r.host_peak_bytes == 400
    assert p.host_live_bytes == (0, 400, 400, 400, 0, 0, 0)


def test_keep_all_holds_no_host_bytes_and_is_idle() -> None:
    g = three_layer_graph()
    plan = _swap(g, {}, {})
    p = plan_positions(plan, resolve_schedule(g, plan))
    assert plan.idle and p.host_peak_bytes == 0 and p.held_copies == frozenset()
    assert simulate(g, plan, HW, None).host_peak_bytes == 0


def test_the_nodes_pinned_check_reads_the_runtimes_slab() -> None:
    # The runtime pins a 512-byte-aligned buffer per offload: 512 + 512 B, though at most 300 B of host
    # copies are live at once. Two ranks: 2048 B fit, 2047 B do not.
    g = three_layer_graph(a=100, b=200, f3_s=4.0)
    r = simulate(g, _swap(g, {"a": 0, "b": 1}, {"b": 2, "a": 3}), HW, None)
    assert r.host_peak_bytes == 300 and r.host_pinned_bytes == 1024
    node = Node.from_dict({**_node_dict(), "pinned_host_bytes": 2 * r.host_pinned_bytes})
    assert pinned_reason(node, r.host_pinned_bytes, ranks=2) is None
    tight = Node.from_dict({**_node_dict(), "pinned_host_bytes": 2 * r.host_pinned_bytes - 1})
    reason = pinned_reason(tight, r.host_pinned_bytes, ranks=2)
    assert reason is not None and "pinned host buffers" in reason


def _node_dict() -> dict:
    from pathlib import Path

    import yaml

    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf/node/pcie_workstation.yaml").read_text())
    data.pop("defaults", None)
    return data


def test_the_runtime_measures_the_host_bytes_the_record_and_the_simulator_give() -> None:
    """A small torch model with every saved activation swapped (offloads in forward, prefetches in
    backward): the verified step's host bytes at each boundary where it issues transfers are the
    record's, and on a link fast enough that each copy ends within its step the simulator's host
    peak is the record's too (every host copy is live once the forward's last offload has started)."""
    torch = require_torch_extra("torch")
    from slackswap.runtime import apply
    from slackswap.runtime.copy_engines import CpuCopies
    from tests.test_runtime_hook_steps import _step, _swap_everything

    model, x, graph, plan = _swap_everything()
    positions = plan_positions(plan, resolve_schedule(graph, plan))
    assert positions.host_peak_bytes > 0
    run = apply(plan, graph, model, copies=CpuCopies())
    _step(model, x, run)
    assert run.report.verified and run.report.host_live_bytes
    assert run.report.host_live_bytes == {b: positions.host_live_bytes[b] for b in run.report.host_live_bytes}
    assert run.report.host_peak_bytes == positions.host_peak_bytes
    fast = simulate(graph, plan, toy_hardware(1e15, 1e15), None)
    assert fast.host_peak_bytes == positions.host_peak_bytes == run.report.host_peak_bytes
    # The copy freed at boundary 10 is counted there (read while step 10 runs) and gone after: under
    # the rule the verified step had before (host copies to the step's end) boundary 10 held 256 B.
    assert run.report.host_live_bytes[max(run.report.host_live_bytes)] < run.report.host_peak_bytes
    _step(model, x, run)  # a hook-only step, on the same positions
    assert not run.report.verified and run.report.offloads == len(plan.offloads)
    assert torch.is_tensor(x)
    # What the CUDA engine pins (one slab, `CudaCopies(offload_sizes(...))`) is what the simulator
    # reports and the node's check reads.
    from slackswap.runtime.copy_engines import HostPool, offload_sizes

    sizes = offload_sizes(resolve_schedule(graph, plan))
    pool = HostPool(pinned=False)
    pool.reserve(sizes)
    slab = pool.get(0, sizes[0]).untyped_storage().nbytes()
    assert slab == positions.pinned_slab_bytes == fast.host_pinned_bytes > positions.host_peak_bytes


def test_a_plan_that_recomputes_or_moves_anything_is_not_idle() -> None:
    g = three_layer_graph()
    keep = _swap(g, {}, {})
    recompute = replace(keep, decisions={**keep.decisions, "a": Decision.RECOMPUTE})
    swap = _swap(g, {"a": 0}, {"a": 2})
    assert keep.idle and not recompute.idle and not swap.idle
