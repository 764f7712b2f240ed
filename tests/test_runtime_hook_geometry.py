"""A hook-only step whose saved tensor has the recorded shape and dtype but another view geometry.

The hook-only step hands the recorded view back to the unpack by the pack's number; when autograd
saves the same tensor with other strides (here: the input batch arrives transposed in memory, and
the elementwise ops keep its layout), the pack carries the tensor's own geometry instead, so the
swapped copy is read back as the view autograd saved, bit for bit.
"""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra()

from slackswap.plan import Decision  # noqa: E402
from slackswap.runtime import apply, capture_graph  # noqa: E402
from slackswap.schedule.build import build_schedule  # noqa: E402
from tests.runtime_support import deterministic_kernels, h200  # noqa: E402, F401 (deterministic_kernels: a fixture)

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


def test_a_saved_view_with_other_strides_is_read_back_with_its_own_geometry() -> None:
    torch.manual_seed(0)
    model = _Scaled()
    x = torch.randn(4, 8)
    graph = capture_graph(model, (x,), _loss, h200(), "scaled")
    # Every saved activation swapped (the scheduler every planner uses places the transfers).
    plan = build_schedule(graph, {t.name: Decision.SWAP for t in graph.saved_tensors}, planner="swap_every_tensor",
                          budget_bytes=None, hardware=h200())
    run = apply(plan, graph, model)
    _step(model, x, run)  # the verified step records the contiguous geometry
    assert run.report.verified
    transposed = x.t().contiguous().t()  # the same values, shape and dtype; strides (1, 4)
    assert transposed.stride() != x.stride()
    expected = _step(model, transposed)
    got = _step(model, transposed, run)
    assert not run.report.verified  # a hook-only step
    assert run.report.offloads == len(plan.offloads) > 0
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
