"""The start-up probe's synthetic inputs (no private data): random token batches of a given shape, their
re-drawn rows, and the default per-example loss (a fixed random functional of the model's output)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.proof.independence import with_row
from dptext.privacy.proof.vocabulary import token_vocabulary


def synthetic_token_batch(model: nn.Module) -> Callable[[int, int, torch.Generator], dict[str, Tensor]]:
    """Random ids in [1, vocab) with right padding of unequal lengths (the first example is full length)."""
    vocab = token_vocabulary(model)
    if not vocab:
        raise UserError("The start-up probe cannot tell this model's vocabulary size to build its synthetic batch; "
                        "give PrivacyEngine(..., probe_batch=..., probe_loss=...) (or pass them to engine.verify()), "
                        "or opt out with verify=False / privacy.verify=false (recorded as 'clipping not verified').")

    def make_batch(examples: int, positions: int, generator: torch.Generator) -> dict[str, Tensor]:
        return random_token_batch(token_vocabulary(model) or vocab, generator, examples, positions)  # read at each
        # draw: under the probe's vocabulary cut (``proof.vocabulary``) the ids stay below it

    return make_batch


def random_token_batch(vocab: int, generator: torch.Generator, examples: int, positions: int) -> dict[str, Tensor]:
    """Ids in [1, vocab), right-padded with 0 to unequal lengths; the first example is full length, so the shape
    is (examples, positions) whatever the draw."""
    ids = torch.randint(1, max(vocab, 2), (examples, positions), generator=generator)
    lengths = torch.randint(max(1, positions // 2), positions + 1, (examples,), generator=generator)
    lengths[0] = positions
    mask = (torch.arange(positions)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def synthetic_batches(make_batch, examples: int, positions: int, number: int, device):
    """The probe's batch of this shape and its ``redraw(j)``: the batch with example j's row of every tensor
    taken from another synthetic batch of the same shape (to check that examples do not interact)."""
    def draw(seed: int) -> dict[str, Tensor]:
        fresh = make_batch(examples, positions, torch.Generator().manual_seed(seed))
        return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in fresh.items()}

    batch = draw(number)
    return batch, lambda example: with_row(batch, draw(1000 * (number + 1) + example), example)


def output_functional_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """A per-example loss that reaches every layer: a fixed random linear functional of each unpadded output."""
    out = model(**batch)
    hidden = getattr(out, "logits", None)
    if hidden is None:
        hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out[0] if isinstance(out, (tuple, list)) else out
    generator = torch.Generator().manual_seed(hidden.shape[-1])  # the same weights whatever the batch holds
    weights = torch.randn(hidden.shape[1:], generator=generator).to(hidden)
    terms = (hidden * weights).reshape(hidden.shape[0], -1, hidden.shape[-1]).sum(dim=-1)
    mask = batch.get("attention_mask")
    if mask is not None and terms.shape[1] == mask.shape[1]:
        terms = terms * mask.to(terms)
    return terms.sum(dim=1)
