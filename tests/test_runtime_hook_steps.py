"""Hook-only steps and their copy engine, on a model small enough to reason about by hand.

- A saved tensor with the recorded shape and dtype but another view geometry: the hook-only step
  hands the recorded view back to the unpack by the pack's number; when autograd saves the same
  tensor with other strides (here: the input batch arrives transposed in memory, and the
  elementwise ops keep its layout), the pack carries the tensor's own geometry instead, so the
  swapped copy is read back as the view autograd saved, bit for bit.
- The host buffers sized from the plan (`offload_sizes`, one slab with `HostPool.reserve`) are the
  bytes the offloads of a real step copy, buffer by buffer.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra()

from slackswap.plan import Decision, StepKind  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.runtime import apply, capture_graph  # noqa: E402
from slackswap.runtime.copy_engines import CpuCopies, HostPool, offload_sizes  # noqa: E402
from slackswap.runtime.executor import PlanMismatchError  # noqa: E402
from slackswap.schedule.build import build_schedule  # noqa: E402
from tests.runtime_support import (  # noqa: E402, F401 (deterministic_kernels: a fixture)
    bit_equal,
    capture,
    deterministic_kernels,
    h200,
    step_under,
)

pytestmark = pytest.mark.usefixtures("deterministic_kernels")


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(x * 2.0))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _step(model, x, context=None):
    for p in model.parameters():
        p.grad = None
    if context is None:
        _loss(model(x)).backward()
    else:
        with context:
            _loss(model(x)).backward()
    return [p.grad.clone() for p in model.parameters()]


def _swap_everything():
    torch.manual_seed(0)
    model = _Scaled()
    x = torch.randn(4, 8)
    graph = capture_graph(model, (x,), _loss, h200(), "scaled")
    # Every saved activation swapped (the scheduler every planner uses places the transfers).
    plan = build_schedule(graph, {t.name: Decision.SWAP for t in graph.saved_tensors}, planner="swap_every_tensor",
                          budget_bytes=None, hardware=h200())
    return model, x, graph, plan


class _CountingPool(HostPool):
    """Counts the buffers the engine's own `offload` asks for (`like`); the offloads bound at the
    verified step (`CpuCopies.offloader`) write their buffer directly and ask for none."""

    def __init__(self) -> None:
        super().__init__(pinned=False)
        self.asked = 0

    def like(self, key, source):
        self.asked += 1
        return super().like(key, source)


def test_a_saved_view_with_other_strides_is_read_back_with_its_own_geometry() -> None:
    model, x, graph, plan = _swap_everything()
    copies = CpuCopies()
    copies.host = _CountingPool()
    run = apply(plan, graph, model, copies=copies)
    _step(model, x, run)  # the verified step records the contiguous geometry
    assert run.report.verified
    verified_asks = copies.host.asked
    _step(model, x, run)  # hook-only, the recorded geometry: every offload by its bound callable
    assert not run.report.verified and copies.host.asked == verified_asks
    transposed = x.t().contiguous().t()  # the same values, shape and dtype; strides (1, 4)
    assert transposed.stride() != x.stride()
    expected = _step(model, transposed)
    got = _step(model, transposed, run)
    assert not run.report.verified  # a hook-only step
    assert run.report.offloads == len(plan.offloads) > 0
    # The copy the pack hands over has another form than the bound offload's: the engine's own
    # offload sizes the buffer for it.
    assert copies.host.asked > verified_asks
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


class _RecordingCopies(CpuCopies):
    def __init__(self) -> None:
        super().__init__()
        self.offloaded: dict[int, int] = {}

    def offload(self, source, key=None):
        self.offloaded[key] = source.untyped_storage().nbytes()
        return super().offload(source, key)


def test_host_buffers_sized_from_the_plan_are_the_bytes_each_offload_copies() -> None:
    model, x, graph, plan = _swap_everything()
    copies = _RecordingCopies()
    run = apply(plan, graph, model, copies=copies)
    _step(model, x, run)  # verified
    _step(model, x, run)  # hook-only
    assert copies.offloaded and copies.offloaded == offload_sizes(run.schedule)


def test_a_reserved_pool_is_one_allocation_of_disjoint_aligned_buffers_reused_across_steps() -> None:
    pool = HostPool(pinned=False)
    pool.reserve({0: 100, 1: 30, 2: 600}, alignment_bytes=64)
    assert pool.allocations == 1
    buffers = [pool.get(k, n) for k, n in ((0, 100), (1, 30), (2, 600))]
    assert [b.numel() for b in buffers] == [100, 30, 600]
    assert [b.storage_offset() for b in buffers] == [0, 128, 192]  # each at a multiple of 64
    for value, b in enumerate(buffers):
        b.fill_(value + 1)
    assert [int(b.min()) for b in buffers] == [1, 2, 3] == [int(b.max()) for b in buffers]  # disjoint
    assert pool.get(1, 30).data_ptr() == buffers[1].data_ptr() and pool.allocations == 1  # reused
    assert pool.get(1, 31).numel() == 31 and pool.allocations == 2  # another size: its own buffer


def test_a_pool_buffer_typed_like_its_source_is_made_once_and_shares_the_slab() -> None:
    pool = HostPool(pinned=False)
    pool.reserve({0: 24, 1: 16}, alignment_bytes=64)
    source = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    host = pool.like(0, source)
    assert (host.shape, host.dtype, host.is_contiguous()) == (source.shape, source.dtype, True)
    assert host.data_ptr() == pool.get(0, 24).data_ptr()  # the slab's buffer of key 0, typed
    host.copy_(source)
    assert torch.equal(pool.get(0, 24).view(torch.float32), source.flatten())
    assert pool.like(0, source) is host and pool.allocations == 1  # made once, reused every step
    other = pool.like(1, torch.zeros(4, dtype=torch.int32))
    assert other.data_ptr() == pool.get(1, 16).data_ptr() != host.data_ptr()
    assert pool.like(0, torch.zeros(3, 2)).shape == (3, 2) and pool.allocations == 1  # same bytes, new shape
    assert pool.like(0, torch.zeros(7)).numel() == 7 and pool.allocations == 2  # other bytes: its own buffer


def test_inline_copies_bind_an_offload_to_its_buffer_and_a_prefetch_to_clone() -> None:
    from slackswap.runtime.copy_engines import bind_offload, bind_prefetch

    copies = CpuCopies()
    source = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    offload = bind_offload(copies, 4, source.dtype, source.shape)
    host = copies.host.typed(4, source.dtype, source.shape)
    assert offload.__self__ is host  # the buffer's own copy_: no Python frame between hook and ATen
    assert offload(source) is host and torch.equal(host, source)
    assert copies.offload(source, 4) is host  # the engine's own offload finds the same buffer
    prefetch = bind_prefetch(copies, torch.device("cpu"))
    back = prefetch(host)
    assert torch.equal(back, source) and back.data_ptr() != host.data_ptr()  # a new device copy


def test_copies_with_work_of_their_own_per_transfer_are_bound_to_their_methods() -> None:
    from slackswap.runtime.copy_engines import bind_offload, bind_prefetch

    source = torch.arange(4, dtype=torch.float32)
    delayed = CpuCopies(delay_s=0.001)  # a worker thread: the offload is `InFlight`
    in_flight = bind_offload(delayed, 0, source.dtype, source.shape)(source)
    arriving = bind_prefetch(delayed, torch.device("cpu"))(in_flight)
    arriving.wait()
    delayed.close()
    assert torch.equal(arriving.tensor, source)
    recording = _RecordingCopies()  # a subclass that overrides offload has it called for every transfer
    bind_offload(recording, 3, source.dtype, source.shape)(source)
    assert recording.offloaded == {3: source.untyped_storage().nbytes()}

    class Minimal:  # an engine with no offloader or prefetcher: its offload and prefetch, bound
        def offload(self, source, key=None):
            return ("offloaded", key, source)

        def prefetch(self, offloaded, device):
            return ("prefetched", offloaded[1], device)

    engine = Minimal()
    assert bind_offload(engine, 7, source.dtype, source.shape)(source)[:2] == ("offloaded", 7)
    assert bind_prefetch(engine, torch.device("cpu"))(("offloaded", 7, source)) == ("prefetched", 7,
                                                                                   torch.device("cpu"))


def _aten_calls(w, context) -> Counter:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen[str(func)] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(1)
    for p in w.model.parameters():
        p.grad = None
    with Count(), context if context is not None else contextlib.nullcontext():
        w.loss_fn(w.model(w.batch)).backward()
    return seen


def test_a_hook_only_step_makes_one_aten_call_per_transfer_and_none_per_whole_unpack() -> None:
    """TinyGPT under slackswap's plan at 70 % of the keep-all peak (the runtime benchmark's budget):
    beyond the calls of the same step under hooks that return their argument (autograd's own, with
    hooks installed), a hook-only step makes exactly one `copy_` per offload (into its typed host
    buffer), one `clone` per prefetch, and one `as_strided` per held or read-back view that is not its
    copy's whole storage (q, k, v of the fused projection); the unpack of a whole copy makes none.
    The verified step before it issues its transfers unseen by the identities (a prefetch's `clone`
    in the loss region would rename the loss's own clone), and both steps are bit-exact."""
    c = capture("tiny", layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256)
    plan = get_planner("slackswap").plan(c.graph, h200(), int(c.keep_all_peak_bytes * 0.7))
    assert plan.offloads and not any(s.kind == StepKind.RECOMPUTE for s in plan.steps)
    run = apply(plan, c.graph, c.workload.model)
    for verified in (True, False):
        loss, grads = step_under(c.workload, run)
        assert run.report.verified == verified and bit_equal(c.reference, loss, grads)
    plain = _aten_calls(c.workload, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    hooked = _aten_calls(c.workload, run)
    assert not run.report.verified
    packs = run._program.packs
    held_views = sum(1 for p in packs if p.holds >= 0 and not p.whole)
    read_views = sum(1 for p in packs if p.by_number and not p.whole)  # each saved tensor is read back once
    assert hooked - plain == Counter({"aten.copy_.default": len(plan.offloads),
                                      "aten.clone.default": len(plan.prefetches),
                                      "aten.as_strided.default": held_views + read_views})
    assert plain - hooked == Counter()
    assert held_views > 0 and read_views > 0  # the fused qkv projection's views are held and read as views


def test_the_program_reads_each_swapped_or_recomputed_tensor_from_the_copy_the_plan_makes_for_it() -> None:
    """Every unpack of a tensor that left autograd's hands reads, by the program, a prefetch copy
    when the plan swaps it and a recompute copy when it recomputes it (never the run copy, which the
    plan has let go), and each offload runs at or after the pack that hands its source over."""
    c = capture("tiny", layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256)
    budget = int(c.keep_all_peak_bytes * 0.7)  # the runtime benchmark's budget (50 % is infeasible here)
    kinds = set()
    for planner in ("slackswap", "recompute_knapsack"):
        plan = get_planner(planner).plan(c.graph, h200(), budget)
        run = apply(plan, c.graph, c.workload.model)
        step_under(c.workload, run)
        program, schedule = run._program, run.schedule
        assert program is not None and program.refusal is None, planner
        for event in program.unpacks:
            if event.name is None or plan.decisions.get(event.name, Decision.KEEP) == Decision.KEEP:
                continue
            wanted = "prefetch" if plan.decisions[event.name] == Decision.SWAP else "recompute"
            assert schedule.copy_source[event.copy] == wanted, (planner, event.name)
            kinds.add(wanted)
        handed = set()
        for pack in program.packs:
            handed.add(pack.holds)
            for op in pack.ops:
                if op[0] == 1:  # OFFLOAD: its source copy has been handed over by now
                    assert op[2] in handed, (planner, op)
    assert kinds == {"prefetch", "recompute"}


def test_other_inputs_in_a_hook_only_step_fail_before_any_saved_tensor() -> None:
    """The input check of a hook-only step (the traced signature, cached) names both signatures."""
    c = capture("tiny", layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256)
    plan = get_planner("slackswap").plan(c.graph, h200(), int(c.keep_all_peak_bytes * 0.7))
    run = apply(plan, c.graph, c.workload.model)
    step_under(c.workload, run)
    w = c.workload
    other = torch.randint(0, w.vocab_size, (w.batch.shape[0], w.batch.shape[1] // 2))
    for p in w.model.parameters():
        p.grad = None
    seen, traced = r"\[\[\[2, 16\], 'torch.int64'\]\]", r"\[\[\[2, 32\], 'torch.int64'\]\]"
    message = rf"model inputs \(shape, dtype\) {seen} differ from the traced {traced}"
    mismatch = pytest.raises(PlanMismatchError, match=message)
    with mismatch, run:
        w.model(other)
    assert not run.report.verified and run._reached() == (0, 0)


def test_folded_program_holds_no_copy_past_its_last_use_and_counts_what_the_step_reached() -> None:
    """The hook program folds the plan's releases into the events that use a copy last (`_fold`):
    a run copy the plan only offloads at its pack is offloaded from the pack's tensor and never held,
    a prefetched copy goes at its last unpack, and no release of either is left as an operation.
    Mid-forward the runtime holds only the copies a later event reads; after the step it holds none.
    The step's transfer counts are the program's for the events reached: all of them after a full
    step, the packs' alone when the step fails between forward and backward."""
    from slackswap.runtime.hook_program import OFFLOAD, RELEASE

    c = capture("tiny", layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=256)
    plan = get_planner("slackswap").plan(c.graph, h200(), int(c.keep_all_peak_bytes * 0.7))
    run = apply(plan, c.graph, c.workload.model)
    step_under(c.workload, run)  # verified
    loss, grads = step_under(c.workload, run)  # hook-only, on the folded program
    assert not run.report.verified and bit_equal(c.reference, loss, grads)
    program = run._program
    direct = {p.holds for p in program.packs if p.offloads}
    assert direct and all(not p.held for p in program.packs if p.offloads)
    assert sum(len(p.offloads) for p in program.packs) + sum(
        op[0] == OFFLOAD for ev in (*program.packs, *program.unpacks) for op in ev.ops) == len(plan.offloads)
    released_at_read = {u.copy for u in program.unpacks if u.release}
    assert released_at_read
    left = {op[1] for ev in (*program.packs, *program.unpacks) for op in ev.ops if op[0] == RELEASE}
    left |= {op[1] for op in program.tail if op[0] == RELEASE}
    assert not left & (direct | released_at_read)
    assert (run.report.offloads, run.report.prefetches) == (len(plan.offloads), len(plan.prefetches))

    read_later = {u.copy for u in program.unpacks if u.copy >= 0}
    w = c.workload
    for p in w.model.parameters():
        p.grad = None
    with pytest.raises(RuntimeError, match="between forward and backward"), run:
        torch.manual_seed(0)
        w.loss_fn(w.model(w.batch))
        assert set(run.held_tensors) <= read_later | {p.holds for p in program.packs if p.held}
        assert not set(run.held_tensors) & direct
        raise RuntimeError("between forward and backward")
    assert run._reached() == (len(program.packs), 0)
    assert (run.report.offloads, run.report.prefetches) == program.transfers(len(program.packs), 0, False)
    assert run.report.offloads == len(plan.offloads)  # this plan offloads every swapped tensor in forward
    assert not run.held_tensors  # the failed step let everything go
