"""Per-example losses from Hugging Face logits and labels, with masks (SPEC §1).

DP-SGD clips each example's gradient, so it needs one loss per example, never the model's batch-averaged
``outputs.loss``. ``per_example_loss`` returns a (B,) tensor:
* token-level logits (B, T, V) with labels (B, T): cross-entropy per token; tokens labelled -100 and
  positions where ``attention_mask`` is 0 contribute nothing. ``shift=True`` (causal LMs) predicts token t+1
  from position t, as HF's causal-LM loss does; masked LMs and token classification use ``shift=False``.
* sequence-level logits (B, C) with labels (B,): one cross-entropy per example.
``reduction`` says how an example's own tokens are combined:
* ``"sum"`` (default): the sum over its tokens. Every token weighs the same, so long examples get larger
  gradients before clipping; with clipping that is usually what one wants for language modelling.
* ``"mean"``: the mean over its own counted tokens (0 for an example with none), so every example weighs
  the same before clipping. Either choice is per example, so it does not change privacy.
Computed in fp32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def per_example_loss(logits: Tensor, labels: Tensor, attention_mask: Tensor | None = None, *,
                     shift: bool = False, reduction: str = "sum", ignore_index: int = IGNORE_INDEX) -> Tensor:
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if logits.ndim == 2:  # sequence classification: one label per example
        return F.cross_entropy(logits.float(), labels, reduction="none", ignore_index=ignore_index)
    labels = labels.clone()
    if attention_mask is not None:
        labels[attention_mask == 0] = ignore_index
    if shift:  # position t predicts token t+1; shift the labels, not the (B, T, V) logits, to avoid a copy
        labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)
    # (B·T, V) rows: log-softmax over a contiguous vocabulary dimension is several times faster than over dim 1
    per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none",
                                ignore_index=ignore_index).view(labels.shape)
    total = per_token.sum(dim=1)
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum(dim=1).clamp(min=1)


def causal_lm_loss(logits: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None,
                   labels: Tensor | None = None, reduction: str = "sum") -> Tensor:
    """Per-example next-token loss; ``labels`` defaults to ``input_ids`` (with -100 where not to learn)."""
    return per_example_loss(logits, input_ids if labels is None else labels, attention_mask, shift=True,
                            reduction=reduction)
