"""The hooks `benchmarks/runtime_overhead.py` times beside the runtime (the floors it reads the runtime's
row against) compute the step they stand in for: gradients bit-equal to plain eager's, the copies the
plan makes made, and the unchecked program runs the runtime's own program or says why not."""
from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")

from benchmarks.runtime_overhead import Variants  # noqa: E402
from tests.runtime_support import deterministic_kernels  # noqa: E402, F401 (a fixture)

pytestmark = pytest.mark.usefixtures("deterministic_kernels")


def _grads(v: Variants, variant: str) -> list:
    v._one(variant)
    return [p.grad.clone() for p in v.w.model.parameters()]


@pytest.mark.slow
def test_the_attribution_hooks_compute_eagers_gradients_and_make_the_plans_copies() -> None:
    torch.set_num_threads(1)
    v = Variants(2)
    v._one("runtime_slackswap")  # the verified step: the hook program is built from it
    assert v._prepare_attribution() is None
    eager = _grads(v, "eager")
    for variant in ("unchecked_program", "same_copies_plain_hooks", "identity_hooks", "runtime_slackswap",
                    "runtime_every_hidden_swap"):
        got = _grads(v, variant)
        assert all(torch.equal(e, g) for e, g in zip(eager, got, strict=True)), variant
    # One host buffer per offload of the program, each the size of the copy it holds.
    program = v.runs["slackswap"]._program
    offloads = [j for p in program.packs for j in p.offloads]
    assert sorted(v._unchecked_host) == sorted(offloads) and len(offloads) == len(v.plans["slackswap"].offloads)
    assert sum(t.untyped_storage().nbytes() for t in v._unchecked_host.values()) == sum(
        v.runs["slackswap"].schedule.copy_size[c] for c in v.runs["slackswap"].schedule.offload_copy)


def test_the_unchecked_hooks_refuse_a_program_with_operations_they_do_not_run() -> None:
    from slackswap.runtime.hook_program import RELEASE, HookProgram, PackEvent

    pack = PackEvent(dtype=torch.float32, shape=torch.Size([1]), name="t", holds=0, offloads=(), held=True,
                     ops=((RELEASE, 0),), by_number=False, reads_rng=False, stride=(1,), offset=0, whole=True)
    v = Variants.__new__(Variants)  # the refusal reads the program alone
    v.runs = {"slackswap": type("Run", (), {"_program": HookProgram((pack,), (), ())})()}
    assert v._unchecked_program_refusal() == "the program has operations at a pack or after the last event"


def test_the_peak_counts_every_allocation_and_free_of_the_step_in_time_order() -> None:
    from benchmarks.runtime_overhead import peak_cpu_bytes

    held = []

    def step() -> None:
        a = torch.empty(1000, dtype=torch.uint8)
        held.append(torch.empty(3000, dtype=torch.uint8))  # outlives the step
        del a
        b = torch.empty(500, dtype=torch.uint8)  # in the space `a` left: the peak stays 4000
        del b

    assert peak_cpu_bytes(step) == 4000
    # A temporary of 400 bytes and, while it lives, its 4-byte sum.
    assert peak_cpu_bytes(lambda: torch.empty(10, 10).sum()) == 404


@pytest.mark.slow
def test_torchs_sac_row_makes_the_exports_decisions_and_its_steps_are_exact() -> None:
    """torch_sac_same_decisions, against which export_eager is read: the benchmark's own check (the same
    ops saved per layer, the same cache bytes, the same loss and gradients) holds, and both rows'
    timed steps compute eager's gradients (the export's from its tables, after the audited step)."""
    torch.set_num_threads(1)
    v = Variants(2)
    eager = _grads(v, "eager")
    _grads(v, "export_eager")  # the audited step
    for variant in ("export_eager", "torch_sac_same_decisions"):
        got = _grads(v, variant)
        assert all(torch.equal(e, g) for e, g in zip(eager, got, strict=True)), variant
    checked = v._sac_same_as_export()
    assert checked["same_decisions_as_export_eager"] and checked["checkpoint_cached_bytes"] > 0
    assert checked["export_offloaded_bytes_torch_recomputes"] == v.export.record.offloaded_bytes > 0
    kinds = {p for r in range(len(v.layers)) for p in v.export.call_table(r).policies().values()}
    assert len(kinds) == 3  # the decisions save, offload and recompute
