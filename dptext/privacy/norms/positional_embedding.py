"""Learned positional embeddings that compute their own ids: OPT, BioGPT (from the attention mask) and BART,
mBART (from the sequence length), each looking up row ``position + offset`` (offset 2, a fairseq legacy).

The lookup itself is a plain embedding, so the Embedding rule applies once the ids it used are known; this rule
only recomputes those ids the way the layer's forward does, from its positional and keyword arguments:
* OPT/BioGPT: position_t = cumsum(mask)_t · mask_t − 1 (padding → −1, i.e. row offset − 1), cut after the
  cached tokens, or the ``position_ids`` given (one row per example, or one row for all: BioGPT passes its cache
  positions);
* BART/mBART: position_t = past + t for every example (the encoder passes a float tensor, used for its shape), or
  the one row of ``position_ids`` given (the decoder passes its cache positions).
Given one row of positions, the layer returns a single row that the model broadcasts over the batch;
``broadcast_output`` expands it first, so that each example's gradient reaches the hook separately (a broadcast
would sum them).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dptext.errors import UserError
from dptext.privacy.norms.embedding import EmbeddingRule
from dptext.privacy.norms.registry import register_rule_by_name


def argument(args: tuple, kwargs: dict, index: int, name: str, default=None):
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _layer(family: str, name: str) -> str:
    return f"transformers.models.{family}.modeling_{family}.{name}"


def position_call(args: tuple, kwargs: dict, first: str) -> tuple:
    """The three inputs every learned-position embedding takes: (``first``, past length, position_ids)."""
    return (argument(args, kwargs, 0, first), int(argument(args, kwargs, 1, "past_key_values_length", 0)),
            argument(args, kwargs, 2, "position_ids"))


class PositionalEmbeddingRule(EmbeddingRule):
    def broadcast_output(self, module: nn.Module, output: Tensor, ids: Tensor) -> Tensor:
        """Given one row of position_ids (BART's decoder passes its cache positions), the layer returns one row of
        embeddings that the model adds to every example; a view expanded to the batch computes the same sum and
        keeps each example's gradient its own instead of summed over the batch."""
        return output.expand(ids.shape[0], *output.shape[1:]) if output.shape[0] == 1 else output


@register_rule_by_name(_layer("opt", "OPTLearnedPositionalEmbedding"),
                       _layer("biogpt", "BioGptLearnedPositionalEmbedding"))
class MaskPositionalEmbeddingRule(PositionalEmbeddingRule):
    def keep_call(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
        mask, past, position_ids = position_call(args, kwargs, "attention_mask")
        if position_ids is None:
            position_ids = (torch.cumsum(mask, dim=1) * mask - 1).long()[:, past:]
        elif position_ids.shape[0] not in (1, mask.shape[0]):
            raise UserError(f"{type(module).__name__} got position_ids for {position_ids.shape[0]} rows but a "
                            f"batch of {mask.shape[0]}; pass one row of position ids per example.")
        return (position_ids + module.offset).reshape(-1, position_ids.shape[-1]).expand(mask.shape[0], -1)


@register_rule_by_name(_layer("bart", "BartLearnedPositionalEmbedding"),
                       _layer("mbart", "MBartLearnedPositionalEmbedding"))
class RangePositionalEmbeddingRule(PositionalEmbeddingRule):
    def keep_call(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
        shape_of, past, position_ids = position_call(args, kwargs, "input_ids")
        batch, length = shape_of.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=shape_of.device)
        elif position_ids.ndim != 1:
            raise UserError(f"{type(module).__name__} takes position_ids of one row shared by the batch "
                            f"(got shape {tuple(position_ids.shape)}); leave position_ids unset.")
        return (position_ids + module.offset).expand(batch, -1)
