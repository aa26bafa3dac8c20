"""Fine-tune SmolLM2-135M on E2E with a plain Hugging Face Trainer script, made differentially private by dptext.

Everything below is an ordinary Trainer script except the lines marked "DP": the Trainer class becomes DPTrainer
and the privacy settings are passed in (docs/integrations.md). Offline: the model is the packaged SmolLM2-135M
(`dptext.models.load_model("smollm2-135m")`), the data the E2E csv files in ../shared/data/e2e_nlg.

    python examples/hf_trainer_dp.py                                   # 128 examples, 3 DP steps, CPU, minutes
    python examples/hf_trainer_dp.py --train-examples 2000 --max-steps 60 --expected-batch-size 128
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_dp.py            # 2 processes (gloo on CPU)
    accelerate launch --num_processes 2 examples/hf_trainer_dp.py                 # the same under accelerate

The logged `loss` is the training batch's mean (not covered by ε: it is a statistic of the private batch);
`epsilon` is what the run has spent at δ = 1/(2n). The eval loss is on E2E's validation split.
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

from transformers import DataCollatorForSeq2Seq, TrainingArguments

from dptext.integrations import DPTrainer, PrivacyArguments, end_process_group  # DP
from dptext.models import load_model

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "e2e_nlg"


def read_pairs(path: Path, limit: int) -> list[tuple[str, str]]:
    with open(path, encoding="utf-8", newline="") as handle:
        rows = csv.reader(handle)
        next(rows)  # header: mr, ref
        return [(row[0], row[1]) for row, _ in zip(rows, range(limit))]


def tokenize(pairs, tokenizer, max_length: int) -> list[dict]:
    """Prompt "<table> ||" then the reference; only the reference's tokens carry the loss (labels -100 elsewhere)."""
    examples = []
    for table, reference in pairs:
        prompt = tokenizer(f"{table} ||", add_special_tokens=False)["input_ids"]
        target = tokenizer(f" {reference}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        target = target[:max(max_length // 2, max_length - len(prompt))]  # keep at least half for the target
        prompt = prompt[:max_length - len(target)]
        ids, labels = prompt + target, [-100] * len(prompt) + target
        examples.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="an offline alias, hub name or folder")
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("DPTEXT_E2E", DEFAULT_DATA)))
    parser.add_argument("--train-examples", type=int, default=128)
    parser.add_argument("--eval-examples", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--expected-batch-size", type=int, default=16, help="B, the expected Poisson batch")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="physical batch (does not change privacy)")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--max-grad-norm", type=float, default=0.1)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--out", default="runs/hf-trainer-dp")
    options = parser.parse_args()
    if not (options.data / "trainset.csv").is_file():
        raise SystemExit(f"E2E not found at {options.data}; pass --data FOLDER with trainset.csv and devset.csv.")

    model, tokenizer = load_model(options.model, head="causal_lm")
    train = tokenize(read_pairs(options.data / "trainset.csv", options.train_examples), tokenizer, options.max_length)
    valid = tokenize(read_pairs(options.data / "devset.csv", options.eval_examples), tokenizer, options.max_length)
    args = TrainingArguments(
        output_dir=options.out, max_steps=options.max_steps, per_device_train_batch_size=options.micro_batch_size,
        per_device_eval_batch_size=options.micro_batch_size, learning_rate=options.learning_rate, optim="adamw_torch",
        weight_decay=0.0, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, max_grad_norm=0.0,  # DP: the engine clips each example; the Trainer's clipping stays off
    )
    privacy = PrivacyArguments(target_epsilon=options.epsilon, max_grad_norm=options.max_grad_norm,  # DP
                               expected_batch_size=options.expected_batch_size)  # DP
    trainer = DPTrainer(model=model, args=args, train_dataset=train, eval_dataset=valid,  # DP: was Trainer
                        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True), privacy=privacy)  # DP
    trainer.train()
    metrics = trainer.evaluate()
    report = trainer.privacy_report()
    if trainer.is_world_process_zero():
        print(f"validation loss {metrics['eval_loss']:.3f}; ε = {report['epsilon']:.3f} at δ = {report['delta']:.2g} "
              f"after {report['steps']} steps (σ = {report['noise_multiplier']:.3f}, q = {report['sample_rate']:.4f})")
        trainer.save_model(options.out)
    end_process_group()  # under torchrun every rank leaves the process group together (a no-op in one process)


if __name__ == "__main__":
    main()
