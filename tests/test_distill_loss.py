"""The DistilDP loss (SPEC §6): hand-computed values, λ = 0 is plain CE, code positions and padding excluded."""

from __future__ import annotations

import math

import pytest
import torch

from dptext.distill.loss import distillation_loss, next_token_mask
from dptext.privacy.losses import per_example_loss

IGNORE = -100


def softmax(row, t=1.0):
    m = max(v / t for v in row)
    exps = [math.exp(v / t - m) for v in row]
    return [e / sum(exps) for e in exps]


def brute_force(student, teacher, labels, lam, t, reduction, alpha=0.0, hs=None, ht=None):
    """Loop over examples and positions with plain Python floats: the independent twin."""
    losses = []
    for b in range(len(labels)):
        ce = kl = mse = 0.0
        count = 0
        for pos in range(len(labels[b]) - 1):
            target = labels[b][pos + 1]
            if target == IGNORE:
                continue
            count += 1
            ce -= math.log(softmax(student[b][pos])[target])
            p_t, p_s = softmax(teacher[b][pos], t), softmax(student[b][pos], t)
            kl += sum(pt * (math.log(pt) - math.log(ps)) for pt, ps in zip(p_t, p_s))
            if alpha:
                mse += sum((x - y) ** 2 for x, y in zip(hs[b][pos], ht[b][pos])) / len(hs[b][pos])
        div = count if reduction == "mean" else 1
        losses.append(((1 - lam) * ce + lam * t * t * kl + alpha * mse) / div)
    return losses


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 5, 7, generator=g)
    teacher = torch.randn(2, 5, 7, generator=g) * 2
    # example 0: two code tokens (-100) then three text tokens; example 1: one code token, two text, two padding
    labels = torch.tensor([[IGNORE, IGNORE, 3, 1, 6], [IGNORE, 4, 0, IGNORE, IGNORE]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    return student, teacher, labels, mask


@pytest.mark.parametrize("lam,t,reduction", [(0.4, 1.0, "mean"), (0.4, 2.0, "sum"), (1.0, 1.0, "mean"),
                                             (0.7, 5.0, "mean")])
def test_equals_hand_computed(batch, lam, t, reduction):
    student, teacher, labels, mask = batch
    got = distillation_loss(student, labels, mask, teacher_logits=teacher, kd_lambda=lam, temperature=t,
                            reduction=reduction)
    want = brute_force(student.tolist(), teacher.tolist(), labels.tolist(), lam, t, reduction)
    assert got.tolist() == pytest.approx(want, rel=1e-5)


def test_lambda_zero_is_plain_cross_entropy(batch):
    student, teacher, labels, mask = batch
    for reduction in ("sum", "mean"):
        ce = per_example_loss(student, labels, mask, shift=True, reduction=reduction)
        assert torch.equal(distillation_loss(student, labels, mask, teacher_logits=None, kd_lambda=0.0,
                                             reduction=reduction), ce)
        assert distillation_loss(student, labels, mask, teacher_logits=teacher, kd_lambda=0.0,
                                 reduction=reduction).tolist() == pytest.approx(ce.tolist())


def test_code_positions_and_padding_do_not_enter_the_kl(batch):
    student, teacher, labels, mask = batch
    base = distillation_loss(student, labels, mask, teacher_logits=teacher, kd_lambda=1.0)
    # positions whose next token is a code token (example 0: position 0) or padding (example 1: 2, 3, 4)
    changed = teacher.clone()
    changed[0, 0] += 10 * torch.randn(7)
    changed[1, 2:] += 10 * torch.randn(3, 7)
    assert torch.equal(distillation_loss(student, labels, mask, teacher_logits=changed, kd_lambda=1.0), base)
    # position 1 of example 0 predicts the first text token: it counts
    changed[0, 1] += 10 * torch.randn(7)
    assert distillation_loss(student, labels, mask, teacher_logits=changed, kd_lambda=1.0)[0] != base[0]
    assert next_token_mask(labels, mask).tolist() == [[False, True, True, True, False],
                                                      [True, True, False, False, False]]


def test_identical_teacher_gives_zero_kl(batch):
    student, _, labels, mask = batch
    kd = distillation_loss(student, labels, mask, teacher_logits=student.clone(), kd_lambda=1.0)
    assert kd.abs().max().item() < 1e-6


def test_hidden_state_mse_term(batch):
    student, teacher, labels, mask = batch
    g = torch.Generator().manual_seed(1)
    hs, ht = torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)
    got = distillation_loss(student, labels, mask, teacher_logits=teacher, kd_lambda=0.4, hidden_alpha=0.3,
                            student_hidden=hs, teacher_hidden=ht)
    want = brute_force(student.tolist(), teacher.tolist(), labels.tolist(), 0.4, 1.0, "mean", 0.3, hs.tolist(),
                       ht.tolist())
    assert got.tolist() == pytest.approx(want, rel=1e-5)


def test_gradient_flows_to_the_student_only(batch):
    student, teacher, labels, mask = batch
    student = student.clone().requires_grad_(True)
    teacher = teacher.clone().requires_grad_(True)
    distillation_loss(student, labels, mask, teacher_logits=teacher.detach(), kd_lambda=0.4).sum().backward()
    assert student.grad is not None and student.grad[0, 0].abs().sum() == 0  # a code position: no signal
    assert teacher.grad is None
