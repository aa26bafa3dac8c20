"""Training objectives: how records become tokens, per-example losses and evaluation metrics.

``build_task(recipe, tokenizer, train_records)`` picks the task of ``recipe.task.type``:

=================  ===========================  =========================================
task.type          model head                   metrics
=================  ===========================  =========================================
language_modeling  causal LM                    perplexity (control codes optional)
table_to_text      causal LM                    BLEU, ROUGE-L (beam search), perplexity
dialog             causal LM                    token F1, perplexity
classification     sequence classification      accuracy
infilling          masked LM (template + words) accuracy
intent_slot        encoder + intent/slot heads  SER, intent accuracy, slot F1 (CRF optional)
=================  ===========================  =========================================

``text_format`` turns records into model text; ``encoding`` tokenises with loss masks;
``generation`` runs batched beam search for evaluation.
"""

from __future__ import annotations

from typing import Any, Sequence

from dptext.errors import UserError
from dptext.tasks.classification import ClassificationTask
from dptext.tasks.infilling import InfillingTask
from dptext.tasks.intent_slot import IntentSlotTask
from dptext.tasks.language_modeling import DialogTask, LanguageModelingTask, TableToTextTask


def build_task(recipe: Any, tokenizer: Any, train_records: Sequence[dict[str, Any]]):
    kind = recipe.task.type
    if kind == "language_modeling":
        return LanguageModelingTask(recipe, tokenizer)
    if kind == "table_to_text":
        return TableToTextTask(recipe, tokenizer)
    if kind == "dialog":
        return DialogTask(recipe, tokenizer)
    if kind == "classification":
        return ClassificationTask(recipe, tokenizer, train_records)
    if kind == "infilling":
        return InfillingTask(recipe, tokenizer, train_records)
    if kind == "intent_slot":
        return IntentSlotTask(recipe, tokenizer, train_records)
    raise UserError(f"task.type '{kind}' is unknown; choose language_modeling, table_to_text, dialog, "
                    "classification, infilling or intent_slot.")
