"""Batched generation for evaluation (beam search by default, as in Li et al.'s E2E/DART eval).

This is evaluation of a trained model, not DP decoding: for a per-query privacy guarantee at
inference time use ``dptext decode`` (dptext.decoding), which samples.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


from dptext.models.modes import evaluating
from dptext.tasks.eval_journal import EvaluationJournal, journaled_batches


def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    beam_size: int = 5,
    max_new_tokens: int = 64,
    batch_size: int = 16,
    on_batch: Callable[[int], None] | None = None,
    journal: EvaluationJournal | None = None,
) -> list[str]:
    """The completion generated after each prompt, special tokens removed and whitespace stripped; with a
    ``journal``, batches it already holds are not generated again."""
    device = next(model.parameters()).device
    outputs: list[str] = []
    # Decoder-only models continue from the last position, so prompts are left-padded.
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"

    def generate(chunk: list[str]) -> list[str]:
        batch = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            generated = model.generate(
                **batch, num_beams=beam_size, do_sample=False, max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                early_stopping=beam_size > 1,
            )
        new_tokens = generated[:, batch["input_ids"].shape[1]:]
        return [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]

    try:
        with evaluating(model):
            for chunk, completions in journaled_batches(prompts, batch_size, generate, journal, "generate"):
                outputs.extend(completions)
                if on_batch:
                    on_batch(len(chunk))
    finally:
        tokenizer.padding_side = side
    return outputs
