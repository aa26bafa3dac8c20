"""The DistilDP objective (SPEC §6 step 4), one value per example.

    L_i = (1 − λ)·CE_i + λ·t²·KL_i(softmax(f_T/t) ‖ softmax(f_S/t)) [+ α·MSE_i(h_T, h_S)]

Position t of a sequence predicts token t+1; only positions whose next-token label is learnt
(labels ≠ −100: neither the control code nor padding) enter any term, so the code positions,
where a code-trained teacher is skewed towards code text, are ignored as the paper does. Each
term is reduced per example like the CE (``sum`` over those positions or their ``mean``), so
the loss is per-example and DP-SGD (the DPKD baseline) can clip it. The MSE is the mean over
hidden dimensions of the last hidden states at the same positions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dptext.errors import UserError
from dptext.privacy.losses import per_example_loss

IGNORE_INDEX = -100


def next_token_mask(labels: Any, attention_mask: Any | None = None) -> Any:
    """(B, T) bool: position t's prediction (of token t+1) is learnt."""
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    mask = shifted != IGNORE_INDEX
    if attention_mask is not None:
        mask &= attention_mask.bool()
    return mask


def _reduce(per_position: Any, mask: Any, reduction: str) -> Any:
    total = (per_position * mask).sum(dim=1)
    return total if reduction == "sum" else total / mask.sum(dim=1).clamp(min=1)


def kl_per_example(student_logits: Any, teacher_logits: Any, mask: Any, temperature: float = 1.0,
                   reduction: str = "mean") -> Any:
    """Σ_v p_T(v)·(log p_T(v) − log p_S(v)) at each masked position, reduced per example."""
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise UserError(f"Teacher and student vocabularies differ ({teacher_logits.shape[-1]} vs "
                        f"{student_logits.shape[-1]} logits); distil into a student with the teacher's tokenizer.")
    log_p_teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    log_p_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    per_position = (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(dim=-1)
    return _reduce(per_position, mask, reduction)


def mse_per_example(student_hidden: Any, teacher_hidden: Any, mask: Any, reduction: str = "mean") -> Any:
    per_position = (student_hidden.float() - teacher_hidden.float()).pow(2).mean(dim=-1)
    return _reduce(per_position, mask, reduction)


def distillation_loss(student_logits: Any, labels: Any, attention_mask: Any | None, *,
                      teacher_logits: Any | None = None, kd_lambda: float = 0.4, temperature: float = 1.0,
                      hidden_alpha: float = 0.0, student_hidden: Any | None = None,
                      teacher_hidden: Any | None = None, reduction: str = "mean") -> Any:
    """(B,) per-example DistilDP loss; ``kd_lambda = 0`` is the plain per-example CE (no teacher needed)."""
    loss = per_example_loss(student_logits, labels, attention_mask, shift=True, reduction=reduction)
    if kd_lambda == 0 and hidden_alpha == 0:
        return loss
    mask = next_token_mask(labels, attention_mask)
    loss = (1 - kd_lambda) * loss
    if kd_lambda:
        loss = loss + kd_lambda * temperature ** 2 * kl_per_example(student_logits, teacher_logits, mask,
                                                                      temperature, reduction)
    if hidden_alpha:
        loss = loss + hidden_alpha * mse_per_example(student_hidden, teacher_hidden, mask, reduction)
    return loss
