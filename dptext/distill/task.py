"""The distillation objective as a fine-tuning task: the causal-LM task with the teacher in the loss.

Encoding, batching and evaluation are ``LanguageModelingTask``'s (control code as the prompt,
loss on the text, perplexity on held-out records), so the student is trained and scored on
exactly the text format the teacher learnt. Teacher logits are computed on the fly, without
gradients; the teacher is not part of the student's parameters (nor of a DP engine's hooks).
"""

from __future__ import annotations

from typing import Any

import torch

from dptext.distill.loss import distillation_loss
from dptext.errors import UserError
from dptext.tasks.language_modeling import LanguageModelingTask
from dptext.tasks.probe_batches import vocab_size


class DistillationTask(LanguageModelingTask):
    def __init__(self, recipe: Any, tokenizer: Any, teacher: Any):
        super().__init__(recipe, tokenizer)
        self.teacher = teacher
        self.kd_lambda = recipe.distill.kd_lambda
        self.temperature = recipe.distill.temperature
        self.hidden_alpha = recipe.distill.hidden_alpha

    def check_hidden_sizes(self, student: Any) -> None:
        """The MSE term compares last hidden states, so their sizes must match (GPT-2 → DistilGPT2: 768 = 768)."""
        sizes = [getattr(m.config, "hidden_size", None) or getattr(m.config, "n_embd", None)
                 for m in (self.teacher, student)]
        if self.hidden_alpha > 0 and sizes[0] != sizes[1]:
            raise UserError(f"distill.hidden_alpha > 0 needs equal hidden sizes, but the teacher has {sizes[0]} and "
                            f"the student {sizes[1]}; set distill.hidden_alpha=0 or pick a matching student.")

    def probe_vocab(self, model: Any) -> int:
        """The start-up probe's synthetic ids go through the teacher too: within both vocabularies."""
        return min(vocab_size(model), vocab_size(self.teacher))

    def per_example_loss(self, model: Any, batch: dict[str, Any]):
        wants_hidden = self.hidden_alpha > 0
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        student = model(**inputs, output_hidden_states=wants_hidden)
        with torch.no_grad():
            teacher = self.teacher(**inputs, output_hidden_states=wants_hidden)
        return distillation_loss(
            student.logits, batch["labels"], batch["attention_mask"], teacher_logits=teacher.logits,
            kd_lambda=self.kd_lambda, temperature=self.temperature, hidden_alpha=self.hidden_alpha,
            student_hidden=student.hidden_states[-1] if wants_hidden else None,
            teacher_hidden=teacher.hidden_states[-1] if wants_hidden else None, reduction=self.reduction)

    # the teacher's logits span the whole vocabulary: the probe's second shape must not cut the student's
    # (``dptext.privacy.proof.vocabulary``)
    per_example_loss.needs_whole_vocabulary = True
