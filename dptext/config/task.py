"""The ``task`` section of a recipe: the objective and its public label/template inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from dptext.config.fields import doc


@dataclass
class TaskConfig:
    type: Literal["table_to_text", "dialog", "language_modeling", "classification", "infilling", "intent_slot"] = doc(
        "table_to_text", "Training objective and evaluation.")
    loss_reduction: Literal["sum", "mean"] = doc(
        "mean", "How each example's token losses are reduced: summed, or averaged over that example's own tokens.")
    pooling: Literal["model", "mean"] = doc(
        "model", "Input of a classification (or intent_slot intent) head: the model's own (BERT: pooled [CLS]) "
        "or the masked mean of the last hidden states (what sentence-transformers models such as minilm-l6 are "
        "trained for).")
    template: Optional[str] = doc(None, "Infilling template override, e.g. '<S1> It was [MASK] .' (default: SPEC §8).")
    label_words: list = doc([], "Infilling label words in label order (default: SPEC §8 for the task).")
    control_codes: list = doc([], "Record fields prepended as control codes, e.g. [category, rating].")
    labels: list = doc([], "classification: the classes in label order, a public input taken from the dataset's "
                       "documentation, never read from the records; a label equal to a class is that class, an "
                       "integer label indexes the list. Empty: the dataset's published label names (sst2, imdb, "
                       "...); your own files must declare them.")
    intents: list = doc([], "intent_slot: the declared intents (public, from the dataset's documentation).")
    slot_types: list = doc([], "intent_slot: the declared slot types; the BIO tags are O, B-<type> and I-<type>.")
    other_label: Optional[str] = doc(None, "A declared class or intent that training records with a label outside "
                                     "the declared set are mapped to (their undeclared slot tags become O); empty "
                                     "refuses such a record before training, naming its position.")
    code_domain: dict = doc({}, "Every value each control-code field can take, declared from public documentation, "
                            "e.g. {rating: [1, 2, 4, 5]}; `dptext synth` draws codes from a DP histogram over it.")
    crf: bool = doc(False, "intent_slot: a linear-chain CRF slot layer over the words (its transitions are clipped "
                    "and noised like every other parameter) instead of per-token softmax.")
