"""An empty micro-batch (Poisson sampling draws one with probability (1-q)^n per step) through the public API, one
process: ``accumulate`` takes a 0-example loss and adds nothing, but the forward must get there first."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptext.privacy import PrivacyEngine

VOCAB = 11


def empty_loss_step(model, inputs, loss_of):
    engine = PrivacyEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                           max_grad_norm=0.5, expected_batch_size=4, dataset_size=12, verify=False)
    before = [p.detach().clone() for p in model.parameters()]
    norms = engine.accumulate(loss_of(model(inputs)))
    engine.step()
    assert norms.numel() == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # no noise (σ = 0), no sum


def test_an_empty_micro_batch_of_features_adds_nothing():
    torch.manual_seed(0)
    empty_loss_step(nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).double(),
                    torch.zeros(0, 7, dtype=torch.float64), lambda out: out.pow(2).sum(1))


def test_an_empty_micro_batch_of_token_ids_adds_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 6), nn.Linear(6, VOCAB)).double()
    empty_loss_step(model, torch.zeros(0, 5, dtype=torch.long), lambda logits: logits.pow(2).sum((1, 2)))
