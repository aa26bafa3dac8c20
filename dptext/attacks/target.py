"""Reload a finished fine-tuning run for auditing: its recipe, task, tokenizer and trained model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptext.attacks.audit_records import read_records
from dptext.errors import UserError
from dptext.models import load_model, load_tokenizer
from dptext.runs import MODEL_DIR, RunDir
from dptext.tasks import build_task
from dptext.tasks.pooling import MeanPoolingClassifier


@dataclass
class TrainedRun:
    path: Path
    recipe: Any
    task: Any
    model: Any
    tokenizer: Any
    result: dict


def load_model_dir(recipe: Any, task: Any, model_dir: Path) -> Any:
    """The model ``dptext finetune`` saved in ``model_dir`` (mean-pooling heads and LoRA adapters included)."""
    if task.head == "sequence_classification" and recipe.task.pooling == "mean":
        return MeanPoolingClassifier.from_pretrained(model_dir)
    if recipe.model.adaptation == "lora":  # the folder holds the adapters; the base model is the recipe's
        from peft import PeftModel  # optional dependency: only LoRA runs need peft

        return PeftModel.from_pretrained(task.load_model(), str(model_dir)).eval()
    model, _ = load_model(str(model_dir), head=task.head, num_labels=task.num_labels)
    return model


def load_trained_run(run_dir: str | Path, device: str = "cpu") -> TrainedRun:
    run = RunDir.open(run_dir).lock()  # the audit writes its report into the run: one writer at a time
    result = run.load_result()
    model_dir = run.path / MODEL_DIR
    if result is None or not model_dir.is_dir():
        raise UserError(f"Run '{run_dir}' has not finished (no result.json or model/); finish it with "
                        f"`dptext finetune --resume {run_dir}` before auditing it.")
    recipe = run.recipe()
    tokenizer = load_tokenizer(str(model_dir))
    members = [row["record"] for row in read_records(run.path, "members")]
    task = build_task(recipe, tokenizer, members)
    model = load_model_dir(recipe, task, model_dir).to(device).eval()
    return TrainedRun(run.path, recipe, task, model, tokenizer, result)
