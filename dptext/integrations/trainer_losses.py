"""Per-example losses for the models a Hugging Face Trainer trains, and the probe's synthetic batches for them.

The Trainer's ``compute_loss`` returns the model's batch mean; DP-SGD clips each example's gradient, so it needs
one loss per example (SPEC §1). Two heads are recognised from the model class (the ``AutoModelFor...`` mappings):
* causal LM: next-token cross-entropy per example over its own labelled tokens (labels -100 and padding count
  for nothing), summed or averaged over them (``reduction``);
* sequence classification with integer labels: one cross-entropy per example.
Anything else (regression, multi-label, seq2seq, token classification, a custom model) is refused before training
unless the caller gives its own per-example loss ``loss(model, batch) -> Tensor of shape (B,)``.

The probe (``PrivacyEngine.verify``) runs the same loss on synthetic batches of the same format — random ids and
labels, never a record — so it checks the loss that trains, including that examples do not interact in it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)

from dptext.errors import UserError
from dptext.privacy import per_example_loss
from dptext.tasks.probe_batches import language_model_batch, random_labels, vocab_size
from dptext.privacy.proof.synthetic import random_token_batch

LossFn = Callable[[nn.Module, dict[str, Tensor]], Tensor]
BatchMaker = Callable[[int, int, torch.Generator], dict[str, Tensor]]


def _class_names(mapping: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for value in mapping.values():
        names.update(value if isinstance(value, (tuple, list)) else [value])
    return names


CAUSAL_LM_CLASSES = _class_names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
SEQUENCE_CLASSIFICATION_CLASSES = _class_names(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (which names the head by its own class)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def head_of(model: nn.Module) -> str | None:
    """``causal_lm``, ``sequence_classification`` or None (a head this module has no per-example loss for)."""
    name = type(base_model(model)).__name__
    if name in CAUSAL_LM_CLASSES:
        return "causal_lm"
    if name in SEQUENCE_CLASSIFICATION_CLASSES:
        config = getattr(base_model(model), "config", None)
        single_label = getattr(config, "problem_type", None) in (None, "single_label_classification")
        return "sequence_classification" if single_label and getattr(config, "num_labels", 0) > 1 else None
    return None


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch without its labels: the model must not compute its own batch-mean loss."""
    return {k: v for k, v in batch.items() if k not in ("labels", "label", "label_ids")}


def labels_of(batch: dict[str, Any]) -> Tensor:
    for key in ("labels", "label", "label_ids"):
        if key in batch:
            return batch[key]
    raise UserError("A training batch has no 'labels'; use a data collator that sets them (for causal LMs "
                    "DataCollatorForLanguageModeling(tokenizer, mlm=False)).")


def causal_lm_loss_fn(reduction: str) -> LossFn:
    def causal_lm_per_example_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        logits = model(**model_inputs(batch)).logits
        return per_example_loss(logits, labels_of(batch), batch.get("attention_mask"), shift=True,
                                reduction=reduction)

    return causal_lm_per_example_loss


def sequence_classification_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    labels = labels_of(batch)
    if labels.ndim != 1 or labels.is_floating_point():
        raise UserError("DPTrainer's sequence-classification loss needs one integer label per example; for "
                        "regression or multi-label targets pass per_example_loss=your_loss(model, batch).")
    return per_example_loss(model(**model_inputs(batch)).logits, labels)


def loss_and_probe_batch(model: nn.Module, reduction: str, loss: LossFn | None,
                         probe_batch: BatchMaker | None) -> tuple[LossFn, BatchMaker]:
    """The per-example loss that trains and the probe's synthetic batch maker for it; refuses an unknown head."""
    head = head_of(model)
    vocab = vocab_size(base_model(model))
    if loss is not None:
        return loss, probe_batch or (lambda b, t, g: language_model_batch(vocab, g, b, t))
    if head == "causal_lm":
        return causal_lm_loss_fn(reduction), probe_batch or (lambda b, t, g: language_model_batch(vocab, g, b, t))
    if head == "sequence_classification":
        classes = base_model(model).config.num_labels

        def classification_batch(examples: int, positions: int, generator: torch.Generator) -> dict[str, Tensor]:
            batch = random_token_batch(vocab, generator, examples, positions)
            batch["labels"] = random_labels(generator, classes, (examples,))
            return batch

        return sequence_classification_loss, probe_batch or classification_batch
    raise UserError(f"DPTrainer has no per-example loss for {type(base_model(model)).__name__} (it knows causal "
                    "LMs and single-label sequence classification); pass per_example_loss=fn(model, batch) "
                    "returning one loss per example.")
