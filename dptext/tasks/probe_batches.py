"""Synthetic batches in each task's format, for the privacy engine's start-up probe (docs/privacy_engine.md).

The probe checks the engine against brute-force per-example autograd *with the task's own per-example loss*, so it
needs batches that loss accepts: the same keys, shapes and label conventions as ``task.collate`` produces. They are
built from random ids within the model's vocabulary and random labels within the declared label sets — never from
a record — so the probe costs no privacy. Every tensor has the examples as its first dimension (the probe re-draws
one example's row of each to check that examples do not interact) and its shape depends only on (examples,
positions), never on the draw; the first example is full length, the others are right-padded to random lengths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dptext.errors import UserError
from dptext.privacy.proof.synthetic import random_token_batch as token_batch
from dptext.tasks.encoding import IGNORE_INDEX


def vocab_size(model) -> int:
    """The number of input ids the model embeds (HF config, the CLC encoder's word vocabulary, or its embedding)."""
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None) or getattr(config, "word_vocab", None)
    if not size and hasattr(model, "get_input_embeddings"):
        size = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if not size:
        raise UserError("The start-up probe cannot tell this model's vocabulary size, so it cannot build synthetic "
                        "inputs; set privacy.verify=false only if the model is covered by the engine's tests.")
    return int(size)


def random_labels(generator: torch.Generator, classes: int, shape: tuple[int, ...]) -> Tensor:
    return torch.randint(0, max(classes, 1), shape, generator=generator)


def language_model_batch(vocab: int, generator: torch.Generator, examples: int, positions: int) -> dict[str, Tensor]:
    """Ids, mask and causal-LM labels: the ids, with -100 at padding and on a random prompt prefix (control codes,
    tables and dialog histories carry no loss)."""
    batch = token_batch(vocab, generator, examples, positions)
    prompt = torch.randint(0, max(1, positions // 2), (examples, 1), generator=generator)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
    batch["labels"] = labels.masked_fill(torch.arange(positions)[None, :] < prompt, IGNORE_INDEX)
    return batch


def mask_one_position(batch: dict[str, Tensor], mask_token_id: int, generator: torch.Generator) -> None:
    """Infilling: one [MASK] at a random real position of each example, its index in ``mask_position``."""
    lengths = batch["attention_mask"].sum(dim=1)
    position = (torch.rand(len(lengths), generator=generator) * lengths).long().clamp(max=lengths - 1)
    batch["input_ids"][torch.arange(len(lengths)), position] = mask_token_id
    batch["mask_position"] = position


def word_tag_fields(batch: dict[str, Tensor], tags: int, generator: torch.Generator) -> None:
    """Intent-slot: every real position is a word (``word_index``), tagged at random; padding is -100."""
    examples, positions = batch["input_ids"].shape
    real = batch["attention_mask"].bool()
    word_tags = random_labels(generator, tags, (examples, positions)).masked_fill(~real, IGNORE_INDEX)
    batch["slot_labels"] = word_tags.clone()
    batch["word_index"] = torch.arange(positions).expand(examples, -1).clone()
    batch["word_tags"] = word_tags
    batch["word_mask"] = batch["attention_mask"].clone()


def char_ids(batch: dict[str, Tensor], char_vocab: int, generator: torch.Generator, length: int = 4) -> Tensor:
    """(B, W, L) random characters of each real word (1..L of them, 0 after), zero rows for padded words."""
    examples, words = batch["input_ids"].shape
    chars = torch.randint(2, max(char_vocab, 3), (examples, words, length), generator=generator)
    counts = torch.randint(1, length + 1, (examples, words, 1), generator=generator)
    present = (torch.arange(length)[None, None, :] < counts) & batch["attention_mask"].bool()[..., None]
    return chars.masked_fill(~present, 0)
