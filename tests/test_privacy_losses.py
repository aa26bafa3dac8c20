"""Per-example losses: masks, the causal shift and the per-example reduction, against a direct loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dptext.privacy import causal_lm_loss, per_example_loss


def loop_loss(logits, labels, mask, shift, reduction):
    out = []
    for i in range(len(logits)):
        terms = []
        for t in range(logits.shape[1] - (1 if shift else 0)):
            target_position = t + 1 if shift else t
            label = int(labels[i, target_position])
            if label == -100 or mask[i, target_position] == 0:
                continue
            terms.append(F.cross_entropy(logits[i, t][None], torch.tensor([label])))
        total = torch.stack(terms).sum() if terms else torch.tensor(0.0)
        out.append(total / max(len(terms), 1) if reduction == "mean" else total)
    return torch.stack(out)


def test_masks_shift_and_reductions_match_a_loop():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 9)
    labels = torch.randint(0, 9, (3, 6))
    labels[0, :2] = -100
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 1:] = 0  # one real token: nothing to predict after the shift
    for shift in (True, False):
        for reduction in ("sum", "mean"):
            got = per_example_loss(logits, labels, mask, shift=shift, reduction=reduction)
            torch.testing.assert_close(got, loop_loss(logits, labels, mask, shift, reduction))
    assert causal_lm_loss(logits, labels, mask)[2] == 0


def test_padding_does_not_change_an_example_loss():
    torch.manual_seed(1)
    logits = torch.randn(1, 8, 5)
    labels = torch.randint(0, 5, (1, 8))
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    padded = per_example_loss(logits, labels, mask, shift=True)
    alone = per_example_loss(logits[:, :5], labels[:, :5], shift=True)
    torch.testing.assert_close(padded, alone)


def test_sequence_classification_and_bf16_logits():
    logits = torch.randn(4, 3, dtype=torch.bfloat16)
    labels = torch.tensor([0, 2, 1, -100])
    loss = per_example_loss(logits, labels)
    assert loss.dtype == torch.float32 and loss.shape == (4,) and loss[3] == 0
