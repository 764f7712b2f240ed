"""One plan per batch shape under a trainer integration (slackswap.integrations.step, docs/integrations.md).

Loaders end an epoch on a short batch and pad each batch to its own longest row, so the step a trainer
runs changes shape. Each new shape is captured and planned at its first batch, under the same budget,
planner and executor, and kept: on the three-block residual MLP every step's gradients equal a plain
step's bit for bit across shapes that come and go, within one accumulation window too (the capture
keeps the earlier micro-batches' gradients); a shape past `max_shapes`, or another shape than a plan
made before was made for, is refused before its step in one line."""

from __future__ import annotations

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra()

from slackswap.integrations.planning import IntegrationError  # noqa: E402
from slackswap.integrations.step import PlannedStep  # noqa: E402
from slackswap.runtime import capture_graph  # noqa: E402
from tests.fsdp2_worker import Net, _loss  # noqa: E402  (the three-block residual MLP)
from tests.runtime_support import h200  # noqa: E402


def _batch(rows: int) -> torch.Tensor:
    return torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))


def _same_grads(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("executor", ["runtime", "export"])
@pytest.mark.parametrize("planner", ["slackswap", "full_recompute"])
def test_each_batch_shape_is_planned_at_its_first_batch_and_runs_exact(planner, executor) -> None:
    plain, model = Net(), Net()
    lines: list[str] = []
    state = PlannedStep(budget=0.8, planner=planner, executor=executor, printer=lines.append)
    for rows in (64, 48, 64, 48, 32, 64):
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
        _loss(plain(_batch(rows))).backward()
        state.run(model, (_batch(rows),), _loss)
        assert _same_grads(plain, model), rows
        assert state.planned.graph.meta["input_signature"] == [[[rows, 32], "torch.float32"]]
    assert [p.graph.name for p in state.plans] == ["Net@64x32", "Net@48x32", "Net@32x32"]
    assert len(lines) == 3 and all(line.startswith(f"slackswap: {planner} plan ({executor})") for line in lines)
    peaks = [p.keep_all_peak_bytes for p in state.plans]
    assert peaks[0] > peaks[1] > peaks[2]  # each shape's budget is 0.8 of its own keep-all peak
    assert [p.budget_bytes for p in state.plans] == [int(0.8 * peak) for peak in peaks]
    # the runtime verifies each shape's first step (verify_steps=1), and only those
    assert len(state.logged) == (3 if executor == "runtime" else 0)


def test_a_new_shape_inside_an_accumulation_window_keeps_the_earlier_micro_batches_gradients() -> None:
    """Capturing the second micro-batch's new shape runs an unplanned step; before the capture set the
    parameters' gradients aside and put them back, it dropped the first micro-batch's."""
    plain, model = Net(), Net()
    state = PlannedStep(budget=0.8, planner="full_recompute", printer=lambda _: None)
    for rows in (64, 48, 32):  # one window of three micro-batches, each of a new shape
        _loss(plain(_batch(rows))).backward()
        state.run(model, (_batch(rows),), _loss)
    assert _same_grads(plain, model) and len(state.plans) == 3


def test_a_capture_leaves_the_models_gradients_and_buffers_as_they_were() -> None:
    """A batch norm's running statistics ran one update ahead of a plain run's after a capture, and the
    capture dropped gradients the parameters held."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    model(torch.randn(4, 8)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    values = [p.grad.clone() for p in model.parameters()]
    norm = model[1]
    buffers = {name: (b, b.clone()) for name, b in norm.named_buffers()}
    capture_graph(model, [torch.randn(16, 8)], lambda out: out.sum(), h200(), name="bn")
    assert all(p.grad is g and torch.equal(g, v) for p, g, v in zip(model.parameters(), grads, values, strict=True))
    for name, (buffer, before) in buffers.items():
        assert getattr(norm, name) is buffer and torch.equal(buffer, before), name


def test_a_shape_past_max_shapes_is_refused_before_its_step() -> None:
    model = Net()
    state = PlannedStep(budget=0.8, max_shapes=2, printer=lambda _: None)
    for rows in (64, 48):
        model.zero_grad(set_to_none=True)
        state.run(model, (_batch(rows),), _loss)
    model.zero_grad(set_to_none=True)
    with pytest.raises(IntegrationError, match=r"^max_shapes=2: a batch of inputs \[\[\[32, 32\], 'torch.float32'\]\] "
                                               r"would need one more plan \(planned: 64x32, 48x32\); pad batches to a "
                                               r"multiple") as refused:
        state.run(model, (_batch(32),), _loss)
    assert "\n" not in str(refused.value)
    assert all(p.grad is None for p in model.parameters()) and not state.active  # nothing of the step ran
    state.run(model, (_batch(48),), _loss)  # the planned shapes still run
    assert state.steps == 3 and len(state.plans) == 2


def test_a_plan_made_before_is_refused_at_a_batch_of_another_shape() -> None:
    model = Net()
    made = PlannedStep(budget=0.8, printer=lambda _: None)
    made.run(model, (_batch(64),), _loss)
    state = PlannedStep(budget=0.8, planned=made.planned, printer=lambda _: None)
    model.zero_grad(set_to_none=True)
    state.run(model, (_batch(64),), _loss)
    with pytest.raises(IntegrationError, match=r"^plan='Net@64x32': was made for inputs \[\[\[64, 32\], "
                                               r"'torch.float32'\]\]; this batch has \[\[\[48, 32\], .*pass no plan"):
        state.run(model, (_batch(48),), _loss)


@pytest.mark.parametrize("value", [0, True, "8", 1.5])
def test_a_bad_max_shapes_is_one_line_naming_it(value) -> None:
    with pytest.raises(IntegrationError, match=rf"^max_shapes={value!r}: must be a positive integer"):
        PlannedStep(budget=0.8, max_shapes=value)


def _llama_batches(seed: int = 0):
    """Batches of two rows of 64 tokens for the HF example's Llama, padded (the second row 50 long) or not."""
    g = torch.Generator().manual_seed(seed)

    def batch(padded: bool) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 128, (2, 64), generator=g)
        mask, labels = torch.ones(2, 64, dtype=torch.long), ids.clone()
        if padded:
            mask[1, 50:], labels[1, 50:] = 0, -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return batch


@pytest.mark.parametrize("planner", ["slackswap", "full_recompute"])
def test_a_padded_and_an_unpadded_batch_of_one_shape_get_a_plan_each(planner) -> None:
    """A Hugging Face decoder skips its attention mask when the mask masks nothing (a read in forward):
    another code path at the same shape. Keyed by shape alone, the unpadded batch after a padded one was
    refused mid-training (off the captured graph, or at its 17th saved tensor); each now has its plan."""
    import runpy

    from pipelines.schemas import REPO_ROOT

    require_torch_extra("transformers")
    ex = runpy.run_path(str(REPO_ROOT / "examples" / "hf_trainer.py"))
    plain, model = ex["tiny_model"]("llama"), ex["tiny_model"]("llama")
    batch = _llama_batches()
    state = PlannedStep(budget=0.6, planner=planner, printer=lambda _: None)
    for padded in (True, True, False, False, True, False):
        call = batch(padded)
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
        plain(**call).loss.backward()
        state.run(model, call, lambda out: out.loss)
        assert _same_grads(plain, model), padded
    assert [p.graph.name for p in state.plans] == ["LlamaForCausalLM@2x64+padding", "LlamaForCausalLM@2x64"]
    assert len(state.logged) == 2 and all(f["slackswap/peak_as_predicted"] == 1.0 for f in state.logged)


SCALE = 1.0


class _Scaled(Net):
    """The MLP with its input scaled by a module global the loop changes every step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * SCALE)


def test_steps_that_keep_running_verified_say_why_once() -> None:
    """A global read in forward that changes every step makes every step of a recomputing plan run verified
    (exact, several times slower): counted per reason, and said once, at the third."""
    import warnings

    global SCALE
    plain, model = _Scaled(), _Scaled()
    state = PlannedStep(budget=0.8, planner="full_recompute", printer=lambda _: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            SCALE = 1.0 + step / 8
            for m in (plain, model):
                m.zero_grad(set_to_none=True)
            _loss(plain(_batch(64))).backward()
            state.run(model, (_batch(64),), _loss)
            assert _same_grads(plain, model), step
    SCALE = 1.0
    because = f"a value the forward reads from outside the model changed ({__name__}.SCALE)"
    assert state.reverified == {because: 5}
    said = [str(w.message) for w in caught if str(w.message).startswith("slackswap:")]
    assert said == [f"slackswap: 3 steps of _Scaled@64x32 past the verified ones ran verified (the runtime's checked "
                    f"path, several times a step on hooks alone) because {because}"]
