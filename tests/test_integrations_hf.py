"""The plan inside the Hugging Face Trainer (slackswap.integrations.hf, docs/integrations.md).

Three Trainer steps on the example's random-weight Llama-like decoder and T5 (examples/hf_trainer.py),
without and with `plan_for`: the logged losses and every gradient the optimizer steps on equal bit for
bit, and the first step's measured peak (the runtime's ledger) equals the predicted one and is within
the budget. The conflicting settings are refused before any step runs."""

from __future__ import annotations

import re
import runpy

import pytest

from pipelines.schemas import REPO_ROOT
from tests.extras import require_torch_extra

torch = require_torch_extra()
transformers = require_torch_extra("transformers")
require_torch_extra("accelerate")
TrainerCallback = transformers.TrainerCallback

from slackswap.integrations.hf import plan_for  # noqa: E402
from slackswap.integrations.planning import IntegrationError  # noqa: E402
from slackswap.plan import Decision  # noqa: E402

EXAMPLE = REPO_ROOT / "examples" / "hf_trainer.py"
ex = runpy.run_path(str(EXAMPLE))


class Grads(TrainerCallback):
    """Every gradient the optimizer is about to step on."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs) -> None:
        self.steps.append([p.grad.detach().clone() for p in model.parameters()])


def _train(kind: str, tmp_path, plan: dict | None, steps: int = 3, accumulation: int = 1, **args: object):
    grads = Grads()
    trainer = ex["make_trainer"](kind, str(tmp_path / ("plan" if plan else "plain")), steps, accumulation, [grads],
                                 **args)
    lines: list[str] = []
    planned = plan_for(trainer, printer=lines.append, **plan) if plan is not None else None
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, grads.steps, planned, lines, trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`_train` shared by this module's tests: the same training (model, plan arguments, steps) runs once.
    The Trainer writes nothing (save_strategy="no"), and the tests only read what it returns."""
    runs: dict[str, tuple] = {}

    def train(kind: str, plan: dict | None, steps: int = 3, **args: object):
        key = repr((kind, plan, steps, sorted(args.items())))
        if key not in runs:
            runs[key] = _train(kind, tmp_path_factory.mktemp("trained"), plan, steps, **args)
        return runs[key]

    return train


def _assert_same_training(plain, planned) -> None:
    assert len(plain[0]) == len(planned[0]) > 0
    assert plain[0] == planned[0]
    assert len(plain[1]) == len(planned[1]) > 0
    for a, b in zip(plain[1], planned[1], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _assert_predicted_and_within_budget(state, lines) -> None:
    p = state.planned
    assert p is not None and any(d != Decision.KEEP for d in p.plan.decisions.values())
    assert len(state.logged) == 1
    figures = state.logged[0]
    assert figures["slackswap/measured_peak_bytes"] == p.predicted_peak_bytes <= p.budget_bytes
    assert figures["slackswap/within_budget"] == 1.0
    assert p.budget_bytes < p.keep_all_peak_bytes
    assert len(lines) == 1 and f"predicted peak {p.predicted_peak_bytes} B" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "budget"), [("llama", 0.5), ("t5", 0.6)])
def test_three_trainer_steps_under_the_plan_are_bit_exact_within_budget(kind, budget, trained) -> None:
    plain = trained(kind, None)
    planned = trained(kind, {"budget": budget})
    _assert_same_training(plain, planned)
    _assert_predicted_and_within_budget(planned[2], planned[3])
    # the trainer's own log has the prediction and the measurement of the verified step
    logged = [h for h in planned[4].state.log_history if "slackswap/measured_peak_bytes" in h]
    assert len(logged) == 1 and logged[0]["slackswap/predicted_peak_bytes"] == planned[2].planned.predicted_peak_bytes


@pytest.mark.slow
def test_gradient_accumulation_under_the_plan_is_bit_exact(tmp_path) -> None:
    plain = _train("llama", tmp_path, None, steps=2, accumulation=2)
    planned = _train("llama", tmp_path, {"budget": 0.5}, steps=2, accumulation=2)
    _assert_same_training(plain, planned)
    assert planned[2].steps == 4  # one planned step per micro-batch


def _varied_rows(n: int) -> list[dict[str, torch.Tensor]]:
    """Token rows 40 to 64 long, as text is."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(40, 65, (n,), generator=g).tolist()
    return [{"input_ids": (x := torch.randint(1, 128, (k,), generator=g)), "labels": x.clone()} for k in lengths]


def _pad(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding (DataCollatorWithPadding's): each batch to its own longest row, with its mask."""
    longest = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": torch.zeros(len(rows), longest, dtype=torch.long),
             "attention_mask": torch.zeros(len(rows), longest, dtype=torch.long),
             "labels": torch.full((len(rows), longest), -100)}
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        batch["input_ids"][i, :k], batch["labels"][i, :k] = r["input_ids"], r["labels"]
        batch["attention_mask"][i, :k] = 1
    return batch


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["runtime", "export"])
def test_dynamic_padding_and_a_short_last_batch_are_planned_per_shape_bit_exact(executor, tmp_path) -> None:
    """Before, a plan described the first batch's shape and the next batch of another stopped training."""
    runs = []
    for planned in (False, True):
        grads = Grads()
        trainer = ex["make_trainer"]("llama", str(tmp_path / f"{executor}{planned}"), 6, 1, [grads])
        trainer.train_dataset, trainer.data_collator = _varied_rows(7), _pad  # 2, 2, 2, 1 rows an epoch
        state = plan_for(trainer, budget=0.6, executor=executor, printer=lambda _: None) if planned else None
        trainer.train()
        runs.append((grads.steps, [h["loss"] for h in trainer.state.log_history if "loss" in h], state))
    (plain, plain_losses, _), (steps, losses, state) = runs
    assert losses == plain_losses and len(steps) == len(plain) == 6
    assert all(torch.equal(a, b) for x, y in zip(plain, steps, strict=True) for a, b in zip(x, y, strict=True))
    shapes = [p.graph.meta["input_signature"][0][0] for p in state.plans]
    assert len({p.graph.name for p in state.plans}) == len(shapes) >= 3
    assert any(rows == 1 for rows, _ in shapes)  # the short last batch has its own plan
    if executor == "runtime":
        assert len(state.logged) == len(state.plans)  # each shape's first step verified
        assert all(f["slackswap/measured_peak_bytes"] == f["slackswap/predicted_peak_bytes"] for f in state.logged)


@pytest.mark.parametrize(("collator", "warns"), [
    ({}, True), ({"padding": "longest"}, True), ({"pad_to_multiple_of": 64}, False), ({"padding": "max_length"}, False),
    (None, False)])
def test_a_collator_padding_each_batch_to_its_longest_row_warns_before_training(collator, warns, tmp_path) -> None:
    """Every sequence length is then a plan of its own, and the batch past max_shapes stops training."""
    import warnings

    trainer = ex["make_trainer"]("llama", str(tmp_path))
    if collator is not None:  # None: the Trainer's default_data_collator, which stacks rows as they are
        trainer.data_collator = transformers.DataCollatorWithPadding(tokenizer=None, **collator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan_for(trainer, budget=0.5, max_shapes=4, printer=lambda _: None)
    said = [str(w.message) for w in caught if str(w.message).startswith("slackswap:")]
    assert said == (["slackswap: the trainer's data collator (DataCollatorWithPadding) pads each batch to its longest "
                     "row with pad_to_multiple_of=None: each sequence length is a batch shape with a plan of its own "
                     "(one capture each), and the batch past max_shapes=4 stops training; set pad_to_multiple_of "
                     "(64, say) or pad to a max_length"] if warns else [])


@pytest.mark.slow
def test_bf16_trainer_steps_under_the_plan_are_bit_exact_within_budget(tmp_path, trained) -> None:
    """`bf16=True`: Accelerate's autocast wraps the prepared model's forward and the plan is captured
    through it (its keep-all peak below the fp32 capture's)."""
    plain = _train("llama", tmp_path, None, bf16=True)
    planned = _train("llama", tmp_path, {"budget": 0.5}, bf16=True)
    assert planned[4].accelerator.mixed_precision == "bf16"
    _assert_same_training(plain, planned)
    _assert_predicted_and_within_budget(planned[2], planned[3])
    fp32 = trained("llama", {"budget": 0.5})  # its plan, made at the first step
    assert planned[2].planned.keep_all_peak_bytes < fp32[2].planned.keep_all_peak_bytes


@pytest.mark.slow
def test_the_export_runs_the_trainer_steps_bit_exact(tmp_path, trained) -> None:
    plain = trained("llama", None)
    planned = _train("llama", tmp_path, {"budget": 0.8, "planner": "recompute_knapsack", "executor": "export"})
    _assert_same_training(plain, planned)
    assert planned[2].planned.plan.notes.get("export_executor") == "eager"


@pytest.mark.parametrize("setting", ["activation_checkpointing", "gradient_checkpointing"])
def test_hf_gradient_checkpointing_is_refused_before_training(setting, tmp_path) -> None:
    """transformers 5's name and its deprecated alias (gradient_checkpointing) alike."""
    trainer = ex["make_trainer"]("llama", str(tmp_path), **{setting: True})
    with pytest.raises(IntegrationError, match=r"^TrainingArguments.activation_checkpointing=True: .*set it to False"):
        plan_for(trainer, budget=0.5)


def test_layerdrop_is_refused_for_the_runtime_before_training(tmp_path) -> None:
    """LayerDrop skips other layers on each step: the runtime's steps are the captured one's (its hook-only
    steps refuse another path), so a model configured with it is refused up front, pointing to the export."""
    trainer = ex["make_trainer"]("llama", str(tmp_path))
    trainer.model.config.layerdrop = 0.1
    with pytest.raises(IntegrationError, match=r"^model\.config\.layerdrop=0\.1: LayerDrop .*executor='export'"):
        plan_for(trainer, budget=0.5)
    plan_for(trainer, budget=0.5, executor="export")  # the export re-runs each layer's own forward


def test_spec_augment_is_refused_for_the_runtime_before_training() -> None:
    """wav2vec 2.0's SpecAugment (on by default, `mask_time_prob=0.05`) draws a count of masked spans with
    numpy.random each training step: under the runtime every step runs verified and one with another count
    than the captured step's is refused mid-training, so the runtime is refused up front."""
    import transformers

    from slackswap.integrations.planning import check_layerdrop

    config = transformers.Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, conv_dim=(8,), conv_stride=(5,), conv_kernel=(10,),
                                         num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, layerdrop=0.0)
    model = transformers.Wav2Vec2Model(config)
    refusal = r"^model\.config\.mask_time_prob=0\.05: SpecAugment .*executor='export'"
    with pytest.raises(IntegrationError, match=refusal):
        check_layerdrop(model, "runtime")
    check_layerdrop(model, "export")
    config.mask_time_prob = 0.0
    check_layerdrop(model, "runtime")
    config.apply_spec_augment, config.mask_feature_prob = False, 0.1  # no augmentation: nothing drawn
    check_layerdrop(model, "runtime")


@pytest.mark.parametrize(("field", "value", "match"), [
    ("executor", "compiled", r"^executor='compiled': must be one of runtime, export"),
    ("verify_steps", 0, r"^verify_steps=0: must be a positive integer"),
])  # fmt: skip
def test_bad_arguments_are_one_line(field, value, match, tmp_path) -> None:
    trainer = ex["make_trainer"]("llama", str(tmp_path))
    with pytest.raises(IntegrationError, match=match):
        plan_for(trainer, **{field: value})


@pytest.mark.slow
def test_a_budget_the_model_cannot_meet_stops_before_the_first_step(tmp_path) -> None:
    trainer = ex["make_trainer"]("llama", str(tmp_path))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    plan_for(trainer, budget=0.1, printer=lambda _: None)
    with pytest.raises(IntegrationError, match=r"^budget=0.1: \d+ B cannot be met by slackswap"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


@pytest.mark.slow
def test_a_plan_made_for_another_batch_shape_is_refused(tmp_path, trained) -> None:
    made = trained("llama", {"budget": 0.5})[2].planned  # made at the first step
    trainer = ex["make_trainer"]("llama", str(tmp_path / "other"), batch=1)
    plan_for(trainer, plan=made, printer=lambda _: None)
    with pytest.raises(IntegrationError, match=r"^plan.graph.meta\['input_signature'\]=.*another input"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.slow
def test_the_example_runs_and_prints_the_certified_gap(capsys) -> None:
    ex["main"](["--steps", "1", "--certify"])
    out = capsys.readouterr().out
    assert "slackswap: slackswap plan (runtime)" in out and "llama: 1 steps" in out
    gap = float(re.search(r"certified gap (-?[\d.]+) %", out).group(1))
    assert gap >= 0.0  # the milp bound is a lower bound on every plan's step, slackswap's included


@pytest.mark.slow
def test_the_example_runs_t5(capsys) -> None:
    ex["main"](["--model", "t5", "--budget", "0.6", "--steps", "1"])
    out = capsys.readouterr().out
    peaks = re.search(r"t5: 1 steps, .*measured peak \[(\d+)\] B, predicted (\d+) B, budget (\d+) B", out)
    assert peaks and int(peaks.group(1)) == int(peaks.group(2)) <= int(peaks.group(3))


def test_a_compute_loss_that_calls_the_model_twice_is_refused(tmp_path) -> None:
    trainer = ex["make_trainer"]("llama", str(tmp_path))

    def twice(model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss + model(**inputs).loss

    trainer.compute_loss = twice
    plan_for(trainer, budget=0.5, printer=lambda _: None)
    with pytest.raises(IntegrationError, match=r"^compute_loss='a second model call'"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert "forward" not in trainer.model.__dict__  # the capture's keyword call undone


@pytest.mark.slow
def test_the_trainer_asked_for_fsdp2_on_two_cpu_ranks_is_refused_in_one_line(tmp_path) -> None:
    """Two CPU processes (gloo, tests/hf_fsdp2_worker.py): `fsdp_config={"fsdp_version": 2}` leaves
    Accelerate at MULTI_CPU and the Trainer trains in DDP, so `plan_for` refuses it naming that; a
    model sharded with `fully_shard` before the Trainer fails in the Trainer's own DDP wrap."""
    import json
    import subprocess
    import sys

    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "hf_fsdp2_worker.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (r["distributed_type"], r["is_fsdp2"], r["trained_in"]) == ("MULTI_CPU", "False",
                                                                          "DistributedDataParallel")
        assert r["refused"] == ("accelerator.distributed_type='MULTI_CPU': on the CPU the Trainer wraps the model in "
                                "DDP (Accelerate ignores fsdp_version=2 there), which a plan does not run under; "
                                "for FSDP2 use slackswap.integrations.accelerate.plan_for in an Accelerate loop")
        assert "got mixed torch.Tensor and DTensor" in r["presharded_error"]
