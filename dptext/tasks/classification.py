"""Sentence(-pair) classification with a classification head on any encoder (or decoder).

Records carry ``text`` (and ``text_pair`` for pair tasks such as QNLI/MNLI/QQP) and a ``label``; the metric
is accuracy. The classes are declared, never counted from the data (``dptext.tasks.label_sets``): the
recipe's ``task.labels`` or the dataset's published label names give the head's size, a label is mapped
through them, and a training record with a label outside them is refused before training (or mapped to
``task.other_label``). The head is new and randomly initialised, as in Li et al.'s
"full fine-tuning with a classification head" rows.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from dptext import metrics
from dptext.data import label_names
from dptext.errors import UserError
from dptext.models import load_model
from dptext.models.modes import evaluating
from dptext.privacy.losses import per_example_loss
from dptext.tasks.base import Task, batches
from dptext.tasks.encoding import IGNORE_INDEX, Example
from dptext.tasks.label_sets import check_records, class_index, declared_classes, other_index
from dptext.tasks.pooling import MeanPoolingClassifier
from dptext.tasks.probe_batches import random_labels, token_batch, vocab_size


class ClassificationTask(Task):
    head = "sequence_classification"
    primary_metric = "accuracy"
    higher_is_better = True

    def __init__(self, recipe: Any, tokenizer: Any, train_records: Sequence[dict[str, Any]]):
        super().__init__(recipe, tokenizer)
        self.classes = declared_classes(recipe, label_names(recipe.data.dataset))
        self._num_labels = len(self.classes)
        self.other = other_index(recipe, self.classes, "task.labels")
        check_records(train_records, lambda r: class_index(r.get("label"), self.classes) is not None,
                      self.other is not None, "label", "task.labels")

    def label_index(self, record: dict[str, Any]) -> int:
        """The record's class id; an undeclared label (evaluation only: training refused it) is the "other" class
        when the recipe has one, else ignored by the loss and scored wrong."""
        index = class_index(record["label"], self.classes)
        if index is not None:
            return index
        return self.other if self.other is not None else IGNORE_INDEX

    @property
    def num_labels(self) -> int:
        return self._num_labels

    def load_model(self):
        if self.recipe.task.pooling != "mean":
            return super().load_model()
        recipe = self.recipe
        encoder, _ = load_model(recipe.model.name, head="base", random_init=recipe.model.adaptation == "retrain",
                                seed=recipe.train.seed)
        return MeanPoolingClassifier(encoder, self.num_labels)

    def encode(self, records: Sequence[dict[str, Any]]) -> list[Example]:
        examples = []
        for record in records:
            if record.get("label") is None:
                raise UserError("A record without a label reached training or evaluation; unlabelled splits "
                                "(e.g. GLUE test) cannot be scored, use the validation split.")
            encoded = self.tokenizer(record["text"], record.get("text_pair"), truncation=True,
                                     max_length=self.max_length)
            extra = {"label": self.label_index(record)}
            if "token_type_ids" in encoded:
                extra["token_type_ids"] = encoded["token_type_ids"]
            examples.append(Example(input_ids=encoded["input_ids"], labels=[], extra=extra))
        return examples

    def collate(self, examples: Sequence[Example]) -> dict[str, Any]:
        width = max((len(e.input_ids) for e in examples), default=0)
        pad = self.tokenizer.pad_token_id
        batch = {
            "input_ids": torch.tensor([e.input_ids + [pad] * (width - len(e.input_ids)) for e in examples],
                                      dtype=torch.long).reshape(len(examples), width),
            "attention_mask": torch.tensor([[1] * len(e.input_ids) + [0] * (width - len(e.input_ids))
                                            for e in examples], dtype=torch.long).reshape(len(examples), width),
            "labels": torch.tensor([e.extra["label"] for e in examples], dtype=torch.long),
        }
        if examples and "token_type_ids" in examples[0].extra:
            batch["token_type_ids"] = torch.tensor(
                [e.extra["token_type_ids"] + [0] * (width - len(e.input_ids)) for e in examples], dtype=torch.long)
        return batch

    def logits(self, model: Any, batch: dict[str, Any]):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return model(**inputs).logits

    def probe_batch(self, model: Any, generator: Any, batch_size: int, seq_len: int) -> dict[str, Any]:
        batch = token_batch(vocab_size(model), generator, batch_size, seq_len)
        batch["labels"] = random_labels(generator, self.num_labels, (batch_size,))
        return batch

    def per_example_loss(self, model: Any, batch: dict[str, Any]):
        return per_example_loss(self.logits(model, batch), batch["labels"])

    def evaluate(self, model: Any, records: Sequence[dict[str, Any]], *, batch_size: int,
                 on_progress: Callable[[int], None] | None = None, journal: Any = None) -> dict[str, float]:
        device = next(model.parameters()).device
        predictions, labels = [], []
        with evaluating(model), torch.no_grad():
            for chunk in batches(self.encode(records), batch_size):
                batch = {k: v.to(device) for k, v in self.collate(chunk).items()}
                predictions += self.logits(model, batch).argmax(-1).tolist()
                labels += batch["labels"].tolist()
                if on_progress:
                    on_progress(len(chunk))
        return {"accuracy": metrics.accuracy(predictions, labels)}
