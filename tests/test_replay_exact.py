"""Exact or refused, never silent (issue 39): a recompute yields the tensor at the version autograd saved.

The cases of the issue, on the zoo's models (`slackswap.runtime.zoo`), each run for real on CPU and
compared bit for bit (loss, gradients, buffers) with a plain step of the same model and RNG seed:
- `scores = q @ k.T; scores /= 4.0`: the write joins the bmm op (`OpNumbering`), so a recompute
  replays both (before: every recompute of the softmax read the unscaled scores);
- Mixtral's `inv_perm = empty_like(perm); inv_perm[perm] = arange(...)`: the write comes after other
  ops, so no planner recomputes `inv_perm` (the plan's notes say why), and a plan made without that
  rule is refused by the runtime's write counts with one error naming the op, tensor and line
  (before: `empty_like` alone, an IndexError or a silently wrong gradient);
- T5's `relative_buckets += ...`, Falcon's `attention_scores /= math.sqrt(head_dim)` and HF Mixtral's
  expert routing (slow).
"""

from __future__ import annotations

import copy
import random

import pytest

from tests.extras import require_torch_extra

torch = require_torch_extra("torch")
require_torch_extra("transformers")

from benchmarks.zoo import Arch, compare, step  # noqa: E402
from slackswap.graph import REWRITTEN_KEY, STATE_KEY  # noqa: E402
from slackswap.plan import StepKind  # noqa: E402
from slackswap.planners.registry import get_planner  # noqa: E402
from slackswap.planners.support.replay_rule import replay_rule  # noqa: E402
from slackswap.runtime.replay_check import InexactRecomputeError, WriteCounts  # noqa: E402
from slackswap.testing import random_graph  # noqa: E402
from tests.runtime_support import deterministic_kernels, h200  # noqa: E402, F401 (a fixture)

pytestmark = pytest.mark.usefixtures("deterministic_kernels")
_ARCHS: dict[str, Arch] = {}


def arch(name: str) -> Arch:
    if name not in _ARCHS:
        _ARCHS[name] = Arch(name, h200())
    return _ARCHS[name]


def unruled(planner: str, a: Arch, fraction: float):
    """The planner's own plan, without the replay rule: what every planner offered before issue 39."""
    p = get_planner(planner)
    return type(p).plan.__wrapped__(p, a.graph, a.hardware, int(a.peak * fraction))


def test_a_write_right_after_its_producer_is_replayed_with_it() -> None:
    a = arch("inplace_attention")
    ops = {op.name: op for op in a.graph.ops}
    assert not any("div_" in name for name in ops), "the in-place div_ is a member of the bmm op, not an op"
    assert REWRITTEN_KEY not in a.graph.meta
    plan = get_planner("full_recompute").plan(a.graph, a.hardware, int(a.peak * 0.7))
    assert any(s.kind == StepKind.RECOMPUTE and "bmm" in s.op for s in plan.steps)
    assert "not_recomputable" not in plan.notes
    assert compare(a.reference, a.run(plan, "runtime")) == "exact"


def test_a_later_index_write_into_empty_like_is_kept_with_its_reason() -> None:
    a = arch("routing")
    rewritten = a.graph.meta[REWRITTEN_KEY]
    inv_perm = "layers.0/empty_like#0:0"
    assert rewritten[inv_perm][0].endswith("index_put_.default")
    assert rewritten[inv_perm][1].split(":")[0].endswith("slackswap/runtime/zoo.py")
    for planner in ("slackswap", "dtr"):
        plan = get_planner(planner).plan(a.graph, a.hardware, int(a.peak * 0.7))
        assert plan.decisions[inv_perm].value == "keep"
        assert "index_put_" in plan.notes["not_recomputable"][inv_perm]
        assert compare(a.reference, a.run(plan, "runtime")) == "exact"


def test_a_plan_that_recomputes_a_rewritten_tensor_is_refused_by_name() -> None:
    a = arch("routing")
    plan = unruled("full_recompute", a, 0.7)
    assert any(plan.decisions[t].value == "recompute" for t in a.graph.meta[REWRITTEN_KEY])
    with pytest.raises(InexactRecomputeError) as info:
        a.run(plan, "runtime")
    message = str(info.value)
    assert "index_put_" in message and "/empty_like#0:0" in message and "zoo.py:" in message


def test_a_swap_waits_for_the_writes_its_producer_makes_after_a_view() -> None:
    """DeepSeek-V3's keys: `new_empty`, a slice view, `copy_`, a slice view, `copy_` (`SplitKeys`). The
    copies are the `new_empty` op's own, the views ops between them: an offload issued at the op's step
    copied the empty tensor, and the verified step refused every plan that swaps it."""
    from slackswap.runtime import apply, plan_counts

    a = arch("split_keys")
    keys = "layers.0/new_empty#0:0"
    assert [op.name for op in a.graph.ops if keys in op.outputs][0].endswith("new_empty.default")
    plan = get_planner("save_on_cpu").plan(a.graph, a.hardware, int(a.peak * 0.7))
    assert plan.decisions[keys].value == "swap"
    model = copy.deepcopy(a.pristine)
    run = apply(plan, a.graph, model)
    counts = plan_counts(plan)
    for n in range(3):  # the verified step, then hook-only steps
        assert compare(a.reference, step(a.w, model, run)) == "exact", n
        assert run.report.verified == (n == 0), n
        assert (run.report.offloads, run.report.prefetches) == (counts["offloads"], counts["prefetches"]), n


def test_a_version_check_without_a_later_writer_names_the_producers_own_writes() -> None:
    counts = WriteCounts()
    with pytest.raises(InexactRecomputeError) as info:
        counts.check("layers.0/new_empty#0:0", 2, 0, "autograd unpacks the prefetch")
    assert "its producer op's own in-place calls wrote it after the copy was made" in str(info.value)
    assert "unknown" not in str(info.value)


def test_a_mask_drawn_from_the_models_own_generator_is_kept_and_runs_exact_step_after_step() -> None:
    """`torch.rand(..., generator=g)` (the zoo's `own_generator`): a replay restores only the default
    generators' state. Before this rule the zoo read 7 runtime cells `different` (full_recompute: 16 of 19
    gradients), every step, verified ones included."""
    from slackswap.runtime import apply

    a = arch("own_generator")
    draws = {op: why for op, why in a.graph.meta[STATE_KEY].items() if op.endswith("rand.generator")}
    assert len(draws) == 4 and all("torch.Generator" in what and "zoo.py:" in line for what, line in draws.values())
    plan = get_planner("full_recompute").plan(a.graph, a.hardware, int(a.peak * 0.7))
    masks = plan.notes["not_recomputable"]
    assert sorted(masks) == [f"layers.{i}/gt#0:0" for i in range(4)]
    assert all("torch.Generator" in why for why in masks.values())
    assert any(s.kind == StepKind.RECOMPUTE for s in plan.steps)
    plain, model = copy.deepcopy(a.pristine), copy.deepcopy(a.pristine)
    run = apply(plan, a.graph, model)
    losses = []
    for n in range(3):  # both copies' generators draw the next mask each step
        reference = step(a.w, plain)
        assert compare(reference, step(a.w, model, run)) == "exact", n
        assert run.report.verified == (n == 0), n
        losses.append(float(reference[0]))
    assert len(set(losses)) == 3  # the masks differ from step to step: a replay of the first would show
    export_plan = a.plan("full_recompute", 0.95, "export")
    assert any(s.kind == StepKind.RECOMPUTE for s in export_plan.steps)
    assert compare(a.reference, a.run(export_plan, "export")) == "exact"


def test_a_plan_that_recomputes_a_draw_from_the_models_own_generator_is_refused_by_name() -> None:
    a = arch("own_generator")
    plan = unruled("full_recompute", a, 0.7)
    with pytest.raises(InexactRecomputeError) as info:
        a.run(plan, "runtime")
    assert "rand.generator" in str(info.value) and "torch.Generator the model passes" in str(info.value)


def test_the_rule_leaves_graphs_without_in_place_writes_alone() -> None:
    graph, hardware = random_graph(random.Random(3)), h200()
    assert replay_rule(graph).fixed == {}
    p = get_planner("slackswap")
    assert p.plan(graph, hardware, None) == type(p).plan.__wrapped__(p, graph, hardware, None)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5", "falcon", "mixtral"])
@pytest.mark.parametrize("planner", ["full_recompute", "torch_sac", "slackswap", "memo"])
def test_hf_in_place_writes_run_exact_or_are_infeasible(name: str, planner: str) -> None:
    cell = arch(name).cell(planner, 0.7, "runtime")
    assert cell == "exact" or cell.startswith("infeasible"), cell


def test_recomputing_a_batch_norm_updates_its_running_statistics_once() -> None:
    """Item 6: module state is training state. The recompute replays BatchNorm into scratch statistics,
    on the verified step and on the hook-only steps after it (two steps each, against two plain ones)."""
    import copy

    from slackswap.runtime import apply

    a = arch("resnet_bn")
    plan = get_planner("full_recompute").plan(a.graph, a.hardware, int(a.peak * 0.7))
    assert sum(s.kind == StepKind.RECOMPUTE and "batch_norm" in s.op for s in plan.steps) >= 4
    plain, planned = copy.deepcopy(a.pristine), copy.deepcopy(a.pristine)
    run = apply(plan, a.graph, planned)
    for _ in range(2):
        assert compare(step(a.w, plain), step(a.w, planned, run)) == "exact"
    assert not run.report.verified  # the second step ran on the hooks alone
    stats = dict(planned.named_buffers())
    assert all(int(v) == 2 for k, v in stats.items() if k.endswith("num_batches_tracked"))
    for k, v in plain.named_buffers():
        assert torch.equal(v, stats[k]), k


def test_an_exported_batch_norm_counts_its_batches_once() -> None:
    """The export's checkpoint recompute re-runs a layer's Python forward: BatchNorm's
    `num_batches_tracked += 1` is cached (saved), not run again (before: 8 of 27 buffers differed).
    full_recompute at 80 %: every layer's forward, BatchNorm included, runs again (slackswap's swap
    plans at 70 % are priced over the budget since the export prices PyTorch's reloads)."""
    from slackswap.plan import Decision

    a = arch("resnet_bn")
    plan = a.plan("full_recompute", 0.8, "export")
    assert plan.tensors_with(Decision.RECOMPUTE)
    assert compare(a.reference, a.run(plan, "export")) == "exact"


class _ConvBatchNorm(torch.nn.Module):
    """conv, batch norm, a ReLU that is not in place (its output, not the norm's, is the one saved
    in place of it: MobileViT's conv layers with SiLU), a 1x1 conv; the norm a module or functional."""

    def __init__(self, functional: bool, channels: int = 16) -> None:
        super().__init__()
        self.conv, self.mix = torch.nn.Conv2d(channels, channels, 3, padding=1), torch.nn.Conv2d(channels, channels, 1)
        self.norm = torch.nn.BatchNorm2d(channels)
        self.functional = functional

    def forward(self, x):
        h = self.conv(x)
        if self.functional:  # no num_batches_tracked += 1: nothing in place for the mechanism to see
            h = torch.nn.functional.batch_norm(h, self.norm.running_mean, self.norm.running_var, training=True)
        else:
            h = self.norm(h)
        return x + self.mix(torch.relu(h))


@pytest.mark.parametrize("functional", [False, True])
def test_an_exported_batch_norms_running_statistics_move_once_per_step(functional) -> None:
    """The export's replay of a recomputed batch norm ran it a second time, and its running statistics moved
    twice: every plan that recomputes or swaps read 2 to 6 of 6 statistics buffers off a plain run, with
    bit-exact gradients (MobileViT, 12 export cells of the zoo's matrix), and a functional norm's layer ran
    under a plain checkpoint. The replay passes scratch statistics, and such a layer runs under the policy."""
    from slackswap.experiment.export_plan import plan_for_export
    from slackswap.runtime import capture_graph
    from slackswap.runtime.export import PlanExport
    from slackswap.simulate.metrics import simulate_ideal

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_ConvBatchNorm(functional) for _ in range(3)]).train()
    x = torch.randn(4, 16, 16, 16)
    loss = lambda out: out.square().mean()  # noqa: E731
    graph = capture_graph(copy.deepcopy(model), (x,), loss, h200(), "bn")
    budget = int(simulate_ideal(graph, h200()).peak_activation_bytes * 0.7)
    plan = plan_for_export(get_planner("full_recompute"), graph, model, h200(), budget)
    plain, exported = copy.deepcopy(model), copy.deepcopy(model)
    export = PlanExport(plan, graph, exported)
    assert export.mechanisms() == ["selective"] * 3
    with export.installed(exported):
        for _ in range(3):
            for net in (plain, exported):
                net.zero_grad(set_to_none=True)
                loss(net(x)).backward()
            assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), exported.buffers(), strict=True))
            assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), exported.parameters(),
                                                                   strict=True) if a.grad is not None)


def test_the_export_refuses_a_layer_called_with_a_key_value_cache() -> None:
    """A Hugging Face model whose config keeps `use_cache=True` (the default) passes its layers a cache in
    training too; the export's recompute re-runs a layer's forward, which updates it a second time (before:
    an obscure shape error mid-backward). Refused in the forward, naming the layer and the fix; the
    runtime replays recorded calls and runs it exact."""
    from slackswap.runtime.errors import RuntimeUsageError
    from slackswap.runtime.export import PlanExport

    a = arch("llama")
    plan = a.plan("full_recompute", 0.7, "export")
    model = copy.deepcopy(a.pristine)
    model.model.config.use_cache = True
    ran_backward = []
    refusal = r"layer 'model\.model\.layers\.0' is called with a key/value cache \(argument '\w+', DynamicCache\)"
    with pytest.raises(RuntimeUsageError, match=refusal + ".*use_cache=False"), \
            PlanExport(plan, a.graph, model).installed(model):
        a.w.loss_fn(model(a.w.batch)).backward()
        ran_backward.append(True)
    assert not ran_backward
    model.model.config.use_cache = False
    with PlanExport(plan, a.graph, model).installed(model):
        assert compare(a.reference, step(a.w, model)) == "exact"


def test_the_cache_refusal_says_an_encoder_decoder_keeps_a_config_of_its_own() -> None:
    """T5's decoder stack holds a copy of the config: `model.config.use_cache = False` left it passing a
    cache, and the refusal's advice did not run; the advice now names every config, which runs exact."""
    from slackswap.runtime.errors import RuntimeUsageError
    from slackswap.runtime.export import PlanExport

    a = arch("t5")
    plan = a.plan("full_recompute", 0.7, "export")
    model = copy.deepcopy(a.pristine)
    configs = [m.config for m in model.modules() if getattr(m, "config", None) is not None]
    assert len({id(c) for c in configs}) > 1  # the model's and its stacks' own copies
    for config in configs:  # as a T5Config at its default builds them: the encoder's stack never caches
        config.use_cache = bool(config.is_decoder)
    model.model.config.use_cache = False  # what the advice said before: the top-level config only
    with pytest.raises(RuntimeUsageError, match=r"layer 'model\.decoder\.block\.0' is called with a key/value cache"
                                                r".*on every config the model holds"), \
            PlanExport(plan, a.graph, model).installed(model):
        a.w.loss_fn(model(a.w.batch)).backward()
    for config in configs:
        config.use_cache = False
    with PlanExport(plan, a.graph, model).installed(model):
        assert compare(a.reference, step(a.w, model)) == "exact"
