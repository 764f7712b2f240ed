"""A plan inside the Hugging Face Trainer: one line, `plan_for(trainer, budget=...)`, before `train()`.

    python examples/hf_trainer.py                         # a Llama-like decoder, half the keep-all peak
    python examples/hf_trainer.py --model t5 --budget 0.6
    python examples/hf_trainer.py --executor export       # PyTorch's selective checkpointing runs it
    python examples/hf_trainer.py --certify               # and the certified gap (milp's bound)

Random-weight models at CPU size (2 layers, width 64), a random token data set, 3 steps: seconds on a
CPU. The plan is made at the start of the first step on the trainer's own first batch; its summary
(predicted peak, step time, certified gap) is printed, and the first step's measured peak is logged
through the trainer beside the prediction (docs/integrations.md).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from slackswap.integrations.hf import plan_for

#: Sequence lengths where activations, not the LM head's logits, make most of the keep-all peak (at
#: sequence 16 the 2-layer Llama's logits and their gradient leave no plan under 70 %).
SEQ = {"llama": 64, "t5": 32}
VOCAB = 128


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer, width-64 Llama-like decoder or T5, random weights from `seed`."""
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=256))
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                               pad_token_id=0))


def tiny_dataset(kind: str, n: int = 8, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Random token rows of one length (a fixed batch shape: the plan is made for one)."""
    g = torch.Generator().manual_seed(seed)
    seq = SEQ[kind]
    if kind == "llama":
        return [{"input_ids": (x := torch.randint(0, VOCAB, (seq,), generator=g)), "labels": x.clone()}
                for _ in range(n)]
    return [{"input_ids": torch.randint(1, VOCAB, (seq,), generator=g),
             "labels": torch.randint(1, VOCAB, (seq // 2,), generator=g)} for _ in range(n)]


def make_trainer(kind: str, output_dir: str, steps: int = 3, accumulation: int = 1,
                 callbacks: list[TrainerCallback] | None = None, batch: int = 2, **args: object) -> Trainer:
    """A Trainer of `steps` optimizer steps over exactly as many full batches (the last batch of an
    epoch is never short); `args` go to `TrainingArguments`."""
    args = {"report_to": [], **args}  # no tracker unless asked
    training = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=accumulation, logging_steps=1, learning_rate=1e-3,
                                 use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True,
                                 **args)  # fmt: skip
    data = tiny_dataset(kind, batch * steps * accumulation)
    return Trainer(model=tiny_model(kind), args=training, train_dataset=data, callbacks=callbacks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SEQ), default="llama")
    parser.add_argument("--budget", type=float, default=0.5, help="share of the keep-all activation peak")
    parser.add_argument("--planner", default="slackswap")
    parser.add_argument("--executor", choices=("runtime", "export"), default="runtime")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--certify", action="store_true", help="bound the step with the milp planner (the gap)")
    a = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(a.model, output_dir, a.steps)
        planned = plan_for(trainer, budget=a.budget, planner=a.planner, executor=a.executor,
                           certify=a.certify)  # the one line
        trainer.train()
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    print(f"{a.model}: {len(losses)} steps, losses {losses}; first step measured peak "
          f"{[f['slackswap/measured_peak_bytes'] for f in planned.logged]} B, predicted "
          f"{planned.planned.predicted_peak_bytes} B, budget {planned.planned.budget_bytes} B")


if __name__ == "__main__":
    main()
