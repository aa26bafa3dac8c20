"""Tokenised training examples and their padded batches.

An ``Example`` is a prompt and a completion already tokenised; only completion tokens carry
loss (labels = -100 elsewhere), which is how table-to-text, dialog and control-coded
language modelling keep prompt and code tokens out of the objective (SPEC §1: masks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

IGNORE_INDEX = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


def encode_prompt_completion(tokenizer: Any, prompt: str, completion: str, max_length: int) -> Example:
    """Tokens of prompt + completion + EOS, with loss on the completion and EOS only.

    When too long, the prompt keeps its *end* (the cue right before the completion) and the
    completion is cut at ``max_length``; a completion never loses its first tokens.
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        completion_ids = completion_ids + [tokenizer.eos_token_id]
    room_for_prompt = max(max_length - len(completion_ids), max_length // 2)
    prompt_ids = prompt_ids[-room_for_prompt:] if room_for_prompt > 0 else []
    input_ids = (prompt_ids + completion_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + completion_ids)[:max_length]
    return Example(input_ids=input_ids, labels=labels)


def pad_batch(examples: Sequence[Example], pad_id: int, padding_side: str = "right"):
    """Stack examples into ``input_ids``, ``attention_mask``, ``labels`` tensors (labels padded with -100)."""
    width = max((len(e.input_ids) for e in examples), default=0)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        span = slice(0, n) if padding_side == "right" else slice(width - n, width)
        ids[row, span] = torch.tensor(example.input_ids, dtype=torch.long)
        labels[row, span] = torch.tensor(example.labels, dtype=torch.long)
        mask[row, span] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
